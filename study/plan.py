"""What the runs of a study (`parts.planned_runs`) will take and what they can decide, printed before they
run (`plan_study`):

1. `calibrate`: one step and two evaluations, trained by train.py on this device at the comparison runs'
   settings, as one of the study's runs (a worker with its share of the cores, or its own GPU). The step is
   AVSPO's always on, which gives every row an advantage: its update is a whole batch's, in time and memory,
   where a GRPO step of collapsed groups would train nothing. What train.py logged gives the seconds of a
   step (and of its sampling), of an evaluated problem and of the rest of a run (loading, the report), the
   step's raw ACR and the peak memory (`Calibration`).
2. `run_seconds`: a run's seconds from them; `study_plan` adds up the runs of the parts asked for.
3. `fit_budget`: with --budget-minutes, the seeds, steps and evaluation size that fit, by the rule in its
   docstring; where nothing fits, the smallest plan it reached and its minutes.
4. `interval_plan`: each comparison's expected interval and the seeds (crossed: and problems) that would
   decide --margin, by the study's design (`stats`), from the variances of finished compare runs
   (`compare_variances`).
"""

import argparse
import dataclasses
import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np

import train
from data.tasks import by_level, data_line, load_problems
from infra.hardware import device_memory_bytes, pick_device
from infra.written import NotWritten, owned
from loop.run_folder import read_jsonl
from study.flags import BASELINE, METHODS, as_flags
from study.parts import planned_runs
from study.runs import Run, as_written, check_run, finished, held_out, run_args, run_dir, run_training
from study.stats import (as_design, design, expected_half_width, problems_to_decide, seeds_to_decide,
                         variance_parts)
from study.workers import run_all, runs_at_once

CALIBRATION_PROBLEMS = 32  # eval.evaluate's batch: a full one gives a problem's share of its time
SCORED = ("compare", "readings", "lora")  # the parts whose final models are evaluated problem by problem


# ------------------------------------------------------------------------------ their time, measured first


@dataclass(frozen=True)
class Calibration:
    """One step of `rows` completions, every one trained, and its evaluations, on the study's device."""
    step_seconds: float  # sampling, scoring and the update of every row: any method's at most
    sample_seconds: float  # of which sampling and scoring: what AAPO's reference and DAPO's resampling repeat
    problem_seconds: float  # a problem evaluated greedily
    run_seconds: float  # the rest of a run: loading the model and data, the report
    rows: int  # B x G
    acr: float  # the step's raw ACR: the share of groups DAPO samples again
    peak_bytes: int  # the run's peak memory (`hardware.peak_memory_bytes`)
    device_bytes: int  # the device's memory (`hardware.device_memory_bytes`)


def calibration_run(args: argparse.Namespace) -> Run:
    """The calibration's train.py run: the comparison runs' settings, 1 step of AVSPO always on (every row
    trained), an evaluation of at most CALIBRATION_PROBLEMS problems before and after it, no checkpoint; in
    <out>/calibration/<a hash of its flags and --jobs, which sets a CPU run's threads>, so that a study asking
    for the same settings reuses it and one asking for others does not."""
    config = dataclasses.replace(args.train, steps=1, eval_every=0, save_every=0,
                                 eval_size=min(args.train.eval_size, CALIBRATION_PROBLEMS))
    algo, always = METHODS["avspo-always"]
    flags = as_flags(config) + always
    key = hashlib.sha256("\0".join([*flags, f"--jobs={args.jobs}"]).encode()).hexdigest()[:12]
    return Path(args.out) / "calibration" / key, 0, algo, flags


def train_calibration(run: Run) -> int:
    """Train the calibration run (`run_training`: reused when finished); the device's memory, where it ran."""
    run_training(run)
    return device_memory_bytes(pick_device(run_args(run).device))


def calibrate(args: argparse.Namespace) -> Calibration:
    """Train the calibration run as the study's runs will be trained (`run_all`: --jobs), then read what
    train.py wrote of it (each file as train.py left it: `check_run`)."""
    run = calibration_run(args)
    # the study's folder, known as a script's (infra/written.py)
    with owned(Path(args.out), "experiments") as out:
        out.subfolder("calibration", "experiments")
    check_run(*run)
    if not finished(run[0] / run[2]):
        print(f"calibration: one step, every row trained, and two evaluations at the comparison runs' "
              f"settings, as one of --jobs {args.jobs}, in {run[0]}", flush=True)
    device_bytes, = run_all([(train_calibration, run)], args.jobs)
    check_run(*run)
    folder = run[0] / run[2]
    step, = read_jsonl(folder / "metrics.jsonl")
    evals, problems = read_jsonl(folder / "evals.jsonl"), len(read_jsonl(folder / "eval_records.jsonl"))
    summary = json.loads((folder / "summary.json").read_text())  # whole: check_run
    sample = step["time_generate"] + step["time_score"]
    evaluating = sum(e["time_eval"] for e in evals)
    return Calibration(step_seconds=sample + step["time_train"], sample_seconds=sample,
                       problem_seconds=evaluating / (len(evals) * problems),
                       run_seconds=max(0.0, summary["time_run"] - sample - step["time_train"] - evaluating),
                       rows=args.train.prompts_per_step * args.train.group_size, acr=step["acr"],
                       peak_bytes=step["peak_memory_bytes"], device_bytes=device_bytes)


def evaluations(steps: int, every: int) -> int:
    """train.py's evaluations of a run: before training, every `every` steps, and after the last (0: before
    and after alone)."""
    return 2 if every == 0 else steps // every + 1 + (steps % every > 0)


def run_seconds(cal: Calibration, config: train.Args, held: int, final: int) -> float:
    """A run's seconds: the rest of a run, its steps and train.py's evaluations of its `held`-problem split,
    then its final model's evaluation of `final` problems (0: train.py's last one covered them), which loads
    the checkpoint again. A step scales with its B x G, and trains every row (an upper bound: GRPO, AAPO and
    DAPO skip the rows whose advantage is 0); AAPO's samples again for its reference, DAPO's for the
    collapsed groups, round after round (a share `acr` of them each time, as in the calibration)."""
    again = {"aapo": 1.0, "dapo": sum(cal.acr**k for k in range(1, config.resample_rounds + 1))}
    step = (cal.step_seconds + again.get(config.algo, 0.0) * cal.sample_seconds) / cal.rows
    problems = evaluations(config.steps, config.eval_every) * min(config.eval_size, held) + final
    return (cal.run_seconds * (1 + (final > 0)) + config.steps * step * config.prompts_per_step
            * config.group_size + problems * cal.problem_seconds)


@dataclass
class Plan:
    """A study's runs and their seconds (`study_plan`), `parallel` at once."""
    seconds: dict[Path, float]  # each run's folder (<out>/<algo>) -> its seconds
    steps: int
    problems: int  # evaluated, by train.py and the final evaluations
    alone: float  # seconds outside the runs, one thing at a time: the difficulty part's sampling
    parallel: int

    @property
    def minutes(self) -> float:
        return (sum(self.seconds.values()) / self.parallel + self.alone) / 60


def difficulty_seconds(cal: Calibration, levels: int, prompts: int) -> float:
    """The difficulty part's seconds: the untrained model loaded once, G = 8 completions sampled for `prompts`
    problems of each of `levels` levels, outside the runs."""
    return cal.run_seconds + levels * prompts * 8 * cal.sample_seconds / cal.rows


def study_plan(runs: list[Run], out: Path, final: int, cal: Calibration, parallel: int, alone: float = 0.0,
               held: dict[tuple, int] | None = None) -> Plan:
    """The seconds of these runs of a study in `out`; those of the SCORED parts evaluate their final models
    on `final` problems where train.py's last evaluation did not; `alone`: the seconds outside the runs
    (`difficulty_seconds`); `held`: (dataset, eval dataset) -> its held-out split's size, filled as the runs
    need them (pass the same dict to plans of one study: each split is loaded once)."""
    held = {} if held is None else held
    seconds, steps, problems = {}, 0, 0
    for run in runs:
        config = run_args(run)
        key = (config.dataset, config.eval_dataset)
        held[key] = held.get(key) or len(held_out(config, 0, None))
        scored = run[0].relative_to(out).parts[0] in SCORED
        covered = final == held[key] and config.eval_size >= held[key]
        evaluated = final if scored and not covered else 0
        seconds[run[0] / run[2]] = run_seconds(cal, config, held[key], evaluated)
        steps += config.steps
        evals = evaluations(config.steps, config.eval_every)
        problems += evals * min(config.eval_size, held[key]) + evaluated
    return Plan(seconds, steps, problems, alone, parallel)


@dataclass(frozen=True)
class Scale:
    """What --budget-minutes may choose: the comparison runs' seeds, steps and evaluation size."""
    seeds: tuple[int, ...]
    steps: int
    eval_size: int


def fit_budget(minutes: Callable[[Scale], float], asked: Scale, budget: float, free: set[str],
               most_seeds: int | None, skip_seed: int) -> tuple[Scale, bool]:
    """The scale a study runs at within `budget` minutes, and whether it fits. Only the `free` fields move
    (those the user did not give). The rule, in order:
    1. the asked scale fits: seeds are added (the next integers, but `skip_seed`) while the plan fits, up to
       `most_seeds`, those that would decide the margin (none where no variances are known);
    2. else the evaluation every --eval-every steps halves, down to CALIBRATION_PROBLEMS (the final
       evaluation, which the intervals come from, keeps every problem): the curves get coarser first;
    3. then seeds go, the last first, down to 2 (the fewest that give a spread);
    4. then steps, down to a quarter of those asked, the most that fit: fewer would ask another question.
    Where even that does not fit, the smallest scale reached, and False."""
    scale = asked
    if minutes(scale) <= budget:
        while "seeds" in free and len(scale.seeds) < (most_seeds or 0):
            more = dataclasses.replace(scale, seeds=(*scale.seeds, next_seed(scale.seeds, skip_seed)))
            if minutes(more) > budget:
                break
            scale = more
        return scale, True
    least_eval = min(asked.eval_size, CALIBRATION_PROBLEMS)
    while "eval_size" in free and scale.eval_size > least_eval and minutes(scale) > budget:
        scale = dataclasses.replace(scale, eval_size=max(least_eval, scale.eval_size // 2))
    while "seeds" in free and len(scale.seeds) > 2 and minutes(scale) > budget:
        scale = dataclasses.replace(scale, seeds=scale.seeds[:-1])
    if "steps" in free and minutes(scale) > budget:
        low, high = max(1, asked.steps // 4), asked.steps  # the most steps that fit: a bisection
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if minutes(dataclasses.replace(scale, steps=middle)) <= budget \
                else (low, middle - 1)
        scale = dataclasses.replace(scale, steps=low)
    return scale, minutes(scale) <= budget


def next_seed(seeds: tuple[int, ...], skip: int) -> int:
    """The integer after the largest of `seeds`, but `skip` (the lora part's sweep seed)."""
    seed = max(seeds) + 1
    return seed + 1 if seed == skip else seed


def scale_of(args: argparse.Namespace) -> Scale:
    """The study's scale, as its flags ask."""
    return Scale(tuple(int(s) for s in args.seeds.split(",")), args.train.steps, args.train.eval_size)


def scaled(args: argparse.Namespace, scale: Scale) -> argparse.Namespace:
    """The study's flags at `scale`."""
    config = dataclasses.replace(args.train, steps=scale.steps, eval_size=scale.eval_size)
    return argparse.Namespace(**{**vars(args), "seeds": ",".join(map(str, scale.seeds)), "train": config})


def print_plan(plan: Plan, cal: Calibration, sharing: int) -> None:
    """The runs, steps, evaluations and minutes of a plan, what the calibration measured, and the peak memory
    of the `sharing` runs on one device against the device's."""
    gib = 2**30
    print(f"plan: {len(plan.seconds)} training runs, {plan.steps} steps, {plan.problems} problems evaluated: "
          f"about {plan.minutes:.1f} min, {plan.parallel} run{'s' * (plan.parallel > 1)} at once")
    print(f"  calibrated here: a step of {cal.rows} completions {cal.step_seconds:.1f} s (sampling "
          f"and scoring {cal.sample_seconds:.1f} s), an evaluated problem {cal.problem_seconds:.2f} s, the "
          f"rest of a run {cal.run_seconds:.0f} s; peak memory {cal.peak_bytes / gib:.1f} GiB a run, "
          f"{sharing} on a device: {sharing * cal.peak_bytes / gib:.1f} of its "
          f"{cal.device_bytes / gib:.1f} GiB")
    # the allocator's fragmentation: 10% (infra/memory.py)
    if sharing * cal.peak_bytes > 0.9 * cal.device_bytes:
        print(f"warning: {sharing} runs of {cal.peak_bytes / gib:.1f} GiB on a device of "
              f"{cal.device_bytes / gib:.1f} GiB may not fit: fewer --jobs, or --grad-checkpointing, or "
              "--lora-rank")


class NoPlanFits(Exception):
    """--budget-minutes is too short for the study by `fit_budget`'s rule (one line: what would fit)."""


def plan_study(args: argparse.Namespace, parts: list[str]) -> tuple[argparse.Namespace, dict[Path, float]]:
    """Calibrate (`calibrate`), fit --budget-minutes (`fit_budget`; NoPlanFits where nothing fits), print the
    plan and the intervals it expects: the study's flags at the scale chosen, and the seconds of each run
    still to train. Without a budget, a study whose runs are all trained (and no difficulty part, which
    samples afresh) plans nothing: the figures of finished runs."""
    trained = all(finished(out / algo) for out, _, algo, _ in planned_runs(args, parts, every_rate=False))
    if args.budget_minutes is None and trained and "difficulty" not in parts:
        print("plan: every run is trained; nothing to plan")
        return args, {}
    cal = calibrate(args)
    parallel, sharing = runs_at_once(args.jobs, args.train.device)
    final = len(held_out(args.train, 0, args.per_level or None))
    levels = len(by_level(load_problems(args.train.dataset))) if "difficulty" in parts else 0
    alone, held = difficulty_seconds(cal, levels, args.difficulty_prompts) if levels else 0.0, {}

    def plan_at(scale: Scale) -> Plan:  # many a time for --budget-minutes: the data loaded once
        runs = planned_runs(scaled(args, scale), parts, every_rate=False)
        return study_plan(runs, Path(args.out), final, cal, parallel, alone, held)

    if args.budget_minutes is not None:
        free = {"steps", "eval_size"} - set(args.given) | (set() if args.seeds_given else {"seeds"})
        needed = interval_plan(args)[1] if "compare" in parts else None
        scale, fits = fit_budget(lambda at: plan_at(at).minutes, scale_of(args), args.budget_minutes, free,
                                 needed, args.sweep_seed)
        seeds = ",".join(map(str, scale.seeds))
        chosen = f"--seeds {seeds} --steps {scale.steps} --eval-size {scale.eval_size}"
        if not fits:
            raise NoPlanFits(f"no plan fits --budget-minutes {args.budget_minutes:g}: the smallest by "
                             f"plan.fit_budget's rule ({chosen}) takes about "
                             f"{plan_at(scale).minutes:.1f} min; give that budget, fewer --methods or parts "
                             "(--only), or fix fewer of --seeds, --steps and --eval-size: no run started")
        print(f"--budget-minutes {args.budget_minutes:g} fits {chosen} (plan.fit_budget's rule)")
        args = scaled(args, scale)
    plan = plan_at(scale_of(args))
    print_plan(plan, cal, sharing)
    print(f"  {data_line(args.train.dataset, args.train.eval_dataset)}")  # what the runs will be known by
    if "compare" in parts:
        print(interval_plan(args)[0])
    left = {folder: seconds for folder, seconds in plan.seconds.items() if not finished(folder)}
    if len(left) < len(plan.seconds):
        print(f"  {len(plan.seconds) - len(left)} of the runs are trained: about "
              f"{(sum(left.values()) / parallel + plan.alone) / 60:.1f} min left")
    return args, left


# the README's comparison
COMMITTED = Path(__file__).resolve().parent.parent / "runs" / "experiments" / "compare"


def interval_plan(args: argparse.Namespace) -> tuple[str, int | None]:
    """compare's expected 95% half width of each Δ vs GRPO and the seeds that would decide ±--margin, by the
    design this study will have (`stats.design` of its held-out problems) and the variances of finished
    compare runs: the study's own, else the checkout's committed ones, said to be borrowed. The line to
    print, and those seeds (None where no variances are known, or the problems set the floor)."""
    methods, seeds = args.methods.split(","), len(args.seeds.split(","))
    if seeds < 2:
        return "compare: one seed gives no interval (no spread between seeds): no interval planned", None
    try:
        found = compare_variances([Path(args.out) / "compare", COMMITTED], methods)
    except NotWritten as e:  # a final evaluation changed since it was written: nothing taken from it
        return f"compare: no interval planned: {e}", None
    if found is None:
        return "compare: no finished runs of two seeds to take the variances from: no interval planned", None
    measured, folder, dataset = found
    held = [held_out(args.train, s, args.per_level or None) for s in (0, 1)]
    problems = len(held[0])
    target = design(np.array([[p.question for p in split] for split in held]))
    parts, assumed = as_design(measured, target)
    source = (f"from this study's runs in {folder}" if folder != COMMITTED else
              f"borrowed from the committed comparison on {dataset} ({folder}, {measured['design']})")
    width = expected_half_width(seeds, problems, parts)
    needed = seeds_to_decide(args.margin, problems, parts)
    if needed or target == "nested":
        decides = f"takes {needed} seeds" if needed else "takes more than 200 seeds"
    else:  # the seeds enough without the problems' shared part, doubled until a test set would do
        at = max(seeds, seeds_to_decide(args.margin, problems, {**parts, "problem_var": 0.0}) or seeds)
        more = problems_to_decide(at, args.margin, problems, parts)
        while more is None and at < 200:
            at, more = 2 * at, problems_to_decide(2 * at, args.margin, problems, parts)
        decides = (f"no number of seeds does over {problems} problems: the problems set the floor; {at} "
                   f"seeds need a test set of {f'about {more:,}' if more else 'more than 65,536'} problems")
    return (f"compare: each Δ vs {BASELINE} over {seeds} seeds of {problems} held-out problems ({target}): "
            f"expected 95% interval ±{100 * width:.1f} points (variances {source}: {parts['seed_var']:.5f} "
            f"between seeds, {parts['problem_var']:.3f} a problem shared by the seeds, "
            f"{parts['noise_var']:.3f} a problem's noise{assumed}); deciding ±{100 * args.margin:g} points 4 "
            f"times in 5 at a true Δ of 0 {decides}"), needed


def evaluated_seeds(folder: Path, method: str) -> set[int]:
    """The seeds of `method` in a compare folder whose final evaluation is there (`run_dir`'s names)."""
    named = (re.fullmatch(rf"seed(\d+)-{re.escape(method)}", p.name) for p in folder.glob(f"seed*-{method}"))
    return {int(m[1]) for m in named if m and (folder / m[0] / "final_eval.jsonl").exists()}


def compare_variances(folders: list[Path], methods: list[str]) -> tuple[dict, Path, str] | None:
    """(parts, folder, dataset): the variance parts of the paired Δs against GRPO (`stats.variance_parts`, by
    the design their problems show, averaged over the methods), from the first folder holding finished
    compare runs of GRPO and another method on two seeds or more, each final evaluation on the same
    problems, and the dataset they trained on; None where none does."""
    answers = {}  # (folder, method, seed) -> the final evaluation's records, each file read once

    def answers_of(folder: Path, method: str, seed: int) -> list[dict]:
        if (folder, method, seed) not in answers:
            run = run_dir(folder, method, seed).parent  # where the study caches final_eval.jsonl
            as_written(run, "runs", ("final_eval.jsonl",))
            answers[folder, method, seed] = read_jsonl(run / "final_eval.jsonl")
        return answers[folder, method, seed]

    for folder in folders:
        parts = []
        for method in [m for m in methods if m != BASELINE]:
            seeds = sorted(evaluated_seeds(folder, method) & evaluated_seeds(folder, BASELINE))
            if len(seeds) < 2:
                continue
            base, other = ([answers_of(folder, name, s) for s in seeds] for name in (BASELINE, method))
            problems = np.array([[r["question"] for r in records] for records in base])  # [S, N]
            if problems.tolist() == [[r["question"] for r in records] for records in other]:
                d = np.array([[r["correct"] for r in records] for records in other], dtype=float) \
                    - np.array([[r["correct"] for r in records] for records in base], dtype=float)  # [S, N]
                parts.append(variance_parts(d, problems))
        if parts:
            mean = {key: float(np.mean([p[key] for p in parts])) for key in ("seed_var", "problem_var",
                                                                               "noise_var")}
            config = json.loads((run_dir(folder, BASELINE, seeds[0]) / "config.json").read_text())
            return {"design": parts[0]["design"], **mean}, folder, config["dataset"]
    return None

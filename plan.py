"""What a study will take and what it can decide, printed before it runs: its runs, steps and minutes, and
each comparison's expected interval and the seeds that would decide --margin (`stats`)."""

import argparse
import re
from pathlib import Path

import numpy as np

import train
from data.tasks import by_level, load_problems
from run_folder import read_jsonl
from stats import expected_half_width, seeds_to_decide, variance_parts
from study_runs import BASELINE, LORA, PRECISIONS, as_written, held_out, run_dir
from written import NotWritten


def evaluations(steps: int, every: int) -> int:
    """train.py's evaluations of a run: before training, every `every` steps, and after the last (0: before
    and after alone)."""
    return 2 if every == 0 else steps // every + 1 + (steps % every > 0)


def estimate(args, parts: list[str]) -> tuple[int, int, float, float]:
    """(runs, training steps, step units, eval units), before skipping finished runs. Time in seconds is about
    step_units x step_seconds + eval_units x eval_seconds: a step of B prompts x G completions is B*G/64 step
    units (sampling 8 x 8 for the difficulty part: half a unit), an evaluation of n problems n/336 eval units;
    a compare run evaluates 3 times (train.py before and after, the per-problem one), a scatter run twice."""
    runs = steps = step_units = eval_units = 0
    config = args.train
    held, final = (len(held_out(config, 0, per_level)) for per_level in (None, args.per_level or None))
    sweep = len(args.full_lrs.split(",")) + (len(LORA) - 1) * len(args.lora_lrs.split(","))
    for part, n in (("compare", len(args.methods.split(",")) * len(args.seeds.split(","))),
                    ("readings", len(args.readings.split(",")) * len(args.seeds.split(","))),
                    ("lora", len(LORA) * len(args.seeds.split(",")) + sweep)):  # lora: its sweep's runs too
        if part in parts:
            runs, steps = runs + n, steps + n * config.steps
            step_units += n * config.steps * config.prompts_per_step * config.group_size / 64
            evals = evaluations(config.steps, config.eval_every)
            eval_units += n * (evals * min(config.eval_size, held) + final) / 336
    if "scatter" in parts:
        gs = [int(g) for g in args.scatter_g.split(",")]
        n = len(args.scatter_levels.split(",")) * len(args.scatter_seeds.split(","))
        runs, steps = runs + n * len(gs), steps + n * len(gs) * args.scatter_steps
        step_units += n * args.scatter_steps * args.scatter_prompts * sum(gs) / 64
        eval_units += n * len(gs) * 2 * args.scatter_eval_size / 336
    if "difficulty" in parts:
        step_units += len(by_level(load_problems(config.dataset))) * args.difficulty_prompts * 8 / 64 / 2
    if "precision" in parts:  # train.py's own B, G and evaluation schedule, but for the flags given
        n, default = len(PRECISIONS) * len(args.precision_seeds.split(",")), train.Args(**args.given)
        runs, steps = runs + n, steps + n * args.precision_steps
        step_units += n * args.precision_steps * default.prompts_per_step * default.group_size / 64
        evals = evaluations(args.precision_steps, default.eval_every)
        eval_units += n * evals * min(default.eval_size, 336) / 336
    return runs, steps, step_units, eval_units


def print_estimate(args: argparse.Namespace, parts: list[str]) -> None:
    """The runs and the time they would take, with a warning when that exceeds --budget-minutes."""
    runs, steps, step_units, eval_units = estimate(args, parts)
    minutes = (step_units * args.step_seconds + eval_units * args.eval_seconds) / 60
    print(f"{runs} training runs, {steps} steps ({step_units:.0f} B=8 x G=8 step equivalents, "
          f"{eval_units:.0f} 336-problem evals): about {minutes:.0f} min at {args.step_seconds:g} s/step, "
          f"{args.eval_seconds:g} s/eval")
    if minutes > args.budget_minutes:  # say what would fit rather than start a run that overruns
        fits = (args.budget_minutes * 60 - eval_units * args.eval_seconds) / step_units
        print(f"warning: over the {args.budget_minutes:g}-min budget; it fits at <= {fits:.1f} s/step, "
              "or with fewer --steps, --seeds, --scatter-steps or a smaller --scatter-g grid")


COMMITTED = Path(__file__).resolve().parent / "runs" / "experiments" / "compare"  # the README's comparison


def evaluated_seeds(folder: Path, method: str) -> set[int]:
    """The seeds of `method` in a compare folder whose final evaluation is there (`run_dir`'s names)."""
    named = (re.fullmatch(rf"seed(\d+)-{re.escape(method)}", p.name) for p in folder.glob(f"seed*-{method}"))
    return {int(m[1]) for m in named if m and (folder / m[0] / "final_eval.jsonl").exists()}


def compare_variances(folders: list[Path], methods: list[str]) -> tuple[float, float, Path] | None:
    """(problem_var, seed_var, folder) of the paired Δs against GRPO (`stats.variance_parts`, averaged over
    the methods) from the first folder holding finished compare runs of GRPO and another method on two seeds
    or more, each final evaluation on the same problems; None where none does."""
    answers = {}  # (folder, method, seed) -> the final evaluation's answers, each file read once

    def answers_of(folder: Path, method: str, seed: int) -> list[bool]:
        if (folder, method, seed) not in answers:
            run = run_dir(folder, method, seed).parent  # where the study caches final_eval.jsonl
            as_written(run, "runs", ("final_eval.jsonl",))
            answers[folder, method, seed] = [r["correct"] for r in read_jsonl(run / "final_eval.jsonl")]
        return answers[folder, method, seed]

    for folder in folders:
        parts = []
        for method in [m for m in methods if m != BASELINE]:
            seeds = sorted(evaluated_seeds(folder, method) & evaluated_seeds(folder, BASELINE))
            if len(seeds) < 2:
                continue
            pair = [np.array([answers_of(folder, name, s) for s in seeds], dtype=float)
                    for name in (BASELINE, method)]  # [S, N] each
            if pair[0].shape == pair[1].shape:
                parts.append(variance_parts(*pair))
        if parts:
            return (*np.mean(parts, axis=0).tolist(), folder)
    return None


def print_interval_plan(args: argparse.Namespace) -> None:
    """compare's expected 95% half width of each Δ vs GRPO, and the seeds that would decide ±--margin, from
    the variances of finished compare runs (this study's, else the checkout's committed ones; `stats`)."""
    methods, seeds = args.methods.split(","), len(args.seeds.split(","))
    try:
        found = compare_variances([Path(args.out) / "compare", COMMITTED], methods)
    except NotWritten as e:  # a final evaluation changed since it was written: nothing taken from it
        print(f"compare: no interval planned: {e}")
        return
    if found is None:
        print("compare: no finished runs of two seeds to take the variances from: no interval planned")
        return
    problem_var, seed_var, folder = found
    problems = len(held_out(args.train, 0, args.per_level or None))
    width = expected_half_width(seeds, problems, problem_var, seed_var)
    needed = seeds_to_decide(args.margin, problems, problem_var, seed_var)
    print(f"compare: each Δ vs {BASELINE} over {seeds} seeds of {problems} held-out problems: expected 95% "
          f"interval ±{100 * width:.1f} points (variances from {folder}: {problem_var:.3f} a problem, "
          f"{seed_var:.5f} between seeds); deciding ±{100 * args.margin:g} points 4 times in 5 at a true Δ "
          f"of 0 takes {needed or 'more than 1000'} seeds")

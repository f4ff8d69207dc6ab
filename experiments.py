"""The methods side by side with error bars, on your model and data: figures, results.json (docs/ has ours).

    python experiments.py                  # difficulty, compare, scatter (--dry-run: calibrate, then plan)
    python experiments.py --figures docs   # the same, rewriting docs/results.json and docs/*.png
    python experiments.py --only compare   # parts: difficulty, compare, readings, scatter, precision, lora
    python experiments.py --quick          # tiny model, 2 steps: the whole pipeline in ~1 min (a CI test)
    python experiments.py --model M --dataset D.jsonl --lora-rank 32   # yours: any train.py flag, every run
    python experiments.py --only compare --budget-minutes 60   # seeds, steps, eval size to fit an hour

Runs: SmolLM2-135M on arith-mix unless a train.py flag given says otherwise (each reaches every run); levels:
the data's (a JSONL file's "level", MATH's "Level 1".."Level 5"; a file without them is one level).

1. difficulty: ACR of the untrained model at each level of the training data (and all levels pooled), split
   into all-correct and all-wrong groups.
2. compare:    GRPO, AVSPO, AVSPO always on (avspo-always: no trigger), AAPO and DAPO's dynamic sampling,
   train.py's own schedule (lr decaying to 0), the same prompts per seed, several seeds. train.py evaluates a
   stratified prefix of the held-out split every --eval-every steps (the curves against generated tokens);
   each final checkpoint is then evaluated greedily on the whole split, as train.py evaluates, its records
   cached in final_eval.jsonl beside its run. Each method's accuracy (overall, per level) and its difference
   to GRPO, paired by seed and problem, get a 95% interval by the study's design (`stats`: a seed draws its
   own held-out split, nested; a fixed test file is crossed). Beside each: the collapse the method left (raw
   and effective ACR, the all-correct and all-wrong groups of the last quarter of the steps) and its cost
   (generated tokens: policy, AAPO's reference, DAPO's resampled groups; seconds). A collapse map shows seed
   0's groups step by step; AVSPO's Figure 1 takes the GRPO runs' early ACR and final accuracy level by level
   (`early_acr_by_level`); report.md judges the papers' claims.
3. readings:   AVSPO's readings side by side, each changing one choice of ours or an unverified one (a fixed
   threshold, K = 1, one end only: `METHODS`), with GRPO rerun beside them; as compare, in its own folder.
   bf16 rounds differently per CPU: a seed's arms are compared on one kind (machines.jsonl).
4. scatter:    the AVSPO paper's Figure 1: early raw ACR (train.py's summary: the mean over the first 20% of
   the steps) against final held-out accuracy (train.py's last eval, on that level's test split) over a grid
   of levels x group sizes x seeds of short GRPO runs; the slope's t interval and R^2, pooled and within
   levels.
5. precision:  the default run (`python train.py`) in bf16 and in fp32 on the same seeds: does bf16 learn as
   well? Held-out accuracy, batch reward and seconds per step against steps. Only with --only precision (bf16
   without native support, AVX2 alone, takes many times longer).
6. lora:       does LoRA match full fine-tuning in RL, even at rank 1 ("LoRA Without Regret", Schulman et al.,
   2025)? GRPO with full fine-tuning, LoRA rank 1 and rank 32 (infra/lora.py), as compare (Δ against full
   fine-tuning), each arm at the learning rate of its sweep on --sweep-seed, not one of --seeds (--full-lrs,
   --lora-lrs): the rate whose final model is the most accurate, the smaller on a tie. "Matches" is the
   region +-MARGIN, judged by `stats.RULE`. Only with --only lora.

First the plan (study/plan.py): one step (AVSPO always on: every row trained) and two evaluations, trained at
the comparison runs' settings on this device (the calibration, kept in <out>/calibration), then each run's
minutes from them, the peak memory against the device's, each comparison's expected interval, and with
--budget-minutes the seeds, steps and evaluation size that fit (`plan.fit_budget`); as runs end, the minutes
left by the plan.

Finished runs are reused and unfinished ones resume from their last checkpoint, so a rerun only fills gaps; a
run is reused only when its config.json holds the flags asked for (`check_run`). Before any run, every run's
flags and data pass train.py's checks and every folder it writes can be written (`check_before_any_run`).
Ctrl-C or SIGTERM stops it at once, in one line: the runs under way save their step, no other starts
(`run_all`). Every write goes through infra/written.py's records. --print-commands prints each run's train.py
command for a scheduler instead; the same study then gathers the finished runs.
"""

import argparse
import json
import os
import shlex
import sys
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Iterator

import numpy as np

import train
from data.tasks import NO_LEVEL, data_line
from infra.hardware import pick_device, resolve_precision
from infra.written import Folder, NotWritten, owned
from loop.plots import (plot_accuracy_vs_compute, plot_accuracy_vs_tokens, plot_collapse_map,
                        plot_compare_curves, plot_difficulty, plot_early_acr_scatter, plot_precision_curves)
from loop.processes import on_stop_signals
from loop.run_folder import RunFolderError, read_jsonl
from study.flags import BASELINE, LORA, MARGIN, PRECISIONS, as_flags, parse_args, study_title
from study.parts import planned_runs, precision_runs, scatter_runs, sweep_runs
from study.plan import NoPlanFits, plan_study, scale_of
from study.runs import (Run, acr_by_difficulty, check_flags, check_run, held_out, method_runs, run_dir,
                        run_training, seed_cpus, train_and_score, train_argv)
from study.stats import no_information
from study.tables import (accuracy_curves, accuracy_table, collapse, compute_cost, early_acr_by_level,
                          early_acr_scatter, judged, lora_table, markdown_table, pick_lr, print_results,
                          report, results_so_far, seed_deltas)
from study.workers import Progress, Stopped, Workers, run_all, runs_at_once, stop_handler



def compare(folder: Path, methods: list[str], seeds: list[int], config: train.Args, per_level: int | None,
            workers: Workers, baseline: str = BASELINE,
            extra: dict[str, list[str]] | None = None) -> dict:
    """Train every method on every seed into `folder` at `config` (with its `extra` flags: the lora part's
    learning rates), evaluate each final checkpoint per problem, the intervals (Δ to `baseline`), account
    costs. The intervals follow the study's design, read from the problems each seed answered (`stats`)."""
    runs = method_runs(folder, methods, seeds, as_flags(config), extra)
    for run in runs.values():  # before any run starts
        check_run(*run)
    problems = {s: held_out(config, s, per_level) for s in seeds}  # a seed's, the same for every method
    tasks = [(train_and_score, run, problems[s]) for (_, s), run in runs.items()]
    records = dict(zip(runs, workers.run(tasks)))
    correct = [[[r["correct"] for r in records[m, s]] for s in seeds] for m in methods]  # [M][S][N]
    levels = {s: [r["level"] or NO_LEVEL for r in records[methods[0], s]] for s in seeds}
    assert all(lv == levels[seeds[0]] for lv in levels.values()), "the table needs one level pattern"
    levels = np.array(levels[seeds[0]])
    problems = np.array([[r["question"] for r in records[methods[0], s]] for s in seeds])  # [S, N]
    table = accuracy_table(np.array(correct, dtype=float), levels, problems, methods, baseline)
    same_problems = per_level is None and config.eval_size >= len(levels)  # train.py's last eval: all of them
    for name in methods:
        runs = [run_dir(folder, name, s) for s in seeds]
        table[name]["cost"], table[name]["collapse"] = compute_cost(runs), collapse(runs)
        table[name]["curve"] = accuracy_curves(runs)
        logged = [read_jsonl(d / "evals.jsonl")[-1]["eval_accuracy"] for d in runs]  # train.py's last eval
        table[name]["train_py_final_accuracy"] = logged
        if same_problems and not np.allclose(logged, table[name]["per_seed"]):  # greedy: should be identical
            print(f"warning: {name}: re-evaluated checkpoints {table[name]['per_seed']} "
                  f"!= train.py's {logged}")
    seed_deltas(table, baseline=baseline)
    for seed in seeds:  # bf16 rounds differently per CPU: a seed's methods are compared on one kind
        if len(cpus := seed_cpus(folder, methods, seed)) > 1:
            print(f"warning: {folder} seed {seed}: its runs were trained on {len(cpus)} kinds of CPU "
                  f"({', '.join(sorted(cpus))}), so its methods differ by more than the method")
    return table


def scatter(runs: dict[tuple[str, int, int], Run], levels: list[str], workers: Workers) -> dict:
    """The scatter's runs (`scatter_runs`); each run's early raw ACR (`metrics.early_steps`) and final
    held-out accuracy, from its summary.json, level by level (in the order of `levels`)."""
    for run in runs.values():  # before any run starts
        check_run(*run)
    workers.run([(run_training, run) for run in runs.values()])
    points = []
    for level, g, seed in sorted(runs, key=lambda cell: (levels.index(cell[0]), cell[1], cell[2])):
        out, _, algo, _ = runs[level, g, seed]
        summary = json.loads((out / algo / "summary.json").read_text())
        points.append({"level": level, "group_size": g, "seed": seed, "early_steps": summary["early_steps"],
                       "early_acr": summary["early_acr"], "accuracy": summary["acc_after"]})
    return early_acr_scatter(points)


def precision(runs: dict[tuple[str, int], Run], workers: Workers) -> dict:
    """The same GRPO run in bf16 and in fp32 on each seed (`precision_runs`): held-out accuracy before and
    after, and the costs."""
    if resolve_precision("auto", pick_device()) != "bf16":
        print("warning: this machine has no native bf16 (avx512_bf16, amx_bf16 or CUDA): "
              "the bf16 runs are emulated")
    for run in runs.values():  # before any run starts
        check_run(*run)
    workers.run([(run_training, run) for run in runs.values()])
    result = {}
    for name in PRECISIONS:
        folders = [out / algo for (of, _), (out, _, algo, _) in runs.items() if of == name]  # seed by seed
        evals = [read_jsonl(folder / "evals.jsonl") for folder in folders]
        result[name] = {"runs": [str(folder) for folder in folders],
                        "acc_before": [e[0]["eval_accuracy"] for e in evals],
                        "acc_after": [e[-1]["eval_accuracy"] for e in evals], "cost": compute_cost(folders)}
    return result


FIGURES = {"difficulty": ("acr_vs_difficulty.png",),  # what each part draws, in the figures folder
           "compare": ("compare.png", "compare_accuracy.png", "compare_learning.png", "collapse_map.png",
                       "early_acr_by_level.png"),
           "scatter": ("early_acr_vs_accuracy.png",), "precision": ("precision.png",)}
RESULTS, REPORT = "results.json", "report.md"  # every number (docs/results.json: the README's); in --out


def compare_part(args: argparse.Namespace, folder: Path, methods: list[str], figures: Folder | None) -> dict:
    """compare (and readings, in its own folder): the training runs and the table; with `figures`, the
    curves, accuracy against cost and tokens, and the collapse map of the first seed."""
    seeds = [int(s) for s in args.seeds.split(",")]
    table = compare(folder, methods, seeds, args.train, args.per_level or None, args.workers)
    if figures:
        runs_by_method = {m: [run_dir(folder, m, s) for s in seeds] for m in methods}
        title = study_title(args.train)
        plot_compare_curves(runs_by_method, figures, "compare.png", f"{title}, seeds {seeds}")
        plot_accuracy_vs_compute(table, figures, "compare_accuracy.png", f"{title}, seeds {seeds}")
        plot_accuracy_vs_tokens(table, figures, "compare_learning.png", f"{title}, seeds {seeds}: "
                                f"{args.train.eval_size} held-out problems, mean and range of the seeds")
        plot_collapse_map({m: runs[0] for m, runs in runs_by_method.items()}, figures, "collapse_map.png",
                          f"{title}, seed {seeds[0]}")
    return table


def lora_part(args: argparse.Namespace, folder: Path) -> dict:
    """The lora part: each arm's learning rate from its sweep on --sweep-seed (`pick_lr`), then the arms on
    --seeds at those rates, compared as compare does, with full fine-tuning as the baseline."""
    per_level, seed = args.per_level or None, args.sweep_seed
    sweep = sweep_runs(args, folder)
    for run in sweep.values():  # before any run starts
        check_run(*run)
    tasks = [(train_and_score, run, held_out(args.train, seed, per_level)) for run in sweep.values()]
    accuracy = {arm: {} for arm in LORA}
    for (arm, lr), records in zip(sweep, args.workers.run(tasks)):
        accuracy[arm][lr] = float(np.mean([r["correct"] for r in records]))
    chosen = {arm: pick_lr(accuracy[arm]) for arm in LORA}
    table = compare(folder, list(LORA), [int(s) for s in args.seeds.split(",")], args.train, per_level,
                    args.workers, baseline=LORA[0],
                    extra={arm: ["--lr", lr] for arm, lr in chosen.items()})
    for arm, row in table.items():
        seconds = row["cost"]["seconds"]
        row["lr"], row["seconds_per_step"] = chosen[arm], {"mean": seconds["mean"] / args.train.steps,
                                                          "ci": [x / args.train.steps for x in seconds["ci"]]}
        per_seed = (np.array(table[name]["per_seed"]) for name in (arm, LORA[0]))
        row["verdict"] = None if arm == LORA[0] else judged(row["delta"]["ci"], (-MARGIN, MARGIN),
                                                             no_information(*per_seed))
    return {"sweep": {"seed": seed, "accuracy": accuracy, "chosen": chosen,
                      "rule": "per arm, the learning rate whose final model is the most accurate (greedy, on "
                              "the sweep seed's whole held-out split); the smaller on a tie"},
            "margin": MARGIN, "arms": table}


def scatter_part(args: argparse.Namespace, folder: Path, figures: Folder) -> dict:
    """The early-ACR scatter's GRPO runs, the fit and its figure."""
    result = scatter(scatter_runs(args, folder), args.scatter_levels.split(","), args.workers)
    plot_early_acr_scatter(result, figures, "early_acr_vs_accuracy.png")
    return result


def precision_part(args: argparse.Namespace, folder: Path, figures: Folder) -> dict:
    """The default run in bf16 and fp32, and its figure."""
    result = precision(precision_runs(args, folder), args.workers)
    runs = {name: [Path(run) for run in result[name]["runs"]] for name in PRECISIONS}
    plot_precision_curves(runs, figures, "precision.png", f"{args.train.model}, the default run, seeds "
                          f"{args.precision_seeds}")
    return result


def print_commands(args: argparse.Namespace, parts: list[str]) -> dict:
    """Each run's train.py command line, paths absolute, once every run's flags pass train.py's checks; the
    study's folders made, so that the runs land where the study looks for them. lora's runs follow its
    sweep's choice: it runs here alone."""
    runs = planned_runs(args, [p for p in parts if p != "lora"])
    for run in runs:
        check_flags(*run)
    with owned(Path(args.out), "experiments") as out:
        for part in [p for p in parts if p in ("compare", "readings", "scatter", "precision")]:
            out.subfolder(part, "experiments")
    for run_out, seed, algo, flags in runs:
        print(shlex.join([sys.executable, str(Path(train.__file__).resolve()),
                          *train_argv(run_out.resolve(), seed, algo, flags)]))
    return {}


def check_before_any_run(args: argparse.Namespace, parts: list[str]) -> None:
    """A RunFolderError in one line, before any run starts and before anything is written, where a run would
    fail part-way through the study: train.py refuses its flags (`check_flags`), or a folder experiments.py
    writes cannot be written (read-only, or another user's; one still to be made: the folder it would be
    made in)."""
    runs = planned_runs(args, parts)
    for run in runs:
        check_flags(*run)
    figures = Path(args.figures) if args.figures else Path(args.out) / "figures"
    written = [Path(args.out), figures, *(p for out, _, algo, _ in runs for p in (out, out / algo))]
    for folder in dict.fromkeys(written):
        where = next(p for p in [folder, *folder.parents] if p.exists())
        if not os.access(where, os.W_OK | os.X_OK):  # as root: only a read-only mount (EROFS) refuses
            raise RunFolderError(f"{where}: experiments.py cannot write there (read-only, or another "
                                 "user's), and would fail part-way: make it writable, or choose another "
                                 "--out or --figures; no run started")


def main(argv: list[str] | None = None) -> dict:
    """Ctrl-C or SIGTERM stops it at once, in one line: no run starts after it, the runs under way save their
    step (`run_all`), and the same command goes on from there. A filesystem failure at a write (a full disk)
    is one line too, as in train.py."""
    args = parse_args(argv)
    parts = args.only.split(",")
    try:  # train.py's checks of the runs' data and flags before the plan reads the data (each run's: below)
        check_flags(*(planned_runs(args, parts) or [(Path(args.out), 0, "grpo", as_flags(args.train))])[0])
        if args.print_commands:  # a scheduler will run them all
            return print_commands(args, parts)
    except RunFolderError as e:
        sys.exit(f"error: {e}")
    try:
        with on_stop_signals(stop_handler()):
            if not args.dry_run:  # before the calibration too, a run; and again where the budget changed them
                check_before_any_run(args, parts)
                with study_folders(args) as (out, figures):
                    prior_results(parts, out, figures)
            fitted, left = plan_study(args, parts)
            if args.dry_run:
                return {}
            if scale_of(fitted) != scale_of(args):
                check_before_any_run(fitted, parts)
            args = fitted
            args.workers = Workers(args.jobs, Progress(left, runs_at_once(args.jobs, args.train.device)[0]))
            with study_folders(args) as (out, figures):
                return run_parts(args, parts, out, figures)
    except (NotWritten, RunFolderError, NoPlanFits, OSError) as e:
        sys.exit(f"error: {e}")
    except Stopped as stop:
        print(f"experiments.py: stopped by {stop}: no run started after it, and each run under way kept its "
              "last saved step; the same command goes on from there", file=sys.stderr)
        sys.exit(128 + stop.signum)


@contextmanager
def study_folders(args: argparse.Namespace) -> Iterator[tuple[Folder, Folder]]:
    """The study's folder, --out, and the figures' (--figures, else <out>/figures), owned while inside."""
    with owned(Path(args.out), "experiments") as out, ExitStack() as stack:
        apart = args.figures and Path(args.figures).resolve() != out.path.resolve()
        yield out, (stack.enter_context(owned(Path(args.figures), "experiments")) if apart
                    else out if args.figures else out.subfolder("figures", "experiments"))


def prior_results(parts: list[str], out: Folder, figures: Folder) -> dict:
    """results.json's numbers so far, once what the study would write is known as its own (NotWritten, one
    line, where it is not: a user's file, one changed since, a damaged results.json)."""
    for folder in (out, figures):
        folder.remove_temporaries()  # what a write killed part-way left
    for name in [RESULTS, *(f for part in parts for f in FIGURES.get(part, ()))]:
        figures.now(name)  # NotWritten: not ours
    out.now(REPORT)
    return results_so_far(figures, RESULTS)


def run_parts(args: argparse.Namespace, parts: list[str], out: Folder, figures: Folder) -> dict:
    """The parts asked for, each in its own folder of `out`; their numbers merged into the figures' folder's
    results.json (checked before the calibration too: `main`)."""
    results = prior_results(parts, out, figures)
    study = {k: v for k, v in vars(args).items() if k not in ("out", "figures", "only", "train", "workers")}
    results["scale"] = {**study, "train": as_flags(args.train)}  # and the comparison runs' train.py flags
    if "difficulty" in parts:
        # in a worker, as the runs are (`run_all`): the parent keeps no model, nor CUDA's cache of one, on
        # the GPU a worker trains on
        results["difficulty"], = run_all([(acr_by_difficulty, args.train, args.difficulty_prompts, 8)],
                                         args.jobs)
        plot_difficulty(results["difficulty"], figures, "acr_vs_difficulty.png",
                        f"{args.train.model} on {args.train.dataset}, G=8, T={args.train.temperature:g}")
    for part, methods, drawn in (("compare", args.methods, figures), ("readings", args.readings, None)):
        if part in parts:  # readings: GRPO rerun beside AVSPO's readings, on this machine (the docstring)
            folder = out.subfolder(part, "experiments").path
            results[part] = compare_part(args, folder, methods.split(","), drawn)
            results[f"{part}_table"] = markdown_table(results[part])
            if part == "compare" and BASELINE in methods.split(","):  # AVSPO's Figure 1, level by level
                runs = {s: run_dir(folder, BASELINE, s) for s in map(int, args.seeds.split(","))}
                fit = early_acr_by_level(runs, args.train, args.per_level or None)
                plot_early_acr_scatter(fit, figures, "early_acr_by_level.png", "(GRPO seed, level) points")
                results["early_acr_by_level"] = fit
                data = data_line(args.train.dataset, args.train.eval_dataset)
                out.write(REPORT, report(results, f"{study_title(args.train)}, seeds {args.seeds}", data))
    if "scatter" in parts:
        results["scatter"] = scatter_part(args, out.subfolder("scatter", "experiments").path, figures)
    if "precision" in parts:
        results["precision"] = precision_part(args, out.subfolder("precision", "experiments").path, figures)
    if "lora" in parts:
        results["lora"] = lora_part(args, out.subfolder("lora", "experiments").path)
        results["lora_table"] = lora_table(results["lora"])
    figures.write(RESULTS, json.dumps(results, indent=2))
    print_results(results, parts)
    print(f"results: {figures.path / RESULTS}\nfigures: {figures.path}")
    return results


if __name__ == "__main__":
    main()

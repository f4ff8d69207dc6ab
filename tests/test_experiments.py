"""experiments.py: the tables' intervals and the scatter fit on synthetic data (no model), then the --quick
pipeline on the tiny model: every part runs and writes its numbers and figures."""

import errno
import hashlib
import json
import math
import multiprocessing
import operator
import os
import random
import resource
import shlex
import shutil
import signal
import subprocess
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import numpy as np
import pytest
import torch

import experiments
import train
from loop import run_folder
from study import plan, stats, tables, workers
from study import flags as study_flags
from study import runs as study_runs
from cuda_stand_in import CudaDeviceRules
from data import tasks
from infra.flags import dataclass_parser
from infra import records
from infra.lora import has_adapters
from loop.processes import on_stop_signals
from model import sample_with_generate
from test_faults import small_processes
from test_plan import STAND_IN
from infra.written import RECORD, Folder, owned

LEVELS = np.array(["easy"] * 20 + ["hard"] * 30)


def own_problems(seeds: int) -> np.ndarray:
    """problems [S, N]: each seed its own held-out problems (nested), as arith-mix draws them."""
    return np.arange(seeds * len(LEVELS)).reshape(seeds, len(LEVELS))


def write_jsonl(path: Path, records: list[dict]) -> None:
    """A log as train.py leaves it, for the functions that only read logs."""
    path.write_text("".join(json.dumps(r) + "\n" for r in records))


def synthetic_correct(rng: np.random.Generator, methods: int, seeds: int, p_easy: float = 0.8,
                      p_hard: float = 0.3) -> np.ndarray:
    """correct [M, S, N]: independent 0/1 answers, easy problems right with p_easy, hard ones with p_hard."""
    p = np.where(LEVELS == "easy", p_easy, p_hard)
    return (rng.random((methods, seeds, len(LEVELS))) < p).astype(float)


def test_paired_difference_of_identical_methods_is_exactly_zero():
    one = synthetic_correct(np.random.default_rng(0), 1, 5)
    table = tables.accuracy_table(np.concatenate([one, one]), LEVELS, own_problems(5), ["grpo", "same"])
    delta = table["same"]["delta"]
    assert delta["mean"] == 0 and delta["ci"] == [0.0, 0.0] and delta["half_width"] == 0
    assert all(d["ci"] == [0.0, 0.0] for d in table["same"]["delta_by_level"].values())
    assert table["same"]["accuracy"] == table["grpo"]["accuracy"]
    assert table["grpo"]["accuracy"]["half_width"] > 0  # the accuracy itself is uncertain


def test_paired_difference_recovers_a_known_shift():
    """The second method answers 5 more hard problems per seed right: +0.1 overall, +1/6 on hard, 0 on
    easy."""
    base = synthetic_correct(np.random.default_rng(1), 1, 5)[0]  # [S, N]
    better = base.copy()
    for s in range(5):
        wrong_hard = np.flatnonzero((base[s] == 0) & (LEVELS == "hard"))
        better[s, wrong_hard[:5]] = 1
    table = tables.accuracy_table(np.stack([base, better]), LEVELS, own_problems(5), ["grpo", "better"])
    delta = table["better"]["delta"]
    assert math.isclose(delta["mean"], 5 / 50)
    assert 0 < delta["ci"][0] <= 0.1 <= delta["ci"][1]  # paired: the CI excludes 0 though accuracies overlap
    assert math.isclose(table["better"]["delta_by_level"]["hard"]["mean"], 5 / 30)
    assert table["better"]["delta_by_level"]["easy"]["ci"] == [0.0, 0.0]


def test_avspo_is_also_compared_with_its_ablations_paired():
    """AVSPO against avspo-always and avspo-fixed, and its all-wrong end against its all-correct end, by
    the same paired interval: the shifted method is the first of each pair."""
    base = synthetic_correct(np.random.default_rng(1), 1, 5)[0]  # [S, N]
    better = base.copy()
    for s in range(5):
        better[s, np.flatnonzero(base[s] == 0)[:5]] = 1
    table = tables.accuracy_table(np.stack([base, base, better, base]), LEVELS, own_problems(5),
                                  ["grpo", "avspo-always", "avspo", "avspo-fixed"])
    against = table["avspo"]["delta_vs_ablation"]
    assert list(against) == ["avspo-always", "avspo-fixed"]
    for delta in against.values():
        assert math.isclose(delta["mean"], 5 / 50) and 0 < delta["ci"][0] <= 0.1 <= delta["ci"][1]
    assert all("delta_vs_ablation" not in table[name] for name in ("grpo", "avspo-always", "avspo-fixed"))
    ends = tables.accuracy_table(np.stack([base, base, better]), LEVELS, own_problems(5),
                                 ["grpo", "avspo-correct", "avspo-wrong"])
    assert math.isclose(ends["avspo-wrong"]["delta_vs_ablation"]["avspo-correct"]["mean"], 5 / 50)


def test_seed_deltas_pair_collapse_and_cost_by_seed():
    """A method whose every per-seed number is GRPO's + 0.1 differs by exactly 0.1, with an interval of one
    point; each number's own interval is the t interval over its seeds (`stats.seed_interval`)."""
    grpo = [0.5, 0.2, 0.9, 0.4, 0.6]
    stat = lambda values: {"mean": float(np.mean(values)), "per_seed": values}  # noqa: E731
    table = {name: {"collapse": {"acr": stat([v + shift for v in grpo])},
                    "cost": {"seconds": stat([1.0] * 5)}} for name, shift in (("grpo", 0.0), ("later", 0.1))}
    tables.seed_deltas(table)
    delta = table["later"]["collapse"]["acr"]["delta"]
    assert math.isclose(delta["mean"], 0.1) and np.allclose(delta["ci"], [0.1, 0.1])
    assert table["grpo"]["collapse"]["acr"]["ci"] == stats.seed_interval(np.array(grpo))["ci"]
    assert table["grpo"]["collapse"]["acr"]["delta"]["ci"] == [0.0, 0.0]


def test_early_acr_fit_recovers_a_line_pooled_and_within_levels():
    """Four levels, each its own accuracy, and within each the same slope -0.5: both fits find it; the levels
    alone explain part of the accuracy."""
    rng = np.random.default_rng(4)
    x = rng.random(32)
    level = np.repeat(np.arange(4), 8)
    runs = [{"early_acr": float(xi), "level": f"l{lv}", "accuracy": float(0.9 - 0.5 * xi + 0.05 * lv
                                                                        + rng.normal(0, 0.05))}
            for xi, lv in zip(x, level)]
    fit = tables.early_acr_scatter(runs)
    for line in (fit, fit["within"]):
        assert line["slope_ci"][0] < -0.5 < line["slope_ci"][1] and line["slope_ci"][1] < 0
    assert 0.5 < fit["r2"] < 1 and 0 < fit["r2_groups"] < 1 and fit["distinct_early_acr"] == 32
    assert "within levels: slope -0." in tables.fit_line(fit)
    runs[1]["early_acr"] = runs[0]["early_acr"]  # two runs at one early ACR: one x value fewer
    assert tables.early_acr_scatter(runs)["distinct_early_acr"] == 31


def test_quick_pipeline_writes_every_number_and_figure(tmp_path, capsys):
    results = experiments.main(["--quick", "--out", str(tmp_path)])
    printed = capsys.readouterr().out  # the plan first, from a calibration step trained here
    assert "\nplan: 26 training runs, 52 steps, " in printed and "\n  calibrated here: a step of 8 " in printed
    assert "\nstudy: 10 of 26 runs done in " in printed  # compare's ten; the plan's minutes left follow
    assert len(list((tmp_path / "calibration").glob("*/avspo/summary.json"))) == 1  # AVSPO always on
    assert set(results) >= {"scale", "difficulty", "compare", "compare_table", "readings", "readings_table",
                            "scatter"}
    assert set(results["difficulty"]) == {*tasks.LEVELS, "mix"}
    table = results["compare"]
    assert list(table) == list(study_flags.COMPARE)
    assert list(results["readings"]) == list(study_flags.READINGS)
    for name, row in table.items():
        assert len(row["per_seed"]) == 2  # two seeds
        assert set(row["by_level"]) == set(tasks.LEVELS)
        for stat in [row["accuracy"], row["delta"], *row["by_level"].values(),
                     *row["delta_by_level"].values()]:
            assert all(math.isfinite(v) for v in [stat["mean"], *stat["ci"], stat["half_width"]])
            assert stat["ci"][0] <= stat["mean"] <= stat["ci"][1]
        assert row["cost"]["gen_tokens"]["mean"] > 0 and row["cost"]["seconds"]["mean"] > 0
        assert (study_runs.run_dir(tmp_path / "compare", name, 0) / "summary.json").exists()
        run = study_runs.run_dir(tmp_path / "compare", name, 0)
        machines = run_folder.read_jsonl(run.parent / "machines.jsonl")  # one start: one line, naming the CPU
        assert [m["algos"] for m in machines] == [[run.name]] and "cpu_features" in machines[0]
        acr = row["collapse"]
        assert set(acr) - {"avspo_triggered"} == {"acr", "acr_effective", "acr_effective_first_quarter",
                                                  "acr_effective_last_quarter", "late_rise",
                                                  "all_correct_frac", "all_wrong_frac", "clipped"}
        assert acr["late_rise"]["per_seed"] == [last - first for first, last in zip(
            acr["acr_effective_first_quarter"]["per_seed"], acr["acr_effective_last_quarter"]["per_seed"])]
        for stat in [*acr.values(), *row["cost"].values()]:  # a CI over seeds
            assert stat["ci"][0] <= stat["mean"] <= stat["ci"][1]
        paired = [v for k, v in acr.items() if k != "avspo_triggered"] + list(row["cost"].values())
        for stat in paired:  # paired by seed with GRPO's (which has no trigger)
            assert stat["delta"]["ci"][0] <= stat["delta"]["mean"] <= stat["delta"]["ci"][1]
            assert name != "grpo" or stat["delta"]["ci"] == [0.0, 0.0]
        assert ("avspo_triggered" in row["collapse"]) == name.startswith("avspo")
        curve = row["curve"]  # train.py's evals at steps 0, 1, 2 (--eval-every 1), tokens spent by then
        assert curve["steps"] == [0, 1, 2] and curve["gen_tokens"][0] == 0 < curve["gen_tokens"][1]
        assert all(lo <= mid <= hi for lo, mid, hi in zip(curve["accuracy_low"], curve["accuracy"],
                                                           curve["accuracy_high"]))
    # the costs differ where they should: AAPO also samples the reference, DAPO resamples collapsed groups
    assert table["aapo"]["cost"]["gen_tokens"]["mean"] > table["grpo"]["cost"]["gen_tokens"]["mean"]
    assert all(f"| {name} |" in results["compare_table"] for name in table)
    scatter = results["scatter"]
    assert len(scatter["runs"]) == 4  # 2 levels x G in {2, 4} x 1 seed
    assert {"slope", "slope_ci", "r2", "within", "r2_groups"} <= set(scatter)  # NaN here: a flat accuracy
    for name in ("acr_vs_difficulty", "compare", "compare_accuracy", "compare_learning", "collapse_map",
                 "early_acr_vs_accuracy"):
        assert (tmp_path / "figures" / f"{name}.png").stat().st_size > 5_000
    # a rerun skips every finished run and reads the cached per-problem evaluations: the same numbers
    again = experiments.main(["--quick", "--out", str(tmp_path), "--only", "compare"])
    assert again["compare"] == results["compare"]


def test_accuracy_curves_average_seeds_by_step_and_name_a_run_with_a_missing_evaluation(tmp_path):
    runs = [tmp_path / "seed0", tmp_path / "seed1"]
    for run, (accuracy, tokens) in zip(runs, [((0.2, 0.4, 0.6), 10), ((0.4, 0.6, 1.0), 30)]):
        run.mkdir()
        write_jsonl(run / "evals.jsonl", [{"step": s, "eval_accuracy": a}
                                          for s, a in zip((0, 2, 4), accuracy)])
        write_jsonl(run / "metrics.jsonl", [{"step": s, "gen_tokens_total": tokens * s}
                                            for s in (1, 2, 3, 4)])
    curve = tables.accuracy_curves(runs)
    assert curve["steps"] == [0, 2, 4] and curve["gen_tokens"] == [0, 40, 80]
    assert curve["accuracy"] == pytest.approx([0.3, 0.5, 0.8])
    assert curve["accuracy_low"] == [0.2, 0.4, 0.6] and curve["accuracy_high"] == [0.4, 0.6, 1.0]
    write_jsonl(runs[1] / "evals.jsonl", [{"step": s, "eval_accuracy": 0.5} for s in (0, 4)])
    with pytest.raises(SystemExit, match=r"seed1/evals.jsonl: evaluated at steps \[0, 4\], not \[0, 2, 4\]"):
        tables.accuracy_curves(runs)


def test_collapse_counts_the_steps_whose_gradient_norm_was_clipped(tmp_path):
    """A step is clipped when its gradient norm exceeds the run's --max-grad-norm (equal is not clipped);
    a step that trained no row logs a norm of 0."""
    runs = [tmp_path / "seed0", tmp_path / "seed1"]
    for run, (max_norm, norms) in zip(runs, [(1.0, [0.5, 1.0, 1.5, 3.0]), (2.0, [0.0, 1.5, 2.5, 0.1])]):
        run.mkdir()
        (run / "config.json").write_text(json.dumps({"max_grad_norm": max_norm}))
        write_jsonl(run / "metrics.jsonl", [
            {"step": s, "grad_norm": n, "acr": 0.5, "acr_effective": 0.5, "all_correct_frac": 0.25,
             "all_wrong_frac": 0.25} for s, n in enumerate(norms, 1)])
    clipped = tables.collapse(runs)["clipped"]
    assert clipped["per_seed"] == [0.5, 0.25] and clipped["mean"] == 0.375


def test_seed_cpus_reads_each_runs_machines(tmp_path):
    """A run resumed on another CPU adds a line: the seed then names both, and a run made before
    machines.jsonl names none."""
    for method, cpus in (("grpo", ["Xeon"]), ("avspo", ["Xeon", "EPYC"]), ("aapo", [])):
        folder = study_runs.run_dir(tmp_path, method, 0).parent
        folder.mkdir(parents=True)
        write_jsonl(folder / "machines.jsonl", [{"cpu": cpu} for cpu in cpus])
    assert study_runs.seed_cpus(tmp_path, ["grpo", "aapo"], 0) == {"Xeon"}
    assert study_runs.seed_cpus(tmp_path, ["grpo", "avspo"], 0) == {"Xeon", "EPYC"}


def test_run_all_in_parallel_processes_keeps_the_task_order(monkeypatch):
    """In spawned processes (W3: a forked child inherits torch's thread pool, and CUDA's context, in a bad
    state), each with its share of the cores."""
    methods = []

    class Pool(ProcessPoolExecutor):  # the pool `run_all` makes, and how it starts its workers
        def __init__(self, *args, mp_context=None, **kwargs):
            methods.append((mp_context or multiprocessing.get_context()).get_start_method())
            super().__init__(*args, mp_context=mp_context, **kwargs)

    monkeypatch.setattr(workers, "ProcessPoolExecutor", Pool)
    tasks = [(operator.add, 1, 2), (operator.mul, 3, 4), (torch.get_num_threads,)]
    in_pool = workers.run_all(tasks, jobs=2)  # one pool: a spawn costs seconds of imports
    assert workers.run_all(tasks, jobs=1)[:2] == in_pool[:2] == [3, 12]
    assert in_pool[2] == max(1, (os.cpu_count() or 1) // 2)  # the cores are split
    assert methods == ["spawn"]


def test_a_workers_first_cuda_call_sees_its_own_device(monkeypatch):
    """The second worker of --jobs 2 on a machine of 2 GPUs (the stand-in, in a process where CUDA has not
    started): CUDA reads CUDA_VISIBLE_DEVICES once, at its first call, so `start_worker` sets it before any
    (W1: a worker that asked CUDA first would see both GPUs, and run on the first worker's)."""
    monkeypatch.setattr(workers, "STOPPING", None)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")  # restored after the test, then
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES")
    started, handler = multiprocessing.get_context("spawn").Value("i", 1), signal.getsignal(signal.SIGTERM)
    try:
        with CudaDeviceRules(count=2) as rules:
            workers.start_worker(None, started, devices=2)
            assert torch.cuda.device_count() == 1
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert rules.seen_visible == "1"


@pytest.mark.parametrize("visible, seen", [(None, ["0", "1", "2", "0"]), ("5,7", ["5", "7", "5", "7"])])
def test_each_worker_sees_a_cuda_device_of_its_own(monkeypatch, visible, seen):
    """--jobs on a machine with 3 CUDA devices: the workers, as they start, see device 0, 1, 2, then 0 again;
    where CUDA_VISIBLE_DEVICES already names some, one of those each in turn."""
    if visible is None:
        monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    else:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    monkeypatch.setattr(workers, "STOPPING", None)
    started, handler = multiprocessing.get_context("spawn").Value("i", 0), signal.getsignal(signal.SIGTERM)
    try:
        assigned = []
        for _ in range(4):
            workers.start_worker(None, started, devices=3)
            assigned.append(os.environ["CUDA_VISIBLE_DEVICES"])
            if visible is not None:
                os.environ["CUDA_VISIBLE_DEVICES"] = visible  # each worker starts from the parent's
            else:
                del os.environ["CUDA_VISIBLE_DEVICES"]
    finally:
        signal.signal(signal.SIGTERM, handler)
    assert assigned == seen


def test_run_all_stops_queued_runs_when_one_fails(tmp_path):
    """A failed run is reported once the runs under way end, and the runs still queued do not start, not even
    those the pool has handed to a worker ahead of time (it hands 3 to its 2 workers): a touch could start
    only once a 3 s sleep ends, long after the failure."""
    tasks = [(operator.truediv, 1, 0), (time.sleep, 3), (time.sleep, 3)]
    tasks += [(Path.touch, tmp_path / str(i)) for i in range(4)]
    with pytest.raises(ZeroDivisionError):
        workers.run_all(tasks, jobs=2)
    assert not list(tmp_path.iterdir())


def test_quick_precision_part_trains_each_seed_in_both_precisions(tmp_path):
    results = experiments.main(["--quick", "--out", str(tmp_path), "--only", "precision"])
    assert list(results["precision"]) == ["bf16", "fp32"]
    for name, row in results["precision"].items():
        assert len(row["acc_before"]) == len(row["acc_after"]) == 2  # two seeds
        for run, seed in zip(row["runs"], (0, 1)):
            config = json.loads((Path(run) / "config.json").read_text())
            assert (config["precision"], config["seed"], config["algo"]) == (name, seed, "grpo")
            assert len(run_folder.read_jsonl(Path(run) / "metrics.jsonl")) == 2  # --precision-steps 2
        assert row["cost"]["seconds"]["mean"] > 0
    assert (tmp_path / "figures" / "precision.png").stat().st_size > 5_000


def test_git_keeps_the_experiments_logs_but_not_weights_or_scratch_runs():
    """The logs of runs/experiments are committed, so a sweep resumes in another checkout and results.json
    can be recomputed; checkpoints and every other run folder (the default run, --quick's) stay out."""
    root = Path(experiments.__file__).resolve().parent
    if not (root / ".git").exists():
        pytest.skip("not a git checkout")
    run = "runs/experiments/compare/seed0-grpo/grpo"
    paths = [f"{run}/metrics.jsonl", f"{run}/summary.json", f"{run}/.written.json",
             "runs/experiments/compare/seed0-grpo/final_eval.jsonl",
             f"{run}/checkpoint/model/model.safetensors", f"{run}/checkpoint.old/optimizer.pt",
             "runs/default/grpo/metrics.jsonl", "runs/quick/compare/seed0-grpo/grpo/metrics.jsonl"]
    ignored = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=root, capture_output=True,
                             text=True).stdout.split()
    assert ignored == paths[4:]


# ------------------------------------------------------------------ issue 54: what experiments.py may touch
# The smallest runs experiments.py makes: one GRPO run of 2 steps on the tiny model, without --quick (whose
# defaults the flags below would otherwise have to beat).
TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--jobs", "1"]
SCATTER = [*TINY, "--only", "scatter", "--scatter-levels", "add1", "--scatter-g", "2", "--scatter-seeds",
           "0", "--scatter-steps", "2", "--scatter-prompts", "2", "--scatter-eval-size", "4"]
COMPARE = [*TINY, "--only", "compare", "--methods", "grpo", "--seeds", "0", "--steps", "2",
           "--prompts-per-step", "2", "--group-size", "4", "--eval-size", "4", "--eval-every", "1",
           "--per-level", "2"]


def tree(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` and its bytes."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def one_line(exit_info, capsys) -> str:
    """The message experiments.py stopped with: one line, no traceback."""
    message = str(exit_info.value.code)
    assert message.startswith("error: ") and "\n" not in message
    assert "Traceback" not in capsys.readouterr().err
    return message


def timeless(value):
    """`value` without its wall-clock numbers (seconds), which no two runs share; NaN (no interval from one
    seed), which equals nothing, as a word."""
    if isinstance(value, dict):
        return {k: timeless(v) for k, v in value.items() if k not in ("seconds", "compare_table", "scale")}
    if isinstance(value, float) and math.isnan(value):
        return "NaN"
    return [timeless(v) for v in value] if isinstance(value, list) else value


@pytest.fixture(scope="module")
def scatter_run(tmp_path_factory):
    """A finished scatter of one run, with the checkout's docs/ as it was before and after it."""
    out = tmp_path_factory.mktemp("scatter") / "out"
    docs = Path(experiments.__file__).resolve().parent / "docs"
    before = tree(docs)
    results = experiments.main([*SCATTER, "--out", str(out)])
    return out, results, before, tree(docs)


@pytest.fixture(scope="module")
def compare_run(tmp_path_factory):
    """A finished comparison of one run, uninterrupted: the reference a resumed one must equal."""
    out = tmp_path_factory.mktemp("compare") / "out"
    return out, experiments.main([*COMPARE, "--out", str(out)])


def test_out_holds_the_results_and_figures_and_the_checkout_is_left_alone(scatter_run):
    out, results, docs_before, docs_after = scatter_run
    assert docs_after == docs_before  # not docs/results.json, not docs/*.png
    written = json.loads((out / "figures" / "results.json").read_text())
    assert written["scatter"]["runs"] == results["scatter"]["runs"] and len(written["scatter"]["runs"]) == 1
    assert (out / "figures" / "early_acr_vs_accuracy.png").stat().st_size > 5_000


def test_a_finished_run_is_reused_only_with_the_flags_it_was_trained_with(scatter_run, tmp_path, capsys):
    """More --scatter-steps, or a run of another level at a scatter point: one line naming the run and the
    flag, before any run starts, and the runs stay as they were."""
    out = tmp_path / "out"
    shutil.copytree(scatter_run[0], out)
    before = tree(out)
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(out), "--scatter-steps", "4"])
    assert "add1-g2-seed0/grpo was trained with --steps 2 (asked: 4)" in one_line(exit_info, capsys)
    (out / "scatter" / "add1-g2-seed0").rename(out / "scatter" / "mul1-g2-seed0")
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(out), "--scatter-levels", "mul1"])
    assert "--dataset arith-add1 (asked: arith-mul1)" in one_line(exit_info, capsys)
    assert tree(out) == {name.replace("add1-g2", "mul1-g2"): data for name, data in before.items()}


@pytest.mark.parametrize("flags", [["--seeds", "0,0"], ["--methods", "grpo,avspo,grpo"],
                                   ["--scatter-g", "2,2"], ["--only", "compare,compare"]], ids=" ".join)
def test_an_item_given_twice_is_refused_at_parse_time(flags, capsys):
    """--seeds 0,0 would count one run twice in the bootstrap."""
    with pytest.raises(SystemExit):
        experiments.parse_args(["--dry-run", *flags])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flags[0]} {flags[1]}: " in err and "given twice" in err


def test_a_damaged_summary_is_named_in_one_line_and_left_as_it_is(scatter_run, compare_run, tmp_path, capsys):
    """A 0-byte summary.json (train.py writes it whole: someone else's damage): one line naming it, before
    any run, whether the part reads it (scatter) or not (compare), and it stays as it is."""
    for run, argv in ((compare_run, COMPARE), (scatter_run, SCATTER)):
        out = tmp_path / argv[argv.index("--only") + 1]
        shutil.copytree(run[0], out)
        summary = next(out.rglob("summary.json"))
        summary.write_text("")
        before = tree(out)
        with pytest.raises(SystemExit) as exit_info:
            experiments.main([*argv, "--out", str(out)])
        assert f"{summary} is damaged" in one_line(exit_info, capsys)
        assert tree(out) == before


def blocked_read(signum, frame):
    pytest.fail("a read blocked: a FIFO opened without O_NONBLOCK waits for a writer")  # no OSError: uncaught


@pytest.mark.parametrize("what", ["a FIFO", "a FIFO holding JSON", "a link to /dev/zero", "/dev/zero itself"])
def test_a_summary_that_is_no_plain_file_is_never_read_and_named_in_one_line(tmp_path, what):
    """Before, study_runs.finished read summary.json with Path.read_text before the record vouched for it: a
    FIFO hung the study, /dev/zero ended in a MemoryError. It is read only as a plain file, and bounded."""
    run = tmp_path / "out" / "grpo"
    run.mkdir(parents=True)
    summary, writer = run / "summary.json", None
    if what.startswith("a FIFO"):
        os.mkfifo(summary)
    if what == "a FIFO holding JSON":  # a writer's bytes wait in the pipe: a summary's JSON, in no file
        writer = os.open(summary, os.O_RDWR | os.O_NONBLOCK)
        os.write(writer, json.dumps({"acc_after": 0.99}).encode())
    elif what == "a link to /dev/zero":
        summary.symlink_to("/dev/zero")
    elif what == "/dev/zero itself":  # a device node at the name itself, as root may make one
        os.mknod(summary, 0o600 | __import__("stat").S_IFCHR, os.stat("/dev/zero").st_rdev)
    previous = signal.signal(signal.SIGALRM, blocked_read)
    signal.alarm(30)  # a blocking open fails this test rather than hanging the suite
    try:
        assert records.plain_bytes(summary, 1 << 20) is None
        with pytest.raises(run_folder.RunFolderError, match=f"^{summary} is damaged"):
            study_runs.check_run(tmp_path / "out", 0, "grpo", [])
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)
        if writer is not None:
            os.close(writer)


@pytest.mark.parametrize("edit", ["an accuracy of 0.99", "an empty object", "a metrics line"])
def test_a_run_file_changed_since_train_py_wrote_it_is_named_in_one_line_and_nothing_of_it_used(
        scatter_run, compare_run, tmp_path, capsys, edit):
    """A summary.json edited to an accuracy of 0.99, or replaced by {}, or a metrics.jsonl line changed: before,
    the first flowed into results.json with exit 0, the second ended in a KeyError traceback. The study reads
    a run's files only as train.py wrote them (its record): one line naming the file, before any run, and
    nothing written."""
    for run, argv in ((compare_run, COMPARE), (scatter_run, SCATTER)):
        out = tmp_path / argv[argv.index("--only") + 1]
        shutil.copytree(run[0], out)
        summary = next(out.rglob("summary.json"))
        changed = summary.parent / "metrics.jsonl" if edit == "a metrics line" else summary
        if edit == "an accuracy of 0.99":
            changed.write_text(json.dumps({**json.loads(summary.read_text()), "acc_after": 0.99}))
        elif edit == "an empty object":
            changed.write_text("{}")
        else:
            changed.write_text(changed.read_text().replace('"step": 1,', '"step": 1, "acr": 0.0,', 1))
        before = tree(out)
        with pytest.raises(SystemExit) as exit_info:
            experiments.main([*argv, "--out", str(out)])
        assert f"{changed} is " in (line := one_line(exit_info, capsys)) and "since a script wrote it" in line
        assert tree(out) == before


def plan_line(argv: list[str], capsys, monkeypatch) -> str:
    monkeypatch.setattr(plan, "calibrate", lambda args: STAND_IN)  # the interval needs no measured step
    assert experiments.main(["--dry-run", "--only", "compare", *argv]) == {}
    return next(line for line in capsys.readouterr().out.splitlines() if line.startswith("compare: each Δ"))


def test_the_plan_states_each_comparisons_interval_and_the_seeds_that_decide_the_margin(tmp_path, capsys,
                                                                                          monkeypatch):
    """With no runs of its own, the plan borrows the variances of the committed comparison (5 seeds of 336
    problems, nested: runs/experiments/compare) and says so, and from what task; its width and seeds are the
    simulated procedure's (`stats`); more seeds narrow it, a wider --margin takes fewer seeds."""
    parts = {"design": "nested", "seed_var": 0.0006421383463211154, "problem_var": 0.0,
             "noise_var": 0.10501421464108031}  # plan.compare_variances of the committed runs
    assert plan.compare_variances([plan.COMMITTED], study_flags.COMPARE)[0] == pytest.approx(parts)
    line = plan_line(["--out", str(tmp_path)], capsys, monkeypatch)
    width, seeds = stats.expected_half_width(5, 336, parts), stats.seeds_to_decide(0.025, 336, parts)
    assert f"over 5 seeds of 336 held-out problems (nested): expected 95% interval ±{100 * width:.1f}" in line
    assert f"borrowed from the committed comparison on arith-mix ({plan.COMMITTED}, nested)" in line
    assert line.endswith(f"deciding ±2.5 points 4 times in 5 at a true Δ of 0 takes {seeds} seeds")
    twelve = ",".join(map(str, range(12)))
    twelve_width = 100 * stats.expected_half_width(12, 336, parts)
    assert f"expected 95% interval ±{twelve_width:.1f} points" in plan_line(
        ["--out", str(tmp_path), "--seeds", twelve], capsys, monkeypatch)
    wider = plan_line(["--out", str(tmp_path), "--margin", "0.05"], capsys, monkeypatch)
    assert wider.endswith(f"±5 points 4 times in 5 at a true Δ of 0 takes "
                          f"{stats.seeds_to_decide(0.05, 336, parts)} seeds")


def test_the_plan_and_the_report_name_the_datas_sha256(tmp_path, capsys, monkeypatch):
    """A run is known by its data's content (config.json's data_sha256): the plan and report.md name each
    file's sha256; a generated task has no file, and says so."""
    data = math_form_file(tmp_path / "math.jsonl", levels=True)
    line = f"data: {data} sha256 {hashlib.sha256(data.read_bytes()).hexdigest()[:12]}"
    monkeypatch.setattr(plan, "calibrate", lambda args: STAND_IN)
    generated = "data: arith-mix, generated by the code: no file"
    for dataset, says in ((str(data), line), ("arith-mix", generated)):
        experiments.main(["--dry-run", "--only", "compare", "--out", str(tmp_path / "study"), "--dataset",
                          dataset])
        assert says in [line.strip() for line in capsys.readouterr().out.splitlines()]
        results = json.loads(COMMITTED_RESULTS.read_text())
        assert says in tables.report(results, "a study", tasks.data_line(dataset, "")).splitlines()


def test_on_a_fixed_test_file_the_plan_models_a_crossed_design_and_asks_for_problems(tmp_path, capsys,
                                                                                      monkeypatch):
    """A MATH-form file: every seed evaluates the same 10 held-out problems (crossed). Nested variances
    cannot split a problem's shared part from its noise: taken as shared, and said; no number of seeds
    decides ±2.5 points over 10 problems, and the plan says how many problems would."""
    data = math_form_file(tmp_path / "math.jsonl", levels=True)
    line = plan_line(["--out", str(tmp_path), "--dataset", str(data)], capsys, monkeypatch)
    assert "over 5 seeds of 10 held-out problems (crossed)" in line
    assert "its problems' noise is taken as shared by the seeds (the widest case)" in line
    assert "no number of seeds does over 10 problems: the problems set the floor; " in line
    at = int(line.split("the floor; ")[1].split()[0])
    problems = int(line.split("a test set of about ")[1].split()[0].replace(",", ""))
    assert at >= 5 and problems > 10


def test_a_results_json_that_is_not_json_is_one_line_before_any_run(tmp_path, capsys):
    figures = tmp_path / "figures"
    with owned(figures, "experiments") as folder:  # as experiments.py wrote it, then damaged
        folder.write("results.json", '{"scatter": ')
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(tmp_path / "out"), "--figures", str(figures)])
    assert f"{figures / 'results.json'} is not JSON" in one_line(exit_info, capsys)
    assert not (tmp_path / "out" / "scatter").exists()  # no run started


def test_figures_in_a_users_folder_are_refused_and_the_users_files_left_as_they_are(tmp_path, capsys):
    """--figures F where F holds the user's own results.json and figure (no record of experiments.py's), or
    F is experiments.py's but the figure is the user's: one line, before any run; nothing there changes."""
    figures = tmp_path / "mine"
    figures.mkdir()
    (figures / "results.json").write_text('{"mine": 1}')
    (figures / "early_acr_vs_accuracy.png").write_bytes(b"my figure")
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(tmp_path / "out"), "--figures", str(figures)])
    assert str(figures) in one_line(exit_info, capsys)
    assert tree(figures) == {"results.json": b'{"mine": 1}', "early_acr_vs_accuracy.png": b"my figure"}
    assert not (tmp_path / "out" / "scatter").exists()
    with owned(tmp_path / "ours", "experiments") as folder:  # experiments.py's folder, the figure the user's
        folder.save()
        (folder.path / "early_acr_vs_accuracy.png").write_bytes(b"my figure")
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(tmp_path / "out"), "--figures", str(tmp_path / "ours")])
    assert "early_acr_vs_accuracy.png is not written here" in one_line(exit_info, capsys)
    assert (tmp_path / "ours" / "early_acr_vs_accuracy.png").read_bytes() == b"my figure"
    assert not (tmp_path / "out" / "scatter").exists()  # refused before any run


def test_killed_at_20_random_moments_it_continues_exactly_and_the_users_files_stay(compare_run, tmp_path):
    """SIGKILL experiments.py 20 times at random moments (forked from a process that imported it, so each
    start costs no import): each rerun goes on from what the last left, the user's files in its folders and
    the checkout's docs/ are as they were, and the run that is let finish gives the uninterrupted run's
    numbers (the issue allows a refusal in one line; none of these kills leaves cause for one)."""
    out, rng = tmp_path / "out", random.Random(0)
    argv = [*COMPARE, "--out", str(out)]
    context = small_processes()
    users = {out / "notes.txt": b"the user's notes", out / "compare" / "draft.md": b"the user's draft"}
    docs = Path(experiments.__file__).resolve().parent / "docs"  # the checkout's: no run of --out U's
    committed = tree(docs)
    for kill in range(20):
        child = context.Process(target=experiments.main, args=(argv,))
        child.start()
        deadline = time.monotonic() + 60
        while not (out / "compare").exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # started: then a random moment
        child.join(timeout=rng.uniform(0, 3))  # a child that ends first (the study done) waits no longer
        child.kill()
        child.join()
        for path, data in users.items():
            if kill == 0:
                path.write_bytes(data)
            assert path.read_bytes() == data, f"kill {kill}"
        assert tree(docs) == committed, f"kill {kill}"
    try:
        results = experiments.main(argv)
    except SystemExit as e:  # none of the kills leaves anything it cannot go on from
        pytest.fail(f"refused after the kills: {e.code}")
    assert timeless(results) == timeless(compare_run[1])
    assert all(path.read_bytes() == data for path, data in users.items()) and tree(docs) == committed


# ------------------------------------------------------- issue 56: does LoRA match full fine-tuning?
def test_the_sweep_picks_the_most_accurate_rate_and_the_smaller_on_a_tie():
    assert tables.pick_lr({"1e-05": 0.30, "2e-05": 0.35, "4e-05": 0.33}) == "2e-05"
    assert tables.pick_lr({"0.0004": 0.4, "0.0001": 0.4, "0.0002": 0.1}) == "0.0001"  # a tie
    assert tables.pick_lr({"0.0001": 0.1, "0.0002": 0.2, "0.0004": 0.2}) == "0.0002"


@pytest.mark.parametrize("flags, says", [(["--sweep-seed", "3"], "--sweep-seed 3 is one of --seeds 0,1,2,3,4"),
                                         (["--lora-lrs", "1e-4,0"], "--lora-lrs 1e-4,0: need a comma list of "
                                          "positive numbers"),
                                         (["--full-lrs", "2e-5,0.00002"], "0.00002: 2e-05 given twice")],
                         ids=" ".join)
def test_a_sweep_that_would_pick_on_a_scored_seed_or_an_odd_rate_is_refused_at_parse_time(flags, says, capsys):
    """The rate chosen on a seed the arms are then scored on would flatter the arm it was chosen for."""
    with pytest.raises(SystemExit):
        experiments.parse_args(["--dry-run", "--only", "lora", *flags])
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and says in err


def test_lora_delta_is_paired_with_full_fine_tuning_by_seed_and_problem():
    """Seeds differ by up to 50 points, and LoRA answers 3 more problems of each seed than full fine-tuning:
    paired by seed, Δ's interval lies within a few points of +0.06; unpaired it would span the seeds."""
    rng = np.random.default_rng(5)
    full = np.stack([(rng.random(len(LEVELS)) < p).astype(float) for p in (0.2, 0.4, 0.5, 0.6, 0.7)])
    lora = full.copy()
    for s in range(5):
        lora[s, np.flatnonzero(full[s] == 0)[:3]] = 1
    table = tables.accuracy_table(np.stack([full, lora]), LEVELS, own_problems(5), ["full-ft", "lora-r1"],
                                  baseline="full-ft")
    delta = table["lora-r1"]["delta"]
    assert math.isclose(delta["mean"], 3 / 50) and 0.02 < delta["ci"][0] <= 0.06 <= delta["ci"][1] < 0.1
    assert table["full-ft"]["delta"]["ci"] == [0.0, 0.0]


def test_quick_lora_part_sweeps_each_arm_then_trains_the_seeds_at_the_chosen_rate(tmp_path):
    """The tiny model, 2 steps: each arm's sweep on seed 100, the rate picked by the rule, then the arms on
    seed 3 at that rate, on the same prompts, with Δ against full fine-tuning in the table."""
    argv = ["--quick", "--out", str(tmp_path), "--only", "lora", "--seeds", "3", "--lora-lrs", "1e-4"]
    results = experiments.main(argv)
    lora, folder = results["lora"], tmp_path / "lora"
    assert list(lora["arms"]) == list(study_flags.LORA) and lora["sweep"]["seed"] == 100
    grids = {"full-ft": ["1e-05", "2e-05"], "lora-r1": ["0.0001"], "lora-r32": ["0.0001"]}
    ranks = {"full-ft": 0, "lora-r1": 1, "lora-r32": 32}
    for arm, row in lora["arms"].items():
        assert list(lora["sweep"]["accuracy"][arm]) == grids[arm]
        sweep = lora["sweep"]["accuracy"][arm]
        assert row["lr"] == lora["sweep"]["chosen"][arm] == tables.pick_lr(sweep)
        for lr in grids[arm]:
            config = json.loads((study_runs.run_dir(folder / "sweep" / f"lr{lr}", arm, 100) / "config.json")
                                .read_text())
            assert (config["seed"], config["lr"], config["lora_rank"]) == (100, float(lr), ranks[arm])
        for seed in (3,):
            config = json.loads((study_runs.run_dir(folder, arm, seed) / "config.json").read_text())
            assert (config["seed"], config["lr"], config["lora_rank"]) == (seed, float(row["lr"]), ranks[arm])
            assert config["lora_alpha"] == 32 and config["steps"] == 2 and config["dataset"] == "arith-mix"
        assert len(row["per_seed"]) == 1 and row["seconds_per_step"]["mean"] > 0
        # one seed: no spread between seeds, so no interval and no verdict
        assert row["verdict"] == (None if arm == "full-ft" else "no information: fewer than 2 seeds: no "
                                                                 "spread between seeds to measure")
        assert row["cost"]["seconds"]["delta"] if arm != "full-ft" else row["delta"]["mean"] == 0
    logs = [study_runs.run_dir(folder, arm, 3) / "samples.jsonl" for arm in study_flags.LORA]
    asked = [[g["prompt"] for g in run_folder.read_jsonl(log) if g["step"] == 1] for log in logs]
    assert asked[0] and asked[0] == asked[1] == asked[2]
    assert all(f"| {arm} | {lora['arms'][arm]['lr']} (" in results["lora_table"] for arm in study_flags.LORA)
    again = experiments.main(argv)  # finished runs reused
    assert timeless(again["lora"]) == timeless(lora)


# ------------------------------------------------- issue 61: Ctrl-C, SIGTERM; what is checked before any run
def sleeper(started: Path, seconds: float, deaf: bool) -> None:
    """A task of `run_all`'s: says it started, then sleeps; `deaf`: on SIGTERM it only says it was told
    (told<i> beside started<i>) and sleeps on, as a worker that cannot stop would."""
    if deaf:
        told = started.with_name(started.name.replace("started", "told"))
        signal.signal(signal.SIGTERM, lambda signum, frame: told.touch())
    started.touch()
    time.sleep(seconds)


@pytest.mark.parametrize("deaf", [False, True], ids=["SIGTERM", "Ctrl-C, then SIGTERM to deaf workers"])
def test_a_stop_signal_ends_the_tasks_at_once_and_starts_no_queued_one(tmp_path, deaf):
    """SIGTERM to experiments.py alone while two tasks of 120 s run in two workers and three wait (the pool
    has handed one to a worker already): Stopped at once, and no queued task starts. Ctrl-C, then SIGTERM once
    the workers were told, to workers that ignore SIGTERM: still at once, the second ends them. Each signal is
    taken by a thread other than the main one, as the kernel may hand a process's signal to any thread that
    does not block it (tqdm's monitor, left by a run in this process): the main thread's waits, which no
    signal then interrupts, do not hold it. (Ctrl-C to every process, as a terminal sends it, with train.py's
    runs: tests/test_faults.py.)"""
    tasks = [(sleeper, tmp_path / f"started{i}", 120, deaf) for i in range(2)]
    tasks += [(Path.touch, tmp_path / f"queued{i}") for i in range(3)]

    def both(pattern: str) -> None:
        deadline = time.monotonic() + 100
        while len(list(tmp_path.glob(pattern))) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)

    def signal_this_thread():  # so the kernel does not wake the main thread for it
        both("started*")
        signal.pthread_kill(threading.get_ident(), signal.SIGINT if deaf else signal.SIGTERM)
        if deaf:
            both("told*")
            signal.pthread_kill(threading.get_ident(), signal.SIGTERM)

    threading.Thread(target=signal_this_thread, daemon=True).start()
    start = time.monotonic()
    with on_stop_signals(workers.stop_handler()), pytest.raises(workers.Stopped) as stopped:
        workers.run_all(tasks, jobs=2)
    assert stopped.value.signum == (signal.SIGINT if deaf else signal.SIGTERM)
    assert time.monotonic() - start < 110  # not after the tasks' 120 s
    assert sorted(p.name for p in tmp_path.iterdir()) == ["started0", "started1"] + ["told0", "told1"] * deaf


HUGE = str(2**70)  # an integer, past the seeds torch.manual_seed takes


@pytest.mark.parametrize("argv, run", [
    ([*COMPARE, "--seeds", f"0,{HUGE}"], f"compare/seed{HUGE}-grpo/grpo"),
    ([*SCATTER, "--scatter-seeds", f"0,{HUGE}"], f"scatter/add1-g2-seed{HUGE}/grpo"),
    (["--quick", "--only", "lora", "--seeds", HUGE], f"lora/seed{HUGE}-full-ft/grpo")],  # after its sweep
    ids=["compare", "scatter", "lora"])
def test_a_run_train_py_would_refuse_is_one_line_before_any_run(tmp_path, capsys, argv, run):
    """A seed train.py refuses: one line naming the run, with train.py's own reason, before any run (seed 0's,
    the lora part's sweep) trains, and before anything is written."""
    out = tmp_path / "out"
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*argv, "--out", str(out)])
    assert one_line(exit_info, capsys).startswith(
        f"error: {out / run}: train.py refuses this run's flags (--seed must be in [")
    assert not out.exists()


@pytest.mark.parametrize("read_only", ["out", "figures"])
def test_a_folder_it_cannot_write_is_one_line_before_any_run(tmp_path, monkeypatch, capsys, read_only):
    """--out or --figures where this process cannot write (simulated: this runs as root, whom only a read-only
    mount stops, and os.access says so): one line naming it, before any run, not a traceback once the part's
    runs are done and its figure is written; nothing changes."""
    for name in ("out", "figures"):
        with owned(tmp_path / name, "experiments") as folder:
            folder.save()  # experiments.py's folders, as a study leaves them
    before, access = tree(tmp_path), os.access
    monkeypatch.setattr(os, "access", lambda path, mode, **kw: Path(path) != tmp_path / read_only
                        and access(path, mode, **kw))
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(tmp_path / "out"), "--figures", str(tmp_path / "figures")])
    assert one_line(exit_info, capsys).startswith(
        f"error: {tmp_path / read_only}: experiments.py cannot write there (read-only, or another user's)")
    assert tree(tmp_path) == before


def test_a_write_that_fails_is_one_line(scatter_run, tmp_path, monkeypatch, capsys):
    """The disk fills as the scatter's figure is written, once its run is done: one line, as in train.py."""
    out = tmp_path / "out"
    shutil.copytree(scatter_run[0], out)
    write = Folder.write

    def full_disk(folder: Folder, name: str, data):
        if name == "early_acr_vs_accuracy.png":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder.path / name))
        return write(folder, name, data)

    monkeypatch.setattr(Folder, "write", full_disk)
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*SCATTER, "--out", str(out)])
    assert one_line(exit_info, capsys) == (f"error: [Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}: "
                                           f"'{out / 'figures' / 'early_acr_vs_accuracy.png'}'")


def test_a_write_past_the_file_size_limit_names_its_file(scatter_run, tmp_path, capsys):
    """A file size limit (RLIMIT_FSIZE) met as a figure is written: EFBIG, as a full disk's ENOSPC, comes
    from the write itself, with no file name; the one line names the file being written; the files stay as
    they were."""
    out = tmp_path / "out"
    shutil.copytree(scatter_run[0], out)
    before, limit = tree(out), resource.getrlimit(resource.RLIMIT_FSIZE)
    ignored = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process goes on
    resource.setrlimit(resource.RLIMIT_FSIZE, (10_000, limit[1]))  # a figure is larger; results.json is not
    try:
        with pytest.raises(SystemExit) as exit_info:
            experiments.main([*SCATTER, "--out", str(out)])
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, limit)
        signal.signal(signal.SIGXFSZ, ignored)
    line = one_line(exit_info, capsys)
    assert line.startswith(f"error: [Errno {errno.EFBIG}] {os.strerror(errno.EFBIG)}: '{out / 'figures'}/")
    assert line.endswith(".png'")
    files = lambda tree: {name: data for name, data in tree.items() if RECORD not in name}  # noqa: E731
    assert files(tree(out)) == files(before)  # the records: the copies' inodes, learnt as they are read


# off train.py's defaults, and set by no part of the study: each must reach every run
GIVEN = {"top_p": 0.9, "temperature": 0.7, "prompt_format": "raw", "system": "Be brief.", "beta": 0.04,
         "epsilon": 0.1, "max_grad_norm": 0.5, "micro_batch": 2, "grad_checkpointing": True,
         "reward_range": (-1.0, 1.0), "show_group": False, "log_samples": "none", "lr_decay": 0.5}


def test_every_train_py_flag_given_reaches_every_run_of_every_part():
    """Each train.py flag given to experiments.py is in every planned run's flags (parsed as train.py parses
    them), in every part; a part's own settings win: scatter's levels and G, precision's precision, the
    lora arms' rank and rate; the study sets seed and out."""
    argv = ["--quick", "--dataset", "arith-mul2", "--top-p", "0.9", "--temperature", "0.7", "--prompt-format",
            "raw", "--system", "Be brief.", "--beta", "0.04", "--epsilon", "0.1", "--max-grad-norm", "0.5",
            "--micro-batch", "2", "--grad-checkpointing", "--reward-range=-1,1", "--no-show-group",
            "--log-samples", "none", "--lr-decay", "0.5", "--lora-rank", "4"]
    args = experiments.parse_args(argv)
    parser = dataclass_parser(train.Args, "train.py")
    for part in study_flags.PARTS:
        runs = experiments.planned_runs(args, [part])
        assert runs or part == "difficulty"
        for run in runs:
            config = parser.parse_args(study_runs.train_argv(*run))
            assert {k: getattr(config, k) for k in GIVEN} == GIVEN, (part, run)
            out, seed, _, _ = run
            assert config.seed == seed and config.out == str(out)
            if part == "scatter":
                assert config.dataset in {f"arith-{level}" for level in args.scatter_levels.split(",")}
            elif part == "lora":
                assert config.lora_rank in (0, 1, 32)  # the arm's, not the 4 given
            else:
                assert config.dataset == "arith-mul2" and config.lora_rank == 4
            if part == "precision":
                assert config.precision in ("bf16", "fp32")


def math_form_file(path: Path, levels: bool) -> Path:
    """A small MATH-form file: 100 problems of levels 1-5 (as MATH-500 gives them: integers), or none."""
    rows = [{"problem": f"What is {i} + {i % 7}?", "answer": str(i + i % 7), "subject": "Prealgebra",
             **({"level": i * 7 // 10 % 5 + 1} if levels else {})} for i in range(100)]  # all in either split
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


@pytest.mark.parametrize("levels", [True, False])
def test_a_study_on_your_own_file_groups_by_its_levels_and_passes_its_flags(tmp_path, levels):
    """The study on a MATH-form file, under LoRA and raw prompts: the difficulty part and the by-level
    accuracies take the file's levels ("Level 1".."Level 5"); a file without levels is one level, named so,
    not dropped. Every run's config.json holds the flags given, and each final evaluation is on the file's
    held-out problems."""
    data = math_form_file(tmp_path / "math.jsonl", levels)
    results = experiments.main(["--quick", "--only", "difficulty,compare", "--methods", "grpo,avspo",
                                "--dataset", str(data), "--lora-rank", "2", "--prompt-format", "raw",
                                "--out", str(tmp_path / "study")])
    names = [f"Level {n}" for n in range(1, 6)] if levels else [tasks.NO_LEVEL]
    assert list(results["difficulty"]) == (names + ["mix"] if levels else names)
    assert [results["difficulty"][name]["prompts"] for name in names] == [4] * len(names)  # --quick's
    held = tasks.load_problems(str(data), "test")
    early = results["early_acr_by_level"]["runs"]  # AVSPO's Figure 1 from the GRPO runs, by level
    assert early and {p["level"] for p in early} <= set(names) and {p["seed"] for p in early} == {0, 1}
    assert (tmp_path / "study" / "figures" / "early_acr_by_level.png").exists()
    report = (tmp_path / "study" / "report.md").read_text()  # the methods, the fit, the claims it can judge
    assert results["compare_table"] in report and "## Early ACR against final accuracy, by level" in report
    assert "| AVSPO (He et al., arXiv 2605.21125): +4 to +6 points over GRPO (at least +4) |" in report
    assert "every seed answered the same problems (crossed, one test file)" in report  # a file's split
    assert "With 2 seeds each interval rests on 1 degree of freedom" in report
    assert f"data: {data} sha256 {hashlib.sha256(data.read_bytes()).hexdigest()[:12]}" in report.splitlines()
    for name, row in results["compare"].items():
        assert list(row["by_level"]) == names
        for seed in (0, 1):
            run = study_runs.run_dir(tmp_path / "study" / "compare", name, seed)
            config = json.loads((run / "config.json").read_text())
            assert (config["dataset"], config["lora_rank"], config["prompt_format"]) == (str(data), 2, "raw")
            records = run_folder.read_jsonl(run.parent / "final_eval.jsonl")
            per_level = [p.question for p in study_runs.held_out(train.Args(dataset=str(data)), seed, 2)]
            assert [r["question"] for r in records] == per_level
            assert set(per_level) <= {p.question for p in held}


def test_the_final_evaluation_is_train_pys_own_under_the_runs_flags(tmp_path, monkeypatch):
    """A run's final model evaluated by the study (re-evaluated: the problems in another order) is evaluated
    as train.py evaluated it: the same prompt format and system message, adapters, precision, length and
    sampling path, not the study's defaults; and it answers as train.py's own last evaluation did."""
    train.main(["--model", "tiny-qwen2", "--dataset", "arith-add1", "--steps", "1", "--prompts-per-step", "2",
                "--group-size", "2", "--max-new-tokens", "8", "--eval-every", "0", "--eval-size", "6",
                "--prompt-format", "raw", "--lora-rank", "2", "--precision", "bf16", "--no-fast",
                "--out", str(tmp_path)])
    run = tmp_path / "grpo"
    logged = {r["question"]: r["extracted"] for r in run_folder.read_jsonl(run / "eval_records.jsonl")}
    problems = tasks.load_problems("arith-add1", "test")[:6][::-1]
    assert set(logged) == {p.question for p in problems}
    calls, evaluate = [], study_runs.evaluate
    monkeypatch.setattr(study_runs, "evaluate",
                        lambda net, *a, **kw: calls.append((net, kw)) or evaluate(net, *a, **kw))
    records = study_runs.final_records(run, problems)
    assert {r["question"]: r["extracted"] for r in records} == logged
    [(net, kw)] = calls  # evaluated, not read back from train.py's records
    assert (kw["prompt_format"], kw["system"], kw["max_new_tokens"]) == ("raw", "", 8)
    assert kw["sample_completions"] is sample_with_generate  # --no-fast: the plain path, as train.py sampled
    assert has_adapters(net) and net.dtype == torch.bfloat16


# seeds whose first two steps sample the marked level and others; arith-mix's problems depend on the seed
@pytest.mark.parametrize("dataset, marked, right, seed", [("file", "Level 2", ("Level 1", "Level 4"), 0),
                                                          ("file", "Level 2", ("Level 1", "Level 4"), 1),
                                                          ("arith-mix", "mul1", ("add1", "mul2"), 2)])
def test_early_acr_by_level_gives_each_group_its_prompts_level(tmp_path, dataset, marked, right, seed):
    """Each logged group is its prompt's, rebuilt from the seed and step: groups of the marked level logged
    collapsed (all-wrong or all-correct) and every other group mixed give that level an early ACR of 1 and
    the others 0, over the early steps only (a later all-collapsed step counts not); each point's accuracy
    is its level's in the final records."""
    dataset = str(math_form_file(tmp_path / "math.jsonl", levels=True)) if dataset == "file" else dataset
    config = train.Args(dataset=dataset, prompts_per_step=6, steps=10)  # early: the first 2 steps
    problems = tasks.load_problems(dataset, "train", seed)
    steps = [{"step": step, "groups_sampled": "".join(
        "WC"[step % 2] if p.level == marked or step > 2 else "M"  # all-wrong or all-correct: collapsed
        for p in tasks.step_problems(problems, 6, seed, step))} for step in range(1, 11)]
    run = tmp_path / "run" / "grpo"
    run.mkdir(parents=True)
    write_jsonl(run / "metrics.jsonl", steps)
    held = study_runs.held_out(config, seed, None)
    write_jsonl(run / "eval_records.jsonl", [{"question": p.question, "level": p.level, "extracted": None,
                                              "correct": p.level in right} for p in held])
    fit = tables.early_acr_by_level({seed: run}, config, None)
    seen = {p.level for step in (1, 2) for p in tasks.step_problems(problems, 6, seed, step)}
    assert marked in seen and len(seen) > 1
    assert {p["level"] for p in fit["runs"]} == seen and all(p["seed"] == seed for p in fit["runs"])
    for point in fit["runs"]:
        assert point["early_acr"] == (point["level"] == marked)
        assert point["accuracy"] == (point["level"] in right)
    assert sum(p["groups"] for p in fit["runs"]) == 12  # 2 early steps of 6 groups


COMMITTED_RESULTS = Path(experiments.__file__).parent / "docs" / "results.json"
README = Path(experiments.__file__).parent / "README.md"


def test_the_report_judges_the_committed_comparison_as_the_readme_does():
    """report.md's claims from docs/results.json: compare's rows, and AVSPO's from the readings, get the
    README's verdicts (its claims table), by the one rule that the README states in the same words."""
    results = json.loads(COMMITTED_RESULTS.read_text())
    verdicts = lambda rows: [(row.split(" | ")[0][2:], row.rsplit("**", 2)[1]) for row in rows]  # noqa: E731
    claims = {claim: measure for claim, _, measure, _ in tables.CLAIMS}
    judged = dict(verdicts(tables.claim_rows(results)))
    assert judged == dict(zip(claims, ["refuted", "refuted", "confirmed", "inconclusive", "confirmed",
                                       "confirmed"]))
    rows = tables.claim_rows({**results, "compare": results["readings"]})
    assert dict(verdicts(rows))[next(iter(claims))] == "refuted"
    assert "-3.7 [-6.0, -1.4] points" in rows[0] and "38.3% [18.1%, 58.6%] (Δ / GRPO's 0.562)" in rows[1]
    assert "**inconclusive**" in rows[1]  # the cut: its interval holds the claimed 58%
    text = tables.report(results, "SmolLM2-135M on arith-mix", tasks.data_line("arith-mix", ""))
    assert text.startswith("# The study: SmolLM2-135M on arith-mix") and results["compare_table"] in text
    assert "## Early ACR" in text and text.count("** |") == 6 and stats.RULE in text
    assert "a t interval over the per-seed means, with 4 degrees of freedom" in text  # its design, nested
    assert stats.RULE in " ".join(README.read_text().split())  # one wording: the README's is the code's


def test_a_claim_whose_measure_sits_at_its_ceiling_gets_no_verdict():
    """The real-data example's case: every group all-wrong (GRPO's effective ACR 1 in every run) and a
    trigger that fired at every step (AVSPO's 0): a 100% cut holds by construction, so no verdict; so too an
    accuracy of 0 in every run of both methods, and a study of one seed."""
    results = json.loads(COMMITTED_RESULTS.read_text())
    table = {name: results["compare"][name] for name in ("grpo", "avspo")}
    for name, value in (("grpo", 1.0), ("avspo", 0.0)):
        for key in ("acr_effective", "acr_effective_first_quarter", "acr_effective_last_quarter"):
            table[name]["collapse"][key]["per_seed"] = [value] * 5
        table[name]["per_seed"] = [0.0] * 5
    rows = tables.claim_rows({"compare": table})  # AVSPO's gain, its cut, GRPO's late rise
    assert [row.split(" | ")[-1] for row in rows] == [
        "no information: at its floor or ceiling in every run: the result holds by construction |"] * 3
    table["avspo"]["per_seed"] = [0.0] * 4 + [1 / 336]  # one right answer: information, if little
    assert "no information" not in tables.claim_rows({"compare": table})[0]


def test_the_real_data_examples_committed_logs_recompute_its_report(tmp_path, monkeypatch):
    """docs/study-example.md's command, run again on a copy of its committed logs (no checkpoint, so nothing
    can train): every run is reused, and report.md and results.json come out as committed, byte for byte;
    that report gives no verdict, since every run sits at a floor or a ceiling (issue 71)."""
    root = Path(experiments.__file__).resolve().parent
    committed = root / "runs" / "experiments" / "study-example"
    doc = (root / "docs" / "study-example.md").read_text()
    command = shlex.split(doc.split("```bash\n")[1].split("```")[0].replace("\\\n", " "))
    out = str(committed.relative_to(root))
    assert command[:2] == ["python", "experiments.py"] and command[-2:] == ["--out", out]
    shutil.copytree(committed, tmp_path / "study")
    monkeypatch.chdir(root)  # the runs name their data file by its path in the checkout
    experiments.main([*command[2:-2], "--out", str(tmp_path / "study")])
    for name in ("report.md", "figures/results.json"):
        assert (tmp_path / "study" / name).read_bytes() == (committed / name).read_bytes(), name
    report = (committed / "report.md").read_text()
    assert report.count("| no information: at its floor or ceiling in every run") == 3
    assert "\n".join("#" + line if line.startswith("#") else line for line in report.splitlines()) in doc


def test_the_readme_prints_the_numbers_of_docs_results_json():
    """Every interval the README's results and claims print, recomputed from docs/results.json; the claims'
    intervals also in docs/results.md's table of what issue 71 changed."""
    results, readme = json.loads(COMMITTED_RESULTS.read_text()), README.read_text()
    history = (COMMITTED_RESULTS.parent / "results.md").read_text()
    changes = history.split("## Intervals by the study's design")[1].split("\n## ")[0]
    compare, readings, lora = results["compare"], results["readings"], results["lora"]["arms"]
    ci3 = lambda x: f"{x['mean']:.3f} [{x['ci'][0]:.3f}, {x['ci'][1]:.3f}]"  # noqa: E731
    ci2 = lambda x: f"{x['mean']:.2f} [{x['ci'][0]:.2f}, {x['ci'][1]:.2f}]"  # noqa: E731
    pts = lambda x: f"{100 * x['mean']:+.1f} [{100 * x['ci'][0]:+.1f}, {100 * x['ci'][1]:+.1f}]"  # noqa: E731
    for name, row in compare.items():
        delta = "-" if name == "grpo" else pts(row["delta"])
        assert f"| {name} | {ci3(row['accuracy'])} | {delta} |" in readme, name
        assert f" | {ci2(row['collapse']['clipped'])} | " in readme, name
    base = readings["grpo"]["collapse"]["acr_effective"]["mean"]
    for arm in ("avspo", "avspo-fixed"):
        d = readings[arm]["collapse"]["acr_effective"]["delta"]
        cut = f"{-d['mean'] / base:.1%} [{-d['ci'][1] / base:.1%}, {-d['ci'][0] / base:.1%}]"
        assert cut in readme and cut in changes
    for said in [pts(readings["avspo"]["delta"]), pts(readings["avspo"]["delta_vs_ablation"]["avspo-fixed"]),
                 *(pts(compare[m]["delta_by_level"]["add2"]) for m in ("aapo", "dapo")),
                 *(pts(lora[arm]["delta"]) for arm in ("lora-r1", "lora-r32"))]:
        assert said in readme, said
    for said in [pts(readings["avspo"]["delta"]), pts(readings["avspo"]["delta_vs_ablation"]["avspo-fixed"]),
                 pts(compare["aapo"]["delta"]), pts(compare["dapo"]["delta"]),
                 *(pts(lora[arm]["delta"]) for arm in ("lora-r1", "lora-r32"))]:
        assert said in changes, said
    grpo = compare["grpo"]["collapse"]
    assert f"{grpo['late_rise']['mean']:+.2f} [{grpo['late_rise']['ci'][0]:+.2f}, " \
           f"{grpo['late_rise']['ci'][1]:+.2f}]" in readme
    pooled, within = results["scatter"], results["scatter"]["within"]
    line = lambda fit: f"slope {fit['slope']:.2f} [{fit['slope_ci'][0]:.2f}, {fit['slope_ci'][1]:.2f}], " \
        f"R² {fit['r2']:.2f}"  # noqa: E731
    assert f"{line(pooled)}; within levels: {line(within)}" in readme


def test_print_commands_then_the_study_gathers_what_the_in_process_study_computes(tmp_path, capsys,
                                                                                  monkeypatch):
    """--print-commands prints one train.py command per run (absolute paths, nothing run); run them as a
    scheduler would, and the same study without the flag trains nothing and gives the in-process study's
    numbers. lora, whose runs follow its sweep, is not printed."""
    study = ["--quick", "--only", "compare", "--methods", "grpo,dapo", "--seeds", "0"]
    inside = experiments.main([*study, "--out", str(tmp_path / "inside")])
    capsys.readouterr()
    printed = experiments.main([*study, "--only", "compare,lora", "--out", "apart", "--print-commands"])
    commands = capsys.readouterr().out.splitlines()
    assert printed == {} and len(commands) == 2  # compare's 2 methods x 1 seed; nothing trained
    assert not (tmp_path / "apart" / "compare" / "seed0-grpo").exists()
    for command in commands:
        _, script, *argv = shlex.split(command)
        assert Path(script) == Path(train.__file__).resolve()
        assert Path(argv[argv.index("--out") + 1]).is_absolute()
        train.main(argv)
    monkeypatch.setattr(train, "main", lambda argv: pytest.fail(f"trained again: {argv}"))
    apart = experiments.main([*study, "--out", "apart"])  # relative: the tests run in tmp_path
    for name, row in inside["compare"].items():
        for key in ("accuracy", "delta", "by_level", "per_seed"):
            assert apart["compare"][name][key] == row[key]
        assert apart["compare"][name]["collapse"]["acr"] == row["collapse"]["acr"]

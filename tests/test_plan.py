"""study/plan.py: a study's time from a calibration (a stand-in, then train.py's own on the tiny model), the
rule that fits --budget-minutes, the memory said against the device's, and the progress said by the plan."""

import dataclasses
import json
import time
from pathlib import Path

import pytest
import torch

import experiments
import train
from data import tasks
from loop import run
from loop.run_folder import read_jsonl
from study import parts, plan, workers
from study import flags as study_flags

GIB = 2**30
# a stand-in calibration: a step of 64 completions takes 10 s, 6 of them sampling; a problem 0.5 s
STAND_IN = plan.Calibration(step_seconds=10.0, sample_seconds=6.0, problem_seconds=0.5, run_seconds=20.0,
                            rows=64, acr=0.5, peak_bytes=3 * GIB, device_bytes=8 * GIB)
QUICK = ["--quick", "--only", "compare", "--methods", "grpo,dapo"]


def test_a_runs_seconds_add_its_steps_its_evaluations_and_its_final_evaluation():
    config = train.Args(steps=10, eval_every=5, eval_size=40, prompts_per_step=8, group_size=8)
    # the rest of a run, 10 steps of 10 s, 3 evaluations (before, steps 5 and 10) of 40 problems
    assert plan.run_seconds(STAND_IN, config, held=336, final=0) == 20 + 100 + 120 * 0.5
    # the final model evaluated on 336 problems loads its checkpoint again
    assert plan.run_seconds(STAND_IN, config, held=336, final=336) == 180 + 20 + 336 * 0.5
    assert plan.run_seconds(STAND_IN, config, held=10, final=0) == 20 + 100 + 30 * 0.5  # a small split
    assert plan.run_seconds(STAND_IN, dataclasses.replace(config, group_size=4), 336, 0) == 20 + 50 + 60
    assert plan.run_seconds(STAND_IN, dataclasses.replace(config, eval_every=0), 336, 0) == 20 + 100 + 40
    # AAPO samples again for its reference; DAPO for a share ACR of the groups, then ACR of those (2 rounds)
    assert plan.run_seconds(STAND_IN, dataclasses.replace(config, algo="aapo"), 336, 0) == 180 + 10 * 6
    assert plan.run_seconds(STAND_IN, dataclasses.replace(config, algo="dapo"), 336, 0) == 180 + 10 * 6 * 0.75


def test_a_study_plan_adds_the_runs_of_each_part_it_trains(tmp_path):
    """compare's runs evaluate their final models on every held-out problem when train.py's last evaluation
    did not; lora's arms train at one rate each (after a sweep of every rate); scatter's do not evaluate
    again; the difficulty part samples outside the runs, one thing at a time."""
    args = study_flags.parse_args(["--out", str(tmp_path), "--seeds", "0,1", "--steps", "10", "--eval-every",
                                   "5", "--methods", "grpo,aapo", "--scatter-levels", "add1",
                                   "--scatter-g", "4", "--scatter-seeds", "0"])
    asked = ["difficulty", "compare", "scatter"]
    runs = parts.planned_runs(args, asked, every_rate=False)
    assert len(runs) == 4 + 1  # 2 methods x 2 seeds; 1 level x 1 G x 1 seed
    levels = len(tasks.by_level(tasks.load_problems(args.train.dataset)))
    result = plan.study_plan(runs, tmp_path, 336, STAND_IN, 2, plan.difficulty_seconds(STAND_IN, levels, 32))
    compare = [plan.run_seconds(STAND_IN, dataclasses.replace(args.train, algo=algo), 336, 336)
               for _ in range(2) for algo in ("grpo", "aapo")]  # seed by seed
    level = plan.run_args(runs[-1])  # add1's own split
    scatter = plan.run_seconds(STAND_IN, level, len(plan.held_out(level, 0, None)), 0)
    assert result.seconds == dict(zip([out / algo for out, _, algo, _ in runs], [*compare, scatter]))
    assert result.alone == 20 + 5 * 32 * 8 * 6 / 64  # five levels of 32 prompts, G = 8
    assert result.minutes == pytest.approx(((sum(compare) + scatter) / 2 + result.alone) / 60)
    assert result.steps == 4 * 10 + 15
    assert result.problems == 4 * (3 * 112 + 336) + 2 * min(32, len(plan.held_out(level, 0, None)))
    lora = study_flags.parse_args(["--out", str(tmp_path), "--seeds", "0,1", "--full-lrs", "1e-5,2e-5",
                                   "--lora-lrs", "1e-4,2e-4,4e-4"])
    assert len(parts.planned_runs(lora, ["lora"], every_rate=False)) == 2 + 3 * 2 + 3 * 2  # sweep, then arms
    assert len(parts.planned_runs(lora, ["lora"])) == 2 + 3 * 2 + 2 * 2 + 3 * 2 * 2  # every rate: checks


def minutes_of(scale: plan.Scale) -> float:
    """A stand-in plan: a seed's runs take a minute a step and a minute per 16 problems evaluated."""
    return len(scale.seeds) * (scale.steps + scale.eval_size / 16)


ASKED = plan.Scale(seeds=(0, 1, 2, 3, 4), steps=40, eval_size=112)  # 5 x (40 + 7) = 235 min
EVERYTHING = {"seeds", "steps", "eval_size"}


@pytest.mark.parametrize("budget, free, most_seeds, expected, fits", [
    (235, EVERYTHING, None, ASKED, True),  # fits: as asked
    (400, EVERYTHING, 9, plan.Scale((0, 1, 2, 3, 4, 5, 6, 7), 40, 112), True),  # seeds added while they fit
    (400, EVERYTHING, 6, plan.Scale((0, 1, 2, 3, 4, 5), 40, 112), True),  # up to those that decide
    (400, {"steps", "eval_size"}, 9, ASKED, True),  # seeds given: kept
    (220, EVERYTHING, None, plan.Scale((0, 1, 2, 3, 4), 40, 56), True),  # the evaluation halves first
    (210, EVERYTHING, None, plan.Scale((0, 1, 2, 3, 4), 40, 32), True),  # down to 32 problems
    (168, EVERYTHING, None, plan.Scale((0, 1, 2, 3), 40, 32), True),  # then seeds go, the last first
    (80, EVERYTHING, None, plan.Scale((0, 1), 38, 32), True),  # then steps: the most that fit
    (20, EVERYTHING, None, plan.Scale((0, 1), 10, 32), False),  # a quarter at least: nothing fits
    (220, {"seeds", "steps"}, None, plan.Scale((0, 1, 2, 3), 40, 112), True),  # --eval-size given
    (200, {"eval_size"}, None, plan.Scale((0, 1, 2, 3, 4), 40, 32), False),  # only --eval-size free
])
def test_the_budget_rule_curves_then_seeds_then_steps(budget, free, most_seeds, expected, fits):
    assert plan.fit_budget(minutes_of, ASKED, budget, free, most_seeds, skip_seed=100) == (expected, fits)


def test_a_seed_added_skips_the_lora_sweeps():
    assert plan.fit_budget(minutes_of, plan.Scale((0, 1), 1, 32), 100, EVERYTHING, 4, skip_seed=2)[0].seeds \
        == (0, 1, 3, 4)


def test_the_budget_fits_a_study_on_a_stand_in_step_and_says_so(tmp_path, monkeypatch, capsys):
    """The whole plan on the stand-in: the scale chosen fits, one seed more would not, and the plan printed
    is that scale's; a budget nothing fits is one line, and no run starts."""
    monkeypatch.setattr(plan, "calibrate", lambda args: STAND_IN)
    argv = ["--only", "compare", "--methods", "grpo,aapo", "--out", str(tmp_path), "--dry-run"]
    assert experiments.main([*argv, "--budget-minutes", "300"]) == {}
    printed = capsys.readouterr().out
    chosen = next(line for line in printed.splitlines() if line.startswith("--budget-minutes 300 fits "))
    seeds = chosen.split("--seeds ")[1].split()[0]
    steps = study_flags.STUDY_DEFAULTS["steps"]
    assert chosen.endswith(f"--steps {steps} --eval-size 112 (plan.fit_budget's rule)")  # as asked
    args = study_flags.parse_args([*argv, "--seeds", seeds])

    def minutes(seeds: str) -> float:
        at = study_flags.parse_args([*argv, "--seeds", seeds])
        return plan.study_plan(parts.planned_runs(at, ["compare"]), tmp_path, 336, STAND_IN, 2).minutes

    assert minutes(seeds) <= 300 < minutes(f"{seeds},{len(args.seeds.split(','))}")
    assert f"about {minutes(seeds):.1f} min, 2 runs at once" in printed
    assert f"over {len(seeds.split(','))} seeds of 336 held-out problems" in printed
    assert experiments.main([*argv, "--budget-minutes", "300", "--seeds", "0,1"]) == {}
    assert "--budget-minutes 300 fits --seeds 0,1 --steps " in capsys.readouterr().out  # given: kept
    with pytest.raises(SystemExit) as exit_info:
        experiments.main([*argv, "--budget-minutes", "5"])
    smallest = f"--seeds 0,1 --steps {steps // 4} --eval-size 32"
    assert str(exit_info.value.code).startswith(
        f"error: no plan fits --budget-minutes 5: the smallest by plan.fit_budget's rule ({smallest})")
    assert "no run started" in str(exit_info.value.code) and not (tmp_path / "compare").exists()


@pytest.mark.parametrize("jobs, device_bytes, warned", [(2, 8 * GIB, False), (3, 8 * GIB, True),
                                                        (1, 3 * GIB, True)])
def test_the_plan_sets_the_peak_memory_of_the_runs_on_a_device_against_its_own(jobs, device_bytes, warned,
                                                                               capsys):
    cal = dataclasses.replace(STAND_IN, device_bytes=device_bytes)
    plan.print_plan(plan.Plan({Path("a"): 60.0}, 1, 10, 0.0, jobs), cal, sharing=jobs)
    printed = capsys.readouterr().out
    assert f"{jobs} on a device: {3 * jobs:.1f} of its {device_bytes / GIB:.1f} GiB" in printed
    assert ("warning: " in printed) == warned


def test_runs_share_the_cpu_and_take_a_gpu_each(monkeypatch):
    assert workers.runs_at_once(3, "cpu") == (3, 3)
    assert workers.default_jobs("cpu") == study_flags.parse_args([]).jobs == 2
    monkeypatch.setattr(workers, "pick_device", lambda name: torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    assert workers.runs_at_once(3, "auto") == (2, 2)  # the third shares a GPU
    assert workers.runs_at_once(1, "auto") == (1, 1)
    assert workers.default_jobs("auto") == study_flags.parse_args([]).jobs == 2  # one a GPU
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert study_flags.parse_args([]).jobs == 1 and study_flags.parse_args(["--jobs", "3"]).jobs == 3


def test_the_progress_says_the_minutes_left_by_the_plan(capsys):
    run = lambda name: (Path(name), 0, "grpo", [])  # noqa: E731
    progress = workers.Progress({Path("a/grpo"): 600.0, Path("b/grpo"): 1200.0, Path("c/grpo"): 60.0}, 2)
    progress.ran(run("b"))
    progress.ran(run("trained-before"))  # not planned: says nothing
    progress.ran(run("a"))
    lines = capsys.readouterr().out.splitlines()
    assert [line.split(" in ")[0] for line in lines] == ["study: 1 of 3 runs done", "study: 2 of 3 runs done"]
    assert lines[0].endswith("about 6 min left by the plan")  # (600 + 60) / 2 s
    assert lines[1].endswith("about 0 min left by the plan")


def test_the_calibration_is_train_pys_own_step_and_evaluations_and_is_reused(tmp_path, monkeypatch, capsys):
    """One step, every row trained, and two evaluations of --eval-size problems (at most 32) at the
    comparison runs' settings; what the plan reads is what train.py logged. The same settings reuse it, others
    calibrate afresh."""
    args = study_flags.parse_args([*QUICK, "--out", str(tmp_path)])
    cal = plan.calibrate(args)
    out, _, algo, flags = plan.calibration_run(args)
    assert out.parent == tmp_path / "calibration" and "--steps=1" in flags and "--eval-every=0" in flags
    step, = read_jsonl(out / algo / "metrics.jsonl")
    assert step["rows_trained"] == 2 * 4  # AVSPO always on: every row, as no method trains more
    evals = read_jsonl(out / algo / "evals.jsonl")
    summary = json.loads((out / algo / "summary.json").read_text())
    assert cal.step_seconds == step["time_generate"] + step["time_score"] + step["time_train"] > 0
    assert cal.sample_seconds == step["time_generate"] + step["time_score"]
    assert cal.problem_seconds == sum(e["time_eval"] for e in evals) / (2 * args.train.eval_size) > 0
    evaluating = 2 * 4 * cal.problem_seconds  # two evaluations of --quick's 4 problems
    assert cal.run_seconds == pytest.approx(summary["time_run"] - cal.step_seconds - evaluating)
    assert (cal.rows, cal.acr, cal.peak_bytes) == (2 * 4, step["acr"], step["peak_memory_bytes"])
    assert cal.peak_bytes > 0 and cal.device_bytes > cal.peak_bytes
    monkeypatch.setattr(train, "main", lambda argv: pytest.fail(f"calibrated again: {argv}"))
    assert plan.calibrate(args) == cal
    for other in (["--max-new-tokens", "4"], ["--jobs", "2"]):  # another run, or other threads a run
        at = study_flags.parse_args([*QUICK, "--out", str(tmp_path), *other])
        assert plan.calibration_run(at)[0] != out


def test_a_runs_wall_time_counts_the_loading_of_its_model(tmp_path, monkeypatch):
    """summary.json's time_run, the calibration's "rest of a run", starts before the model loads: a load made
    a second slower shows in it (a lower bound, whatever the machine's speed)."""
    load_model = run.load_model

    def slow_load(*args, **kwargs):
        time.sleep(1.0)
        return load_model(*args, **kwargs)

    monkeypatch.setattr(run, "load_model", slow_load)
    train.main(["--model", "tiny-qwen2", "--steps", "1", "--eval-every", "0", "--eval-size", "2",
                "--max-new-tokens", "4", "--save-every", "0", "--out", str(tmp_path)])
    assert json.loads((tmp_path / "grpo" / "summary.json").read_text())["time_run"] >= 1.0

"""Nothing a user keeps is lost: every script's flags checked in one line before any model loads, a reward that
cannot hang a run, saves that fail in one line and lose nothing, a run folder written and removed only by its
owner, and a --resume that never starts over (issue 50)."""

import errno
import json
import math
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections import Counter
from pathlib import Path

import pytest

import eval as evaluation
import experiments
from data import prepare
from verifier import load_reward

ROOT = Path(__file__).resolve().parent.parent


def no_model(*args, **kwargs):
    raise AssertionError("a model was loaded before the flags were checked")


def one_line_error(capsys) -> str:
    """The single line a refused flag leaves on stderr (argparse's usage block is not printed)."""
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


# ---------------------------------------------------------------- every flag checked before any model loads


EVAL_FLAGS = [["--batch-size", "-1"], ["--batch-size", "0"], ["--limit", "-3"], ["--temperature", "-1"],
              ["--temperature", "nan"], ["--samples", "-1"], ["--samples", "0"], ["--max-new-tokens", "0"],
              ["--max-new-tokens", "-5"], ["--reward-timeout", "-1"], ["--samples", "4", "--temperature", "0"]]


@pytest.mark.parametrize("flags", EVAL_FLAGS, ids=" ".join)
def test_eval_refuses_a_bad_flag_in_one_line_before_any_model(flags, monkeypatch, capsys):
    monkeypatch.setattr(evaluation, "load_model", no_model)
    monkeypatch.setattr(evaluation, "load_tokenizer", no_model)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main(["--model", "tiny-qwen2", *flags])
    line = one_line_error(capsys)
    assert exit_info.value.code == 2 and flags[0] in line and "--help" in line


EXPERIMENTS_FLAGS = [["--eval-every", "0"], ["--steps", "0"], ["--group-size", "1"], ["--jobs", "0"],
                     ["--resamples", "-1"], ["--step-seconds", "nan"], ["--budget-minutes", "-1"],
                     ["--seeds", "0,x"], ["--scatter-g", "1,2"], ["--only", "compare,typo"],
                     ["--methods", "grpo,ppo"], ["--scatter-levels", "add9"], ["--per-level", "-1"]]


@pytest.mark.parametrize("flags", EXPERIMENTS_FLAGS, ids=" ".join)
def test_experiments_refuses_a_bad_flag_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        experiments.parse_args(["--dry-run", *flags])
    line = one_line_error(capsys)
    assert exit_info.value.code == 2 and flags[0] in line and "--help" in line


def test_experiments_eval_every_0_is_refused_not_a_division_by_zero(capsys):
    with pytest.raises(SystemExit):
        experiments.main(["--dry-run", "--eval-every", "0"])
    assert "--eval-every" in one_line_error(capsys)


def test_an_out_that_is_a_file_is_one_line_for_every_script(tmp_path, capsys):
    (tmp_path / "file").write_text("mine")
    for main in (evaluation.main, experiments.parse_args, prepare.main):
        with pytest.raises(SystemExit):
            main(["--out", str(tmp_path / "file" / "below")])
        line = one_line_error(capsys)
        assert "--out" in line and "is a file, not a folder" in line
    assert (tmp_path / "file").read_text() == "mine"


def test_prepare_refuses_an_unknown_name_in_one_line(tmp_path, capsys):
    with pytest.raises(SystemExit):
        prepare.main(["gsm8k", "typo", "--out", str(tmp_path)])
    assert "unknown typo" in one_line_error(capsys)


@pytest.mark.parametrize("script, flags", [("bench", ["--steps", "0"]), ("bench", ["--rounds", "0"]),
                                           ("gpu_bench", ["--group-size", "1"]),
                                           ("gpu_bench", ["--budget-s", "nan"]),
                                           ("fast_vs_plain", ["--reps", "0"]), ("trigger_table", ["--runs", "0"])])
def test_the_benchmarks_refuse_a_bad_flag_in_one_line(script, flags, capsys):
    module = __import__(f"benchmarks.{script}", fromlist=["main"])
    with pytest.raises(SystemExit) as exit_info:
        module.main(flags)
    assert exit_info.value.code == 2 and flags[0] in one_line_error(capsys)


# ---------------------------------------------------------------- eval.py: Ctrl-C, its results, the context


def test_eval_ctrl_c_is_one_line_and_writes_nothing(tmp_path, monkeypatch, capsys):
    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(evaluation, "evaluate", interrupted)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main(["--model", "tiny-qwen2", "--limit", "2", "--out", str(tmp_path / "out")])
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "eval.py: interrupted, nothing written"
    assert not (tmp_path / "out").exists()


def test_eval_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    flags = ["--model", "tiny-qwen2", "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path)]
    evaluation.main(flags)
    before = {p.name: p.read_text() for p in tmp_path.iterdir()}
    assert f"wrote {tmp_path / 'summary.json'}" in capsys.readouterr().out
    real_replace = Path.replace

    def disk_full(self, target):
        if Path(target).name == "summary.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_replace(self, target)

    monkeypatch.setattr(Path, "replace", disk_full)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main(flags + ["--seed", "1"])
    assert "could not be written" in str(exit_info.value.code) and "No space left" in str(exit_info.value.code)
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(before)  # no .tmp left behind
    assert json.loads((tmp_path / "summary.json").read_text()) == json.loads(before["summary.json"])


def test_eval_warns_once_when_a_prompt_exceeds_the_context(tmp_path, capsys):
    """tiny-qwen2 has a context of 1024 tokens; a question of 3000 characters passes it."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in ("7 " * 1500, "1 + 0?")))
    evaluation.main(["--model", "tiny-qwen2", "--dataset", str(data), "--max-new-tokens", "2"])
    warnings = [line for line in capsys.readouterr().err.splitlines() if "context" in line]
    assert len(warnings) == 1 and "exceeds the model's context of 1024 tokens" in warnings[0]


# ---------------------------------------------------------------- a reward cannot hang a run


HANGS = '''
import re, time

def stuck(completion, gold):
    if completion == "loop":
        while True:  # Python bytecode, forever
            pass
    if completion == "regex":  # C code holding the GIL: catastrophic backtracking
        return float(bool(re.match(r"(a+)+$", "a" * 64 + "b")))
    if completion == "sleep":
        time.sleep(3600)
    return float(completion == gold)
'''


@pytest.fixture()
def hangs(tmp_path, monkeypatch):
    (tmp_path / "hanging_rewards.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hanging_rewards", None)


def test_a_reward_call_past_its_time_limit_scores_0_and_is_counted(hangs, capfd):
    counts = Counter()
    reward = load_reward("hanging_rewards:stuck", time_limit=1.0, counts=counts)
    start = time.monotonic()
    assert reward(["q"] * 5, ["5", "loop", "regex", "sleep", "5"], ["5"] * 5) == [1.0, 0.0, 0.0, 0.0, 1.0]
    assert time.monotonic() - start < 30 and counts["reward_timeouts"] == 3
    assert reward(["q"], ["5"], ["5"]) == [1.0]  # a fresh process after the stuck one
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "took over 1 s (--reward-timeout)" in warnings[0]


def test_the_verifier_runs_in_the_run_s_own_process(monkeypatch):
    """verifier.verify is pure Python with bounded work: no process of its own, no slower default run."""
    monkeypatch.setattr(subprocess, "Popen", no_model)
    assert load_reward("verifier", time_limit=5.0)(["q", "q"], ["\\boxed{5}", "4"], ["5", "5"]) == [1.0, 0.0]

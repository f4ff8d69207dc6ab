"""Nothing a user keeps is lost: every script's flags checked in one line before any model loads, a reward
that cannot hang a run, saves that fail in one line and lose nothing, a run folder written and removed only
by its owner, and a --resume that never starts over (issue 50)."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from collections import Counter
from contextlib import contextmanager
from multiprocessing.connection import Connection
from pathlib import Path
from types import SimpleNamespace

import pytest

import eval as evaluation
import experiments
import train
import verifier
from data import prepare
from infra.written import ANY_DIR, RECORD, owned
from loop.run_folder import find_checkpoint, read_jsonl
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
              ["--max-new-tokens", "-5"], ["--reward-timeout", "-1"],
              ["--samples", "4", "--temperature", "0"]]


@pytest.mark.parametrize("flags", EVAL_FLAGS, ids=" ".join)
def test_eval_refuses_a_bad_flag_in_one_line_before_any_model(flags, monkeypatch, capsys):
    monkeypatch.setattr(evaluation, "load_model", no_model)
    monkeypatch.setattr(evaluation, "load_tokenizer", no_model)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main(["--model", "tiny-qwen2", *flags])
    line = one_line_error(capsys)
    assert exit_info.value.code == 2 and flags[0] in line and "--help" in line


EXPERIMENTS_FLAGS = [["--eval-every", "-1"], ["--steps", "0"], ["--group-size", "1"], ["--jobs", "0"],
                     ["--budget-minutes", "nan"], ["--budget-minutes", "-1"],
                     ["--seeds", "0,x"], ["--scatter-g", "1,2"], ["--only", "compare,typo"],
                     ["--methods", "grpo,ppo"], ["--scatter-levels", "add9"], ["--per-level", "-1"],
                     ["--budget-minutes", "60", "--print-commands"]]


@pytest.mark.parametrize("flags", EXPERIMENTS_FLAGS, ids=" ".join)
def test_experiments_refuses_a_bad_flag_in_one_line(flags, capsys):
    with pytest.raises(SystemExit) as exit_info:
        experiments.parse_args(["--dry-run", *flags])
    line = one_line_error(capsys)
    assert exit_info.value.code == 2 and flags[0] in line and "--help" in line


def test_experiments_eval_every_0_plans_two_evaluations_a_run_not_a_division_by_zero(capsys):
    """train.py's --eval-every 0 (before and after training alone) passes to the study's runs."""
    assert experiments.main(["--dry-run", "--quick", "--only", "compare", "--eval-every", "0"]) == {}
    assert "10 training runs, 20 steps" in capsys.readouterr().out


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
                                           ("fast_vs_plain", ["--reps", "0"]),
                                           ("trigger_table", ["--runs", "0"])])
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
        try:
            evaluation.main(["--model", "tiny-qwen2", "--limit", "2", "--out", str(tmp_path / "out")])
        except KeyboardInterrupt:  # as it is, it would stop the whole session, not fail this test
            pytest.fail("Ctrl-C left eval.py as a KeyboardInterrupt, a traceback")
    assert exit_info.value.code == 130
    assert capsys.readouterr().err.strip() == "eval.py: interrupted, nothing written"
    assert not (tmp_path / "out").exists()


def test_eval_results_are_written_whole_or_not_at_all(tmp_path, monkeypatch, capsys):
    """A disk that fills while summary.json is written, the last file: the samples already written are new,
    yet every file stays as the evaluation before left it (before issue 61, new samples stayed beside the old
    summary.json)."""
    flags = ["--model", "tiny-qwen2", "--limit", "2", "--max-new-tokens", "4", "--out", str(tmp_path),
             "--temperature", "1"]  # sampled: another seed's samples differ
    evaluation.main(flags)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != RECORD}
    assert f"wrote {tmp_path / 'summary.json'}" in capsys.readouterr().out
    real_fdopen = os.fdopen

    class DiskFull:  # the file that written.Folder.write fills
        def __init__(self, fd, *args):
            self.file = real_fdopen(fd, *args)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.file.close()

        def __getattr__(self, name):  # reading, as infra/written.py reads its record and hashes files
            return getattr(self.file, name)

        def write(self, data):
            if isinstance(data, bytes) and data.startswith(b'{\n  "dataset"'):  # summary.json's text
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return self.file.write(data)

    monkeypatch.setattr(os, "fdopen", DiskFull)
    with pytest.raises(SystemExit) as exit_info:
        evaluation.main(flags + ["--seed", "1"])
    line = str(exit_info.value.code)
    assert "could not be written" in line and "No space left" in line
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir() if p.name != RECORD} == before  # no .tmp


def test_eval_warns_once_when_a_prompt_exceeds_the_context(tmp_path, capsys):
    """tiny-qwen2 has a context of 1024 tokens, a token a byte; a question of 966 characters fits it, but not
    with 8 new tokens (a longer prompt is refused: tests/test_eval.py)."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in ("7 " * 483, "1?")))
    evaluation.main(["--model", "tiny-qwen2", "--dataset", str(data), "--max-new-tokens", "8"])
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


@contextmanager
def fails_after(seconds: int):
    """The block fails once `seconds` have passed: where the time limit does not hold, the test fails rather
    than hang the suite."""
    def fail(signum, frame):
        pytest.fail(f"still running after {seconds} s: the reward's time limit did not hold")

    previous = signal.signal(signal.SIGALRM, fail)
    signal.alarm(seconds)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.fixture()
def hangs(tmp_path, monkeypatch):
    (tmp_path / "hanging_rewards.py").write_text(HANGS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("hanging_rewards", None)


def test_a_reward_call_past_its_time_limit_scores_0_and_is_counted(hangs, capfd, monkeypatch):
    """Each call waits at most the time limit (the waits are recorded, not timed: no machine is too slow)."""
    counts, waits, poll = Counter(), [], Connection.poll
    monkeypatch.setattr(verifier, "time", SimpleNamespace(monotonic=lambda: 0.0))  # a still clock: the waits
    monkeypatch.setattr(Connection, "poll", lambda channel, timeout=0.0: waits.append(timeout)  # are exact
                        or poll(channel, timeout))
    reward = load_reward("hanging_rewards:stuck", time_limit=1.0, counts=counts)
    with fails_after(60):  # a hang guard: the calls take about 3 s here
        assert reward(["q"] * 5, ["5", "loop", "regex", "sleep", "5"], ["5"] * 5) == [1.0, 0.0, 0.0, 0.0, 1.0]
    start = verifier.IMPORT_LIMIT  # each process's import has its own limit (tests/test_reward_worker.py)
    assert waits == [start, 1.0, 1.0, start, 1.0, start, 1.0, start, 1.0]
    assert counts["reward_timeouts"] == 3
    assert reward(["q"], ["5"], ["5"]) == [1.0]  # a fresh process after the stuck one
    warnings = [line for line in capfd.readouterr().err.splitlines() if line.startswith("warning:")]
    assert len(warnings) == 1 and "took over 1 s (--reward-timeout)" in warnings[0]


def test_the_verifier_runs_in_the_run_s_own_process(monkeypatch):
    """verifier.verify is pure Python with bounded work: no process of its own, no slower default run."""
    monkeypatch.setattr(subprocess, "Popen", no_model)
    assert load_reward("verifier", time_limit=5.0)(["q", "q"], ["\\boxed{5}", "4"], ["5", "5"]) == [1.0, 0.0]


# ---------------------------------------------------------------- train.py: flags, the run folder, --resume

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4",
        "--eval-every", "0"]


def no_model_in_a_run(monkeypatch):
    from loop import run as run_module
    monkeypatch.setattr(run_module, "load_model", no_model)


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.mark.parametrize("flags", [["--steps", "0"], ["--temperature", "nan"], ["--reward-timeout", "-1"],
                                   ["--group-size", "1"], ["--resume", "--overwrite"]], ids=" ".join)
def test_train_refuses_a_bad_flag_in_one_line_before_any_model(flags, monkeypatch, capsys):
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + flags)
    line = one_line_error(capsys)
    assert exit_info.value.code == 2 and flags[0] in line and "--help" in line


def runs_folder(out: Path) -> Path:
    """<out> as train.py leaves it: a folder of runs, with its record (infra/written.py)."""
    with owned(out, "runs") as folder:
        folder.save()  # a record as a run leaves it (owning alone writes nothing)
        return out


def test_a_fresh_run_deletes_nothing_it_did_not_write(tmp_path, monkeypatch):
    """<out>/grpo holding a thesis: refused in one line, with or without --overwrite (issue 54: a folder
    holding files that no run wrote is never used; before, --overwrite went on beside them)."""
    run_dir = runs_folder(tmp_path / "out") / "grpo"
    (run_dir / "chapters").mkdir(parents=True)
    (run_dir / "thesis.tex").write_text("months of work")
    (run_dir / "chapters" / "one.tex").write_text("more")
    mine = files_under(run_dir)
    no_model_in_a_run(monkeypatch)
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as exit_info:
            train.main(TINY + ["--steps", "1", "--out", str(run_dir.parent), *extra])
        assert str(exit_info.value.code) == (f"error: {run_dir} holds files and no record of what a script "
                                             "wrote there (chapters, thesis.tex): move them, or choose "
                                             "another folder")
        assert files_under(run_dir) == mine


@pytest.mark.parametrize("out_as", ["no record", "no record, a config beside", "recorded"])
def test_a_plot_at_out_that_no_run_wrote_is_never_replaced(tmp_path, monkeypatch, out_as):
    """Issue 54: before, a user's curves.png was replaced once any sub-folder held a config.json."""
    out = runs_folder(tmp_path / "out") if out_as == "recorded" else tmp_path / "out"
    (out / "grpo").mkdir(parents=True)
    if out_as == "no record, a config beside":
        (out / "grpo" / "config.json").write_text("{}")
    (out / "curves.png").write_bytes(b"my own figure")
    mine = {k: v for k, v in files_under(out).items() if RECORD not in k}
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as exit_info:
            train.main(TINY + ["--steps", "1", "--out", str(out), *extra])
        line = str(exit_info.value.code)
        assert line.startswith(f"error: {out}") and "curves.png" in line and "\n" not in line
        assert {k: v for k, v in files_under(out).items() if RECORD not in k} == mine


FINISHED = TINY + ["--steps", "2", "--save-every", "1", "--lr-decay", "0"]  # --steps may grow on --resume


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory) -> Path:
    """A finished 2-step run, checkpoint and all, to copy into each test."""
    out = tmp_path_factory.mktemp("finished")
    train.main(FINISHED + ["--out", str(out)])
    return out


def copy_of(run: Path, tmp_path: Path) -> Path:
    import shutil
    shutil.copytree(run, tmp_path / "run")
    return tmp_path / "run"


@pytest.mark.parametrize("damage, says", [
    ("save-every 0", "it was run with --save-every 0"),
    ("no state.pt", "checkpoint/state.pt is missing"),
    ("truncated state.pt", "checkpoint/state.pt is damaged (truncated, or not torch.save's)"),
    ("pickled weights", "model/pytorch_model.bin is refused unread: a pickle, which could run code"),
    ("truncated weights", "checkpoint/model/model.safetensors is damaged (shorter than its header says)")])
def test_resume_never_starts_over_a_run_it_cannot_continue(finished_run, tmp_path, monkeypatch, damage, says):
    out = copy_of(finished_run, tmp_path)
    checkpoint = out / "grpo" / "checkpoint"
    if damage == "save-every 0":
        import shutil
        shutil.rmtree(checkpoint)
        config = json.loads((out / "grpo" / "config.json").read_text())
        (out / "grpo" / "config.json").write_text(json.dumps({**config, "save_every": 0}))
    elif damage == "no state.pt":
        (checkpoint / "state.pt").unlink()
    elif damage == "truncated state.pt":
        (checkpoint / "state.pt").write_bytes((checkpoint / "state.pt").read_bytes()[:5000])
    elif damage == "pickled weights":
        import torch
        (checkpoint / "model" / "model.safetensors").unlink()
        torch.save({"w": torch.zeros(1)}, checkpoint / "model" / "pytorch_model.bin")
    else:
        weights = checkpoint / "model" / "model.safetensors"
        weights.write_bytes(weights.read_bytes()[:-100])
    before = files_under(out)
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(FINISHED + ["--out", str(out), "--resume"]
                   + (["--save-every", "0"] if damage == "save-every 0" else []))
    line = str(exit_info.value.code)
    assert line.startswith(f"error: --resume: {out / 'grpo'} holds a run (steps logged: 2) but no whole "
                           "checkpoint to continue from: ") and says in line and "\n" not in line
    assert "--overwrite starts it again" in line and files_under(out) == before
    if damage != "save-every 0":  # moved away, --overwrite takes it
        assert f"move {checkpoint} away (changed since the run saved it), then --overwrite" in line
        checkpoint.rename(tmp_path / "damaged")
        with pytest.raises(AssertionError, match="a model was loaded"):  # past every check of the folder
            train.main(FINISHED + ["--out", str(out), "--overwrite"])


def test_a_save_stopped_between_its_renames_resumes_from_the_whole_older_one(finished_run, tmp_path):
    """checkpoint/ renamed to checkpoint.old, the new one not yet in place (infra/written.py's record says
    so). Before issue 54 this test damaged checkpoint/ by hand: a checkpoint changed since a run wrote it is
    now refused (`test_a_symlink_or_a_changed_file_at_a_run_file_stops_the_run`)."""
    out = copy_of(finished_run, tmp_path)
    run_dir = out / "grpo"
    with owned(out, "runs") as runs:
        runs.subfolder("grpo", "run").rename("checkpoint", "checkpoint.old")
    train.main(FINISHED + ["--steps", "3", "--out", str(out), "--resume"])
    assert [r["step"] for r in read_jsonl(run_dir / "metrics.jsonl")] == [1, 2, 3]
    assert not (run_dir / "checkpoint.old").exists() and find_checkpoint(run_dir) == run_dir / "checkpoint"


@pytest.mark.parametrize("config", ["{not json", "[1, 2]"])
def test_a_damaged_config_on_resume_is_one_line(finished_run, tmp_path, monkeypatch, config):
    out = copy_of(finished_run, tmp_path)
    (out / "grpo" / "config.json").write_text(config)
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(FINISHED + ["--out", str(out), "--resume"])
    line = str(exit_info.value.code)
    assert line.startswith(f"error: {out / 'grpo' / 'config.json'} ") and "\n" not in line


def test_a_bad_metrics_line_met_by_a_fresh_run_is_the_earlier_run_line(finished_run, tmp_path, monkeypatch):
    out = copy_of(finished_run, tmp_path)
    metrics = out / "grpo" / "metrics.jsonl"
    metrics.write_text("{torn\n" + metrics.read_text())
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "1", "--out", str(out)])
    line = str(exit_info.value.code)
    assert line.startswith(f"error: {out / 'grpo'} holds an earlier run (steps logged: 3)")


def test_a_run_folder_that_is_a_file_is_one_line_before_any_model(tmp_path, monkeypatch):
    out = runs_folder(tmp_path / "out")
    (out / "grpo").write_text("mine")
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "1", "--out", str(out), "--overwrite"])
    assert str(exit_info.value.code) == (f"error: {out / 'grpo'} is a file, not a folder a script wrote: it "
                                         "is left as it is; move it, or choose another folder")
    assert (out / "grpo").read_text() == "mine"


@pytest.mark.parametrize("code", [errno.ENOSPC, errno.EROFS], ids=["disk full", "read-only"])
def test_a_save_that_fails_is_one_line_and_loses_nothing(tmp_path, monkeypatch, code):
    """The save of step 2 fails: one line, the checkpoint of step 1 stays whole, nothing half-written is
    left, and --resume (once there is room) goes on from step 1 to the same end."""
    from loop import run_folder
    import torch
    real_save, saves = torch.save, iter([True, False])

    def failing_save(obj, path, *args, **kwargs):
        if not next(saves, True):
            raise OSError(code, os.strerror(code), str(path))
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(run_folder.torch, "save", failing_save)
    flags = TINY + ["--steps", "3", "--save-every", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        train.main(flags)
    line = str(exit_info.value.code)
    assert line == (f"error: the checkpoint of step 2 could not be saved in {tmp_path / 'grpo'} "
                    f"({os.strerror(code)}); {tmp_path / 'grpo' / 'checkpoint'} stays whole: --resume goes "
                    "on from it once there is room")
    assert not [p for p in (tmp_path / "grpo").iterdir() if p.name.endswith(".tmp")]  # nothing half-written
    monkeypatch.undo()
    assert torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=True)["step"] == 1
    train.main(flags + ["--resume"])
    assert [r["step"] for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")] == [1, 2, 3]


def test_a_log_line_that_cannot_be_written_is_one_line_and_loses_nothing(tmp_path, monkeypatch):
    """The disk fills as step 2's metrics line is appended: one line naming the file; step 1's line and
    checkpoint stay, and --resume goes on from them."""
    from loop import run_folder
    import torch
    real_append = run_folder.append_jsonl

    def full_disk(folder, name, record):
        if name == "metrics.jsonl" and record["step"] == 2:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(folder.path / name))
        real_append(folder, name, record)

    monkeypatch.setattr(run_folder, "append_jsonl", full_disk)
    flags = TINY + ["--steps", "3", "--save-every", "1", "--out", str(tmp_path)]
    with pytest.raises(SystemExit) as exit_info:
        train.main(flags)
    metrics = tmp_path / "grpo" / "metrics.jsonl"
    full = f"[Errno {errno.ENOSPC}] {os.strerror(errno.ENOSPC)}"
    assert str(exit_info.value.code) == f"error: {full}: '{metrics}'"
    assert [r["step"] for r in read_jsonl(metrics)] == [1]
    assert torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=True)["step"] == 1
    monkeypatch.undo()
    train.main(flags + ["--resume"])
    assert [r["step"] for r in read_jsonl(metrics)] == [1, 2, 3]


def test_a_file_planted_where_a_save_wrote_is_left_and_the_save_goes_on(tmp_path, monkeypatch):
    """checkpoint.tmp as a file, planted mid-run (where the save wrote before issue 54, which removed it): the
    save fills a temporary of its own, and the file stays as it is."""
    real_start = train.start_logs

    def plant(folder, config, last_step):
        totals = real_start(folder, config, last_step)
        (folder.path / "checkpoint.tmp").write_text("in the way")
        return totals

    monkeypatch.setattr(train, "start_logs", plant)
    train.main(TINY + ["--steps", "1", "--save-every", "1", "--out", str(tmp_path)])
    assert find_checkpoint(tmp_path / "grpo")
    assert (tmp_path / "grpo" / "checkpoint.tmp").read_text() == "in the way"


def test_a_leftover_temporary_is_cleared_on_the_next_start(finished_run, tmp_path):
    """A save killed while it filled its folder: the record names the temporary, the next start removes it."""
    out = copy_of(finished_run, tmp_path)
    with owned(out, "runs") as runs:
        leftover = out / "grpo" / runs.subfolder("grpo", "run").reserve("checkpoint", ANY_DIR).name
    (leftover / "model").mkdir()
    (leftover / "model" / "w.bin").write_bytes(b"part of a checkpoint")
    train.main(FINISHED + ["--out", str(out), "--resume"])
    assert not leftover.exists()


def test_an_interrupt_on_an_evaluation_step_still_logs_its_groups(tmp_path, monkeypatch):
    """Ctrl-C during step 2, an evaluation step: the step ends and is saved, its evaluation is skipped (the
    resumed run does it), and its groups reach samples.jsonl all the same."""
    real_step, stop = train.train_step, []

    def step_then_ctrl_c(args, run, step, *rest):
        if step == 2:
            stop.append(signal.SIGINT)
        return real_step(args, run, step, *rest)

    monkeypatch.setattr(train, "train_step", step_then_ctrl_c)
    args = train.parse_args(TINY + ["--steps", "4", "--eval-every", "2", "--out", str(tmp_path)])
    with pytest.raises(KeyboardInterrupt), owned(tmp_path, "runs") as out:
        train.train(args, out.subfolder("grpo", "run"), stop)
    assert sorted({r["step"] for r in read_jsonl(tmp_path / "grpo" / "samples.jsonl")}) == [2]


def test_a_run_warns_once_when_a_prompt_exceeds_the_context(tmp_path, capsys):
    """A prompt of 1,013 tokens and 16 new ones pass tiny-qwen2's 1,024 (a longer prompt: one line, refused,
    tests/test_train.py)."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in ("7 " * 480, "1?")))
    train.main(["--model", "tiny-qwen2", "--max-new-tokens", "16", "--group-size", "2", "--eval-size", "1",
                "--steps", "1", "--prompts-per-step", "1", "--save-every", "0", "--dataset", str(data),
                "--eval-dataset", str(data), "--out", str(tmp_path / "run")])  # 2 problems: none held out
    warnings = [line for line in capsys.readouterr().out.splitlines() if "context" in line]
    assert len(warnings) == 1 and "exceeds the model's context of 1024 tokens" in warnings[0]


# ---------------------------------------------------------- infra/written.py's rule: only what a script wrote


def test_a_folder_of_run_file_names_no_run_wrote_is_refused_and_kept(tmp_path):
    """Issue 54: <out>/grpo holding a user's summary.json, evals.jsonl, samples.jsonl and checkpoint.tmp/:
    before, a fresh run deleted all four (they carry run files' names), exit 0."""
    run_dir = runs_folder(tmp_path / "out") / "grpo"
    (run_dir / "checkpoint.tmp").mkdir(parents=True)
    for name in ("summary.json", "evals.jsonl", "samples.jsonl", "checkpoint.tmp/notes.txt"):
        (run_dir / name).write_text(f"the user's {name}")
    mine = files_under(run_dir)
    for extra in ([], ["--overwrite"]):
        with pytest.raises(SystemExit) as exit_info:
            train.main(TINY + ["--steps", "1", "--out", str(run_dir.parent), *extra])
        line = str(exit_info.value.code)
        assert line.startswith(f"error: {run_dir} holds files and no record") and "\n" not in line
        assert files_under(run_dir) == mine


@pytest.mark.parametrize("lock", ["file", "symlink"])
def test_a_users_lock_file_at_out_is_never_written(finished_run, tmp_path, monkeypatch, lock):
    """Issue 54: before, <out>/.lock was truncated to a pid by any run that reached the lock, a refused one
    too, and a symlink's target with it. The lock is now the folder itself (`written.owned`)."""
    out = copy_of(finished_run, tmp_path)
    target = tmp_path / "mine.txt"
    target.write_text("the user's")
    if lock == "file":
        target.rename(out / ".lock")
        target = out / ".lock"
    else:
        (out / ".lock").symlink_to(target)
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:  # refused: the run is there
        train.main(FINISHED + ["--out", str(out)])
    assert "holds an earlier run" in str(exit_info.value.code)
    assert target.read_text() == "the user's"


RUN_FILES = ["config.json", "metrics.jsonl", "evals.jsonl", "samples.jsonl", "eval_records.jsonl",
             "summary.json", "checkpoint", "checkpoint.old", "curves.png"]  # all train.py writes, by name


@pytest.mark.parametrize("how", ["--resume", "--overwrite"])
@pytest.mark.parametrize("name", RUN_FILES)
def test_a_symlink_at_a_run_file_stops_the_run_in_one_line_and_its_target_stays(finished_run, tmp_path,
                                                                               monkeypatch, name, how):
    """A symlink in place of a file train.py writes, in a finished run (issue 54: before, --resume wrote
    summary.json through it): the run stops before any model in one line naming the path; the target is
    untouched."""
    out = copy_of(finished_run, tmp_path)
    path = out / name if name == "curves.png" else out / "grpo" / name
    target = tmp_path / "target"
    if name.startswith("checkpoint"):
        target.mkdir()
        (target / "state.pt").write_text("the user's")
    else:
        target.write_text("the user's")
    if os.path.lexists(path):
        os.rename(path, tmp_path / "moved away")
    path.symlink_to(target)
    kept = files_under(target) if target.is_dir() else target.read_text()
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(FINISHED + ["--out", str(out), how, *(["--steps", "3"] if how == "--resume" else [])])
    line = str(exit_info.value.code)
    assert str(path) in line and "\n" not in line, line
    assert (files_under(target) if target.is_dir() else target.read_text()) == kept


def test_a_changed_run_file_is_refused_even_with_overwrite(finished_run, tmp_path, monkeypatch):
    """A user's edit of summary.json makes it theirs: --overwrite leaves it, and the run, as they are."""
    out = copy_of(finished_run, tmp_path)
    (out / "grpo" / "summary.json").write_text("{'my': 'notes'}")
    before = files_under(out)
    no_model_in_a_run(monkeypatch)
    with pytest.raises(SystemExit) as exit_info:
        train.main(FINISHED + ["--out", str(out), "--overwrite"])
    assert str(exit_info.value.code).startswith(f"error: {out / 'grpo' / 'summary.json'} is changed since a "
                                                "script wrote it")
    assert files_under(out) == before


KILLER = """
import os, random, shutil, signal, sys
sys.path.insert(0, {root!r})
import train

ops = [0]  # the filesystem changes the run makes from the start of its logs: killed before the k-th
real = {{name: getattr(os, name) for name in ("replace", "rename", "unlink", "rmdir")}}
KILL_AT = None

def counted(name):
    def op(*args, **kwargs):
        ops[0] += 1
        if ops[0] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return real[name](*args, **kwargs)
    return op

real_start, real_first_eval = train.start_logs, train.first_eval

def start_logs(*args):  # the run's start: what --overwrite removes and what it writes first
    for name in real:
        setattr(os, name, counted(name))
    return real_start(*args)

def first_eval(*args):  # the start done: killed here if not before
    real_first_eval(*args)
    open({count!r}, "w").write(str(ops[0]))
    os.kill(os.getpid(), signal.SIGKILL)

train.start_logs, train.first_eval = start_logs, first_eval

def start(out, kill_at):  # a child process (no torch op has run here: fork is safe), killed in its start
    global KILL_AT
    if os.fork() == 0:
        KILL_AT = kill_at
        train.main({flags!r} + ["--out", out, "--overwrite"])
        os._exit(0)
    os.wait()

shutil.copytree({finished!r}, {tmp!r} + "/count")
start({tmp!r} + "/count", None)  # counts the changes
rng = random.Random(0)
total = int(open({count!r}).read())
for i in range(20):
    out = {tmp!r} + f"/out-{{i}}"
    shutil.copytree({finished!r}, out)
    start(out, rng.randint(1, total))
"""


def test_sigkilled_20_times_in_overwrite_nothing_is_lost_and_resume_continues_or_refuses(finished_run, tmp_path,
                                                                                        monkeypatch):
    """--overwrite over a finished run, SIGKILLed before a random one of the filesystem changes of its start
    (removing the run, then its config, logs and first evaluation): the user's notes.txt beside the run
    stays, and --resume either refuses in one line or finds the finished run whole, to continue exactly."""
    notes = finished_run / "notes.txt"
    notes.write_text("the user's")
    try:
        killer = subprocess.run([sys.executable, "-c", KILLER.format(
            root=str(ROOT), flags=FINISHED, tmp=str(tmp_path), count=str(tmp_path / "ops"),
            finished=str(finished_run))], cwd=ROOT, capture_output=True, text=True, timeout=600)
    finally:
        notes.unlink()
    assert killer.returncode == 0, killer.stderr[-3000:]
    whole = {k: v for k, v in files_under(finished_run / "grpo").items() if not k.startswith(RECORD)}
    no_model_in_a_run(monkeypatch)
    outcomes = Counter()
    for i in range(20):
        out = tmp_path / f"out-{i}"
        assert (out / "notes.txt").read_text() == "the user's"
        with pytest.raises((SystemExit, AssertionError)) as stopped:  # AssertionError: it went on to the model
            train.main(FINISHED + ["--out", str(out), "--resume"])
        if stopped.type is SystemExit:
            line = str(stopped.value.code)
            assert line.startswith("error: --resume: ") and "\n" not in line, (i, line)
            outcomes["refused"] += 1
        else:
            assert {k: v for k, v in files_under(out / "grpo").items()
                    if not k.startswith(RECORD) and ".tmp" not in k.split("/")[0]} == whole, i
            outcomes["continues"] += 1
    print(dict(outcomes), "of 20 kills among", (tmp_path / "ops").read_text(), "filesystem changes")


# ---------------------------------------------------------------- one owner; a reward that hangs in a run


def python_run(args: list[str], tmp_path: Path, **env: str) -> subprocess.Popen:
    """train.py in a process of its own, the test's reward modules importable, with these variables set."""
    env = {**os.environ, "PYTHONPATH": str(tmp_path), "OMP_NUM_THREADS": "1", **env}
    return subprocess.Popen([sys.executable, str(ROOT / "train.py"), *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


SLOW_TO_START = '''
import os, time
from pathlib import Path

Path(os.environ["IMPORTING"]).touch()
deadline = time.monotonic() + 240
while not Path(os.environ["FIRST_DONE"]).exists() and time.monotonic() < deadline:
    time.sleep(0.1)  # importing this module takes until the first run has finished

def parity(completion, gold):
    return float(len(completion) % 2)
'''


def test_a_run_slow_to_start_never_replaces_the_run_that_started_after_it(tmp_path):
    """B starts first but takes until A has finished to import its reward; A starts once B is importing it,
    and runs meanwhile. B must judge the folder once it owns it, and so finds A's finished run there:
    refused in one line, A's run whole. (Before issue 50, B judged the folder before importing: empty.)"""
    (tmp_path / "slow_reward.py").write_text(SLOW_TO_START)
    out, done, importing = tmp_path / "run", tmp_path / "first-done", tmp_path / "importing"
    late = python_run(TINY + ["--steps", "1", "--out", str(out), "--reward", "slow_reward:parity"], tmp_path,
                      FIRST_DONE=str(done), IMPORTING=str(importing))
    deadline = time.monotonic() + 240
    while not importing.exists() and late.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    first = python_run(TINY + ["--steps", "2", "--out", str(out)], tmp_path)
    assert first.wait(timeout=240) == 0, first.stderr.read()[-2000:]
    kept = files_under(out / "grpo")
    done.touch()
    _, err = late.communicate(timeout=240)
    assert late.returncode == 1
    last = err.strip().splitlines()[-1]
    assert last.startswith(f"error: {out / 'grpo'} holds an earlier run (steps logged: 2)")
    assert files_under(out / "grpo") == kept


HANGS_IN_A_RUN = '''
import os, time
from pathlib import Path

def sometimes_stuck(completion, gold):
    if len(completion) % 3 == 0:
        while True:  # never returns
            pass
    return float(len(completion) % 2)

calls = 0

def stuck_at_step_2(completion, gold):
    global calls
    calls += 1
    if calls > int(os.environ.get("HANG_AFTER", 10**9)):  # 4 evaluated, 2 prompts x 4 in step 1: then hangs
        Path(os.environ["STUCK"]).touch()
        time.sleep(3600)
    return float(len(completion) % 2)
'''


def test_a_reward_that_hangs_scores_0_past_the_time_limit_and_the_run_goes_on(tmp_path, monkeypatch):
    (tmp_path / "hanging_run_rewards.py").write_text(HANGS_IN_A_RUN)
    monkeypatch.syspath_prepend(str(tmp_path))
    with fails_after(180):
        train.main(TINY + ["--steps", "2", "--reward", "hanging_run_rewards:sometimes_stuck",
                           "--reward-timeout", "0.5", "--out", str(tmp_path / "run"), "--save-every", "0"])
    rows = read_jsonl(tmp_path / "run" / "grpo" / "metrics.jsonl")
    assert len(rows) == 2 and sum(r["reward_timeouts"] for r in rows) > 0


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_reward_hangs_stops_at_once_and_resume_redoes_it(tmp_path, monkeypatch, signum):
    """Step 2's reward never returns: Ctrl-C or SIGTERM ends the run at once (not after the reward's time
    limit), with step 1 saved; --resume redoes step 2."""
    (tmp_path / "hanging_run_rewards.py").write_text(HANGS_IN_A_RUN)
    stuck, out = tmp_path / "stuck", tmp_path / "run"
    flags = TINY + ["--eval-every", "3", "--steps", "3", "--save-every", "1", "--out", str(out), "--reward",
                    "hanging_run_rewards:stuck_at_step_2", "--reward-timeout", "600"]
    run = python_run(flags, tmp_path, HANG_AFTER=str(4 + 8), STUCK=str(stuck))
    deadline = time.monotonic() + 240
    while not stuck.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.2)
    run.send_signal(signum)
    try:
        said, err = run.communicate(timeout=120)  # at once: not after --reward-timeout 600, nor an hour
    finally:
        run.kill()
    assert run.returncode == 128 + signum and "Traceback" not in err, err[-2000:]
    assert "[grpo] interrupted while scoring step 2 (dropped): step 1 saved in" in said
    assert [r["step"] for r in read_jsonl(out / "grpo" / "metrics.jsonl")] == [1]
    monkeypatch.syspath_prepend(str(tmp_path))
    train.main(flags + ["--resume"])
    assert [r["step"] for r in read_jsonl(out / "grpo" / "metrics.jsonl")] == [1, 2, 3]


def process_state(pid: int) -> tuple[str, int] | None:
    """A process's state letter and its parent's pid, from /proc; None once it is gone."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()  # after "pid (name)"
    except OSError:
        return None
    return fields[0], int(fields[1])


def alive(pid: int) -> bool:
    state = process_state(pid)
    return state is not None and state[0] != "Z"  # a zombie has ended


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_reward_process_ends_with_its_run_even_one_killed_while_the_reward_hangs(tmp_path):
    """SIGKILL to a run while its reward hangs: no finalizer runs, but the reward's process ends too
    (verifier.die_with), rather than outlive the run."""
    (tmp_path / "hanging_run_rewards.py").write_text(HANGS_IN_A_RUN)
    stuck = tmp_path / "stuck"
    run = python_run(TINY + ["--steps", "3", "--out", str(tmp_path / "run"), "--reward",
                             "hanging_run_rewards:stuck_at_step_2", "--reward-timeout", "600"],
                     tmp_path, HANG_AFTER=str(4 + 8), STUCK=str(stuck))
    deadline = time.monotonic() + 240
    while not stuck.exists() and run.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)
    workers = [int(p.name) for p in Path("/proc").iterdir() if p.name.isdigit()
               and (state := process_state(int(p.name))) and state[0] != "Z" and state[1] == run.pid]
    run.kill()
    run.wait(timeout=30)  # not its pipes: a worker left alive would hold them open
    run.stdout.close(), run.stderr.close()
    assert stuck.exists() and len(workers) == 1, workers
    deadline = time.monotonic() + 10
    while alive(workers[0]) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not alive(workers[0]), f"the reward's process {workers[0]} outlived its run"

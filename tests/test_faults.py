"""Faults a user meets, each refused in one line or survived: a bad reward, a run folder in use or holding an
earlier run, an --out that is a file, a --resume under other flags, a damaged checkpoint or log, a planted
pickle, SIGTERM or Ctrl-C, and a run killed at random moments."""

import contextlib
import dataclasses
import json
import multiprocessing
import os
import random
import re
import signal
import subprocess
import sys
import time
import types
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import forkserver
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import save_file

import train
from eval import main as eval_main
from infra.lora import has_adapters
from infra.written import RECORD, owned
from loop import run as run_module
from loop import run_folder
from loop.run_folder import read_jsonl
from model import load_model
from study.runs import run_config
from verifier import RewardError, checked, load_reward, per_completion

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]
ROOT = Path(__file__).resolve().parent.parent
REWARDS = '''
import os

calls, limit = 0, int(os.environ.get("BREAK_AFTER", 10**9))  # the calls after it return NaN

def nan(completion, gold): return float("nan")
def string(completion, gold): return "1"
def five(completion, gold): return 5.0
def negative(completion, gold): return -3.0
def none(completion, gold): return None
def huge(completion, gold): return 10**400
def raises(completion, gold): return {"x": 1}[completion]
def parity(completion, gold): return float(len(completion) % 2)
def trl_strings(prompts, completions, **kwargs): return ["1"] * len(completions)
def trl_none(prompts, completions, **kwargs): return [None] * len(completions)

def breaks_later(completion, gold):
    global calls
    calls += 1
    return float("nan") if calls > limit else float(len(completion) % 2)

def raises_later(completion, gold):  # reads its limit when called: in the run's process, imported before it
    global calls
    calls += 1
    if calls > int(os.environ.get("BREAK_AFTER", 10**9)):
        raise ZeroDivisionError("the reward's own bug")
    return float(len(completion) % 2)
'''


@pytest.fixture()
def rewards(tmp_path, monkeypatch):
    """A module of user rewards, importable as `user_rewards`."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_rewards", None)
    yield __import__("user_rewards")
    sys.modules.pop("user_rewards", None)


# ---------------------------------------------------------------- rewards are checked where they enter


@pytest.mark.parametrize("name, says", [("nan", "returned nan"), ("five", "returned 5.0"),
                                        ("string", "returned '1', a str, not a number"),
                                        ("negative", "returned -3.0"), ("none", "returned None"),
                                        ("huge", "returned an int beyond a float's range"),
                                        ("trl_strings", "a str, not a number")])
def test_a_bad_reward_is_refused_naming_spec_problem_and_completion(rewards, name, says):
    reward = load_reward(f"user_rewards:{name}")
    with pytest.raises(RewardError) as error:
        reward(["What is 2 + 3?", "What is 7 * 8?"], ["5", "56"], ["5", "56"])
    line = str(error.value)
    assert f"'user_rewards:{name}'" in line and says in line and "\n" not in line
    assert "completion 0 of the batch, '5', of problem 'What is 2 + 3?'" in line


def test_the_declared_range_admits_what_it_declares(rewards):
    assert load_reward("user_rewards:five", (0.0, 5.0))(["q"], ["a"], ["b"]) == [5.0]
    assert load_reward("user_rewards:negative", (-3.0, 1.0))(["q"], ["a"], ["b"]) == [-3.0]
    with pytest.raises(RewardError, match="within --reward-range 0,4.5"):
        load_reward("user_rewards:five", (0.0, 4.5))(["q"], ["a"], ["b"])
    assert load_reward()(["q", "q"], ["\\boxed{5}", "4"], ["5", "5"]) == [1.0, 0.0]  # the verifier's own


@pytest.mark.parametrize("time_limit", [0, 60], ids=["in-process", "own-process"])
def test_a_reward_that_raises_is_one_line_after_its_own_traceback(rewards, capfd, time_limit):
    """The same on both paths: RewardError, one line naming the reward, the exception and the completion; the
    user's traceback before it, marked as the reward's and holding only the reward's frames."""
    with pytest.raises(RewardError) as error:
        load_reward("user_rewards:raises", time_limit=time_limit)(["q1", "q2"], ["x", "y"], ["g", "g"])
    assert str(error.value) == ("reward 'user_rewards:raises' raised KeyError: 'y' on the completion 'y' of "
                                "problem 'q2', gold 'g' (its traceback above)")
    err = capfd.readouterr().err.strip().splitlines()
    assert err[:2] == ["reward 'user_rewards:raises' raised; its traceback, in the reward's code:",
                       "Traceback (most recent call last):"] and err[-1] == "KeyError: 'y'", err
    assert "user_rewards.py" in err[2] and not any("verifier.py" in line for line in err), err


@pytest.mark.parametrize("name", ["nan", "string", "five", "negative"])
def test_train_py_stops_on_a_bad_reward_in_one_line(rewards, name, tmp_path, capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "2", "--reward", f"user_rewards:{name}", "--out",
                           str(tmp_path / "run")])
    assert str(exit_info.value.code).startswith(f"error: reward 'user_rewards:{name}' returned ")
    assert "Traceback" not in capsys.readouterr().err


@pytest.mark.parametrize("name, timeout, steps, eval_every, says", [
    ("breaks_later", "5", 4, 0, "returned nan"),  # in step 3, in its own process
    ("raises_later", "0", 4, 0, "raised ZeroDivisionError: the reward's own bug on the completion"),  # here
    ("raises_later", "0", 2, 1, "raised ZeroDivisionError")],  # in the evaluation after step 1
    ids=["nan-own-process", "raises-in-process", "raises-in-an-evaluation"])
def test_a_bad_reward_mid_run_loses_no_finished_step(rewards, tmp_path, monkeypatch, capsys, name, timeout,
                                                     steps, eval_every, says):
    """--save-every 10, the reward breaks (a NaN) or raises in step 3 (or in the evaluation after step 1):
    one line, the steps before are saved, and --resume with the reward fixed goes on, each step logged
    once, each evaluation too."""
    out = tmp_path / "out"  # not tmp_path, which holds user_rewards.py: a folder no run may use (issue 54)
    flags = TINY + ["--steps", str(steps), "--eval-every", str(eval_every), "--reward",
                    f"user_rewards:{name}", "--reward-timeout", timeout, "--out", str(out)]
    # the reward reads its limit: the evaluation before training (4 problems), then 2 steps of 2 prompts x 4
    # (or 1 step, and then its evaluation)
    monkeypatch.setenv("BREAK_AFTER", str(4 + 8 * (steps // 2)))
    with pytest.raises(SystemExit) as exit_info:
        train.main(flags)
    assert str(exit_info.value.code).startswith(f"error: reward 'user_rewards:{name}' {says}")
    assert "train.py" not in capsys.readouterr().err  # the reward's traceback alone, if any
    assert torch.load(out / "grpo" / "checkpoint" / "state.pt", weights_only=False)["step"] == steps // 2
    monkeypatch.delenv("BREAK_AFTER")
    train.main(flags + ["--resume"])
    assert [r["step"] for r in read_jsonl(out / "grpo" / "metrics.jsonl")] == list(range(1, steps + 1))
    every = eval_every or steps  # 0: before and after
    evaluated = [r["step"] for r in read_jsonl(out / "grpo" / "evals.jsonl")]
    assert evaluated == [0, *range(every, steps + 1, every)]


@pytest.mark.parametrize("phase", ["sampling", "update"])
def test_out_of_device_memory_mid_run_is_one_line_saying_what_to_change_and_loses_no_finished_step(
        tmp_path, monkeypatch, phase):
    """A step runs out of device memory (a long prompt's prefill, say): the run ends in one line saying which
    flags to change, since --resume as it was would meet the same prompts at the same step (they follow from
    --seed and the step), and the same wall. Out of memory while sampling, the steps before it are saved;
    in the update, where the weights or AVSPO's state may have moved part-way, nothing more is saved."""
    calls = []

    def out_of_memory_at_step_3(real):  # GRPO: one sampling and one update a step
        def call(*args, **kwargs):
            calls.append(len(calls) + 1)
            if len(calls) == 3:
                raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 21.50 GiB")
            return real(*args, **kwargs)
        return call

    where = (run_module, "sample") if phase == "sampling" else (train, "update_policy")
    monkeypatch.setattr(*where, out_of_memory_at_step_3(getattr(*where)))
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "4", "--eval-every", "0", "--save-every", "10", "--out", str(tmp_path)])
    line = str(exit_info.value.code)
    assert line.startswith("error: out of device memory (CUDA out of memory. Tried to allocate 21.50 GiB)")
    assert "\n" not in line and "--max-prompt-tokens" in line and "--resume" in line
    assert ("the steps before it are saved" in line) == (phase == "sampling")
    state = tmp_path / "grpo" / "checkpoint" / "state.pt"
    if phase == "sampling":
        assert torch.load(state, weights_only=False)["step"] == 2
    else:  # --save-every 10: no checkpoint yet, and none made of weights the update may have moved
        assert not state.exists()


def test_virtual_rewards_follow_the_declared_range():
    """A group all at 1.0 is all-correct in 0..1 (virtual rewards below it: pushed up) but sits in the lower
    half of 0..5 (virtual rewards above it: pushed down)."""
    rewards = torch.tensor([[1.0, 1.0], [0.0, 1.0]])
    signs = []
    for reward_range in ((0.0, 1.0), (0.0, 5.0)):
        args = train.Args(algo="avspo", acr_threshold=0.0, reward_range=reward_range)
        signs.append(torch.sign(train.compute_advantages(args, rewards, train.algo_state(args), None)[0][0]))
    assert signs[0].tolist() == [1.0, 1.0] and signs[1].tolist() == [-1.0, -1.0]


# ---------------------------------------------------------------- the run folder


def hold_the_folder(folder: Path) -> subprocess.Popen:
    """Another process that owns `folder` until killed."""
    code = ("import sys, time; from pathlib import Path; from infra.written import owned\n"
            f"with owned(Path({str(folder)!r}), 'runs'):\n    print('held', flush=True); time.sleep(120)")
    holder = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    return holder


def test_a_second_run_into_a_folder_in_use_is_refused(tmp_path, monkeypatch):
    holder = hold_the_folder(tmp_path / "run")
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    try:
        with pytest.raises(SystemExit) as exit_info:
            train.main(TINY + ["--steps", "2", "--out", str(tmp_path / "run")])
    finally:
        holder.kill()
        holder.wait()
    assert exit_info.value.code == (f"error: {tmp_path / 'run'} is in use by process {holder.pid} (another "
                                    "run): wait for it to end, or choose another folder")
    assert list((tmp_path / "run").iterdir()) == []  # the holder wrote nothing yet, the refused run nothing
    monkeypatch.undo()
    train.main(TINY + ["--steps", "1", "--out", str(tmp_path / "run")])  # the lock died with its process


@pytest.mark.parametrize("out", ["a-file", "a-file/run"])
def test_an_out_that_is_a_file_is_one_line(tmp_path, capsys, out):
    (tmp_path / "a-file").write_text("keep me")
    with pytest.raises(SystemExit):
        train.main(TINY + ["--out", str(tmp_path / out)])
    last_line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"{tmp_path / 'a-file'} is a file, not a folder" in last_line
    assert (tmp_path / "a-file").read_text() == "keep me"


def test_resume_under_other_flags_is_refused_naming_each(tmp_path, capsys, monkeypatch):
    train.main(TINY + ["--steps", "2", "--out", str(tmp_path)])
    before = (tmp_path / "grpo" / "metrics.jsonl").read_text()
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "3", "--group-size", "2", "--lr", "1e-3", "--out", str(tmp_path),
                           "--resume"])
    line = str(exit_info.value.code)  # judged by the folder's owner, after the lock
    assert "--steps 2 -> 3; --group-size 4 -> 2; --lr 2e-05 -> 0.001, unlike its config.json" in line
    assert (tmp_path / "grpo" / "metrics.jsonl").read_text() == before


def test_resume_may_change_bookkeeping_and_extend_a_constant_lr_run(tmp_path):
    base = TINY + ["--out", str(tmp_path), "--lr-decay", "0", "--eval-every", "0"]
    train.main(base + ["--steps", "2"])
    train.main(base + ["--steps", "4", "--resume", "--save-every", "1", "--micro-batch", "2"])
    assert [r["step"] for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")] == [1, 2, 3, 4]
    asked = dataclasses.replace(run_config(tmp_path / "grpo"), lr_decay=1.0, steps=5)
    assert run_folder.resume_conflicts(tmp_path / "grpo", asked).count("->") == 2  # lr decaying: --steps counts


def test_a_flag_newer_than_the_run_counts_as_its_default(tmp_path):
    train.main(TINY + ["--steps", "1", "--out", str(tmp_path)])
    config = json.loads((tmp_path / "grpo" / "config.json").read_text())
    del config["virtual_ends"]  # a run made before the flag existed
    (tmp_path / "grpo" / "config.json").write_text(json.dumps(config))
    assert run_folder.resume_conflicts(tmp_path / "grpo", run_config(tmp_path / "grpo")) is None


# ---------------------------------------------------------------- killed at random moments


@pytest.mark.parametrize("lora", [[], ["--lora-rank", "2"]], ids=["full", "lora"])
def test_sigkill_at_random_moments_then_resume_loses_and_doubles_no_step(tmp_path, lora, monkeypatch):
    """A --save-every 1 run killed (SIGKILL) three times at random moments once it has logged a step, then
    resumed to the end: every step logged once, in order, and the last checkpoint loads (under LoRA: its
    adapters, with the base). Killed before its first checkpoint, it has nothing to resume from: it starts
    again (--resume would refuse it). Each killed run is a process forked from a small one that imported
    train.py (`small_processes`), so that its start costs no import."""
    (tmp_path / "user_rewards.py").write_text(REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))  # user_rewards importable, here and in the runs' processes
    run = tmp_path / "run"
    argv = [*TINY, "--steps", "40", "--save-every", "1", "--eval-every", "0", "--out", str(run),
            "--reward", "user_rewards:parity", *lora]
    draw = random.Random(0)
    for _ in range(3):
        how = "--resume" if run_folder.find_checkpoint(run / "grpo") else "--overwrite"
        child = small_processes().Process(target=quiet_main, args=(argv + [how], sys.path))
        child.start()
        done_before = len(read_jsonl(run / "grpo" / "metrics.jsonl"))
        deadline = time.monotonic() + 60
        while (len(read_jsonl(run / "grpo" / "metrics.jsonl")) <= done_before and child.is_alive()
               and time.monotonic() < deadline):
            time.sleep(0.05)
        time.sleep(draw.uniform(0.0, 0.5))
        child.kill()
        child.join()
    train.main(argv + ["--resume"])
    assert [r["step"] for r in read_jsonl(run / "grpo" / "metrics.jsonl")] == list(range(1, 41))
    assert torch.load(run / "grpo" / "checkpoint" / "state.pt", weights_only=False)["step"] == 40
    assert has_adapters(load_model(str(run / "grpo" / "checkpoint"), torch.device("cpu"))[0]) == bool(lora)


def quiet_main(argv: list[str], path: list[str]) -> None:
    """train.main(argv) with this sys.path, its output to /dev/null: a run to be killed."""
    sys.path[:] = path
    with open(os.devnull, "w") as null, contextlib.redirect_stdout(null), contextlib.redirect_stderr(null):
        train.main(argv)


# ---------------------------------------------------------------- a second run, damage, signals (issue 44)


def test_a_second_run_into_a_run_folder_is_refused_saying_what_to_type(tmp_path, monkeypatch):
    out = tmp_path / "run"
    train.main(TINY + ["--steps", "1", "--save-every", "1", "--out", str(out)])
    before = (out / "grpo" / "metrics.jsonl").read_text()
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--steps", "1", "--out", str(out)])
    assert exit_info.value.code == (f"error: {out / 'grpo'} holds an earlier run (steps logged: 1): add "
                                    f"--resume to continue it, --out {out}-2 to keep it and start another, "
                                    "or --overwrite to replace it")
    assert (out / "grpo" / "metrics.jsonl").read_text() == before
    monkeypatch.undo()
    train.main(TINY + ["--steps", "1", "--save-every", "0", "--seed", "1", "--out", str(out), "--overwrite"])
    assert not (out / "grpo" / "checkpoint").exists()  # the replaced run's checkpoint is gone with its logs
    assert json.loads((out / "grpo" / "config.json").read_text())["seed"] == 1


@pytest.mark.parametrize("torn", ["last", "first"])
def test_a_log_line_torn_by_hand_is_one_line_and_left_as_it_is(tmp_path, torn):
    """A log a run wrote, changed since (before issue 54, a torn last line was dropped and its step redone,
    a bad line before it named): the file is no longer the run's, and --resume refuses it in one line."""
    flags = TINY + ["--lr-decay", "0", "--save-every", "1", "--eval-every", "0", "--out", str(tmp_path)]
    train.main(flags + ["--steps", "1"])
    metrics = tmp_path / "grpo" / "metrics.jsonl"
    if torn == "last":
        with metrics.open("a") as f:
            f.write('{"step": 2, "reward_me')
    else:
        metrics.write_text("{torn\n" + metrics.read_text())
    changed = metrics.read_text()
    with pytest.raises(SystemExit) as exit_info:
        train.main(flags + ["--steps", "2", "--resume"])
    assert str(exit_info.value.code).startswith(f"error: {metrics} is changed since a script wrote it")
    assert metrics.read_text() == changed


def test_read_jsonl_drops_a_torn_last_line_and_names_a_bad_one_before_it(tmp_path, capsys):
    log = tmp_path / "metrics.jsonl"
    log.write_text('{"step": 1}\n{"step": 2, "reward_me')
    assert read_jsonl(log) == [{"step": 1}]
    assert f"warning: {log}:2: a torn last line, dropped" in capsys.readouterr().err
    log.write_text('{torn\n{"step": 1}\n')
    with pytest.raises(run_folder.RunFolderError, match=f"{log}:1: not a JSON record"):
        read_jsonl(log)


def damage(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


@pytest.mark.parametrize("file", ["model/model.safetensors", "state.pt"])
def test_a_damaged_checkpoint_is_one_line_naming_the_file(tmp_path, capsys, file):
    flags = TINY + ["--steps", "1", "--eval-every", "0", "--out", str(tmp_path)]
    train.main(flags)
    checkpoint, logs = tmp_path / "grpo" / "checkpoint", (tmp_path / "grpo" / "metrics.jsonl").read_text()
    damage(checkpoint / file)
    with pytest.raises(SystemExit) as exit_info:
        train.main(flags + ["--resume"])
    line = str(exit_info.value.code)
    assert line.startswith("error: ") and f"{checkpoint / file}" in line and "damaged" in line, line
    assert "\n" not in line and "Traceback" not in capsys.readouterr().err
    assert (tmp_path / "grpo" / "metrics.jsonl").read_text() == logs  # nothing lost
    if file == "model/model.safetensors":
        with pytest.raises(SystemExit) as exit_info:
            eval_main(["--model", str(checkpoint), "--limit", "1", "--max-new-tokens", "2"])
        assert f"{checkpoint / file} is damaged" in str(exit_info.value.code)


def test_a_planted_pickle_in_state_pt_is_refused_and_runs_nothing(tmp_path):
    flags = TINY + ["--steps", "1", "--eval-every", "0", "--out", str(tmp_path)]
    train.main(flags)
    state, ran = tmp_path / "grpo" / "checkpoint" / "state.pt", tmp_path / "the-planted-code-ran"
    torch.save({"step": 1, "optimizer": Planted(str(ran)), "algo_state": {}}, state)
    with pytest.raises(SystemExit) as exit_info:  # a changed checkpoint is not the run's (issue 54)
        train.main(flags + ["--resume"])
    assert exit_info.value.code.startswith(f"error: {state.parent} is changed since a script wrote it")
    with pytest.raises(run_folder.RunFolderError) as refused:  # and loading it never runs its code
        run_folder.restore_checkpoint(state.parent, torch.optim.SGD([torch.zeros(1)], lr=1), {})
    assert str(refused.value) == (f"{state}: refused, it holds objects other than tensors and plain data, "
                                  "which could run code (train.py never saves such a file)")
    assert not ran.exists()


class Planted:
    """Unpickled, it creates a file: code run by loading."""

    def __init__(self, path: str):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def test_avspo_state_resumes_under_weights_only(tmp_path):
    flags = TINY + ["--algo", "avspo", "--lr-decay", "0", "--eval-every", "0", "--out", str(tmp_path)]
    train.main(flags + ["--steps", "1"])
    train.main(flags + ["--steps", "2", "--resume"])  # the optimizer and AdaptiveThreshold load as plain data
    assert [r["step"] for r in read_jsonl(tmp_path / "avspo" / "metrics.jsonl")] == [1, 2]


@pytest.mark.parametrize("value", [np.bool_(True), np.float32(0.5), np.int64(1), np.array(0.25),
                                   torch.tensor(1.0), torch.tensor(True),
                                   torch.tensor(0.5, dtype=torch.bfloat16)])
def test_every_real_number_type_is_a_reward(value):
    """Made a float at the call, in the run's process (tests/test_reward_worker.py: in a reward's own)."""
    reward = checked(per_completion(lambda c, g: value, "user:fn"), "user:fn", (0.0, 1.0))
    rewards = reward(["q"], ["c"], ["g"])
    assert rewards == [float(value)] and type(rewards[0]) is float


def test_a_tensor_of_several_numbers_is_no_reward():
    with pytest.raises(RewardError, match="a Tensor, not a number"):
        checked(per_completion(lambda c, g: torch.tensor([1.0]), "user:fn"), "user:fn", (0.0, 1.0))(
            ["q"], ["c"], ["g"])


def test_a_trl_none_scores_0_with_one_warning_a_run(rewards, capfd):
    reward = load_reward("user_rewards:trl_none")
    assert reward(["q", "q"], ["a", "b"], ["g", "g"]) == [0.0, 0.0]
    assert reward(["q"], ["a"], ["g"]) == [0.0]
    assert capfd.readouterr().err.splitlines() == [
        "warning: reward 'user_rewards:trl_none' returned None for 2 of 2 completions: they score 0 (warned "
        "once per run)"]


def wait_for_lines(path: Path, lines: int, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + 240
    while len(read_jsonl(path)) < lines and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.1)


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_saves_the_last_step_prints_one_line_and_exits_128_plus_it(tmp_path, signum):
    """Ctrl-C or SIGTERM at a random moment of a step: while it samples or trains, the step ends and is saved;
    while its rewards are computed, it is dropped and the one before is saved. Either way, one line says
    which step is saved, and the code is 130 or 143."""
    cmd = [sys.executable, "train.py", *TINY, "--steps", "1000", "--eval-every", "0", "--out", str(tmp_path)]
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    metrics = tmp_path / "grpo" / "metrics.jsonl"
    wait_for_lines(metrics, 2, proc)
    proc.send_signal(signum)
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signum, err[-2000:]
    assert "Traceback" not in err and "KeyboardInterrupt" not in err, err[-2000:]
    said = re.fullmatch(r"\[grpo\] interrupted(?P<scoring> while scoring step \d+ \(dropped\))?: step "
                        r"(?P<step>\d+) saved in .+; continue with --resume", out.strip().splitlines()[-1])
    assert said, out[-2000:]
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[signum]
    assert (f"{name}: stopping at the end of the step under way" in err) == (said["scoring"] is None)
    saved = torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=True)["step"]
    assert saved == int(said["step"]) >= 2 and saved == len(read_jsonl(metrics))


def test_a_stopped_run_says_what_it_saved_even_when_nothing():
    saving, not_saving = (types.SimpleNamespace(algo="grpo", save_every=n) for n in (10, 0))
    assert run_folder.stopped_line(saving, Path("r"), 1, while_scoring=True) == (
        "[grpo] interrupted while scoring step 1 (dropped): no step ended, nothing to resume")
    assert run_folder.stopped_line(not_saving, Path("r"), 3) == (
        "[grpo] interrupted after step 3: --save-every 0, no checkpoint")


def test_ctrl_c_to_experiments_ends_its_workers_each_saved_in_one_line(tmp_path):
    """Two runs of 1000 steps in two pool workers, a third queued; Ctrl-C as a terminal sends it (SIGINT to
    the process group, workers included): each run saves its step and ends (no orphan goes on logging), the
    third never starts (though the pool has handed it to a worker already), and experiments.py says so in one
    line and exits 130. Each run gets one signal, experiments.py's SIGTERM, not the terminal's too: two would
    stop it unsaved. (SIGINT or SIGTERM to experiments.py alone: the same path, tests/test_experiments.py.)"""
    cmd = [sys.executable, "experiments.py", "--quick", "--only", "compare", "--methods", "grpo,avspo,dapo",
           "--seeds", "0", "--jobs", "2", "--steps", "1000", "--eval-every", "1000", "--out", str(tmp_path),
           "--figures", str(tmp_path / "figures")]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)  # its own group: the test can end every worker
    runs = [tmp_path / "compare" / f"seed0-{m}" / m for m in ("grpo", "avspo")]
    try:
        for run in runs:
            wait_for_lines(run / "metrics.jsonl", 1, proc)
        os.killpg(proc.pid, signal.SIGINT)
        err = proc.communicate(timeout=180)[1]
    finally:  # nothing left behind if the test failed (it passed: the group is gone already)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 130, err[-2000:]
    assert "Traceback" not in err and err.strip().splitlines()[-1] == (
        "experiments.py: stopped by Ctrl-C: no run started after it, and each run under way kept its last "
        "saved step; the same command goes on from there"), err[-2000:]
    logged = [len(read_jsonl(run / "metrics.jsonl")) for run in runs]
    time.sleep(2)
    assert [len(read_jsonl(run / "metrics.jsonl")) for run in runs] == logged  # no worker goes on
    for run, steps in zip(runs, logged):
        assert 1 <= steps < 1000  # stopped, not run to the end
        assert torch.load(run / "checkpoint" / "state.pt", weights_only=True)["step"] == steps
    assert not (tmp_path / "compare" / "seed0-dapo").exists()


def test_a_bad_reward_on_one_torchrun_process_ends_every_process_with_its_line(tmp_path):
    (tmp_path / "user_rewards.py").write_text(REWARDS + RANK_1_FAILS)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2", "train.py",
           *TINY, "--steps", "2", "--eval-every", "0", "--reward", "user_rewards:rank_1_fails", "--out",
           str(tmp_path / "run")]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(tmp_path)}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)  # no hang
    assert proc.returncode != 0
    line = "error: reward 'user_rewards:rank_1_fails' returned nan for completion 0 of the batch"
    assert proc.stderr.count(line) == 2, proc.stderr[-3000:]  # each process ends with it
    assert "]: Traceback" not in proc.stderr, proc.stderr[-3000:]  # no process's traceback


RANK_1_FAILS = '''
def rank_1_fails(completion, gold):
    import os
    return float("nan") if os.environ["RANK"] == "1" else 0.0
'''


def test_resume_without_a_run_says_so_and_starts_at_step_0(tmp_path, capsys):
    train.main(TINY + ["--steps", "1", "--eval-every", "0", "--out", str(tmp_path), "--resume"])
    assert f"[grpo] --resume: no run in {tmp_path / 'grpo'} yet, starting one" in capsys.readouterr().out
    assert [r["step"] for r in read_jsonl(tmp_path / "grpo" / "metrics.jsonl")] == [1]


class TinySaver:
    """What save_checkpoint needs of a model and a tokenizer: a one-tensor safetensors file, a json file."""

    def save_pretrained(self, path: Path) -> None:
        path.mkdir(exist_ok=True)
        if isinstance(self, TinyTokenizer):
            (path / "tokenizer.json").write_text("{}")
        else:
            save_file({"w": torch.zeros(4)}, str(path / "model.safetensors"))


class TinyTokenizer(TinySaver):
    pass


FOLDER_CHANGES = ("open", "replace", "rename", "unlink", "rmdir", "mkdir")  # os calls that change a folder


def killed_at(n: int) -> None:
    """From now on, this process dies (os._exit, as SIGKILL would leave it) at the n-th moment before or
    after an os call that changes a folder: every moment at which a save can be stopped."""
    moments = iter(range(10**9))
    for name in FOLDER_CHANGES:
        def wrapped(*args, call=getattr(os, name), name=name, **kwargs):
            if name == "open" and not args[1] & (os.O_WRONLY | os.O_RDWR | os.O_CREAT):
                return call(*args, **kwargs)  # a read changes nothing: no moment to stop at
            if next(moments) == n:
                os._exit(0)
            result = call(*args, **kwargs)
            if next(moments) == n:
                os._exit(0)
            return result
        setattr(os, name, wrapped)


def small_processes() -> multiprocessing.context.BaseContext:
    """Processes forked from multiprocessing's fork server, a small process that imported the program once:
    a kill test forks once per moment, and a fork of this pytest process (gigabytes once the suite has loaded
    its models) costs a tenth of a second or more, a fork of the small one milliseconds."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["experiments", "eval", "merge"])  # before its start only: always the same
    # Started from the checkout: Python 3.11's fork server imports them from its own folder (it ignores the
    # sys.path it is given), and each test runs in its tmp_path, where the imports failed silently and every
    # fork imported the program again (seconds each). A fork goes back to its parent's folder.
    with contextlib.chdir(ROOT):
        forkserver.ensure_running()
    return context


def in_a_small_process(body, *args) -> None:
    """body(*args), a module's function, in a small process (`small_processes`); what it raises is raised
    here, with its traceback."""
    with ProcessPoolExecutor(max_workers=1, mp_context=small_processes()) as pool:
        pool.submit(body, *args).result()


def test_a_save_killed_at_every_moment_leaves_a_whole_checkpoint_and_the_next_saves_succeed(tmp_path):
    """A checkpoint save killed before or after each os call that changes the run folder, once per moment
    (forked from a small process): the next owner finds a whole checkpoint, of the step before or of the step
    saved, and its own next two saves succeed and leave checkpoint/ alone. A record listing a name removed
    just before the kill once made the next save refuse to rename onto checkpoint.old (CI, December 2026)."""
    in_a_small_process(save_killed_at_every_moment, tmp_path)


def save_killed_at_every_moment(tmp_path: Path) -> None:
    weights = torch.nn.Parameter(torch.zeros(2))
    optimizer = torch.optim.SGD([weights], lr=0.1)
    model, tokenizer = TinySaver(), TinyTokenizer()
    for n in range(10**4):
        path = tmp_path / str(n)
        with owned(path, "run") as folder:
            for step in (1, 2):
                run_folder.save_checkpoint(folder, model, tokenizer, optimizer, step, {})
        if (pid := os.fork()) == 0:
            with owned(path, "run") as folder:
                killed_at(n)
                run_folder.save_checkpoint(folder, model, tokenizer, optimizer, 3, {})
            os._exit(3)  # the save ended: n is past its last moment
        ended = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        with owned(path, "run") as folder:
            folder.remove_temporaries()
            kept = run_folder.find_checkpoint(path)
            assert kept and run_folder.restore_checkpoint(kept, optimizer, {}) in (2, 3), f"killed at {n}"
            for step in (4, 5):
                run_folder.save_checkpoint(folder, model, tokenizer, optimizer, step, {})
        assert sorted(p.name for p in path.iterdir()) == [RECORD, "checkpoint"], f"killed at {n}"
        assert run_folder.restore_checkpoint(path / "checkpoint", optimizer, {}) == 5
        if ended == 3:
            break
    assert n > 40  # every moment of a save was reached: the save makes more changes than this

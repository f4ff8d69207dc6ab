"""A reward in a process of its own (verifier.RewardWorker) keeps to its own calls and processes: an answer
to another call is never taken for this one, whatever the reward forks or starts ends with it (at the time
limit, at the run's end, when the run is SIGKILLed), even in a session of its own, and a reward module that
does not import, or hangs while it imports until the import's limit, Ctrl-C or SIGTERM, ends train.py in one
line (issues 54, 61). What it returns crosses as a float."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

import verifier
from test_faults import ROOT, TINY
from test_nothing_lost import alive, fails_after, python_run
from verifier import RewardError, RewardWorker, load_reward

WORKER_REWARDS = '''
import os, subprocess, sys, time
from pathlib import Path

def parity(completion, gold):
    return float(len(completion) % 2)

def forks(completion, gold):
    """A careless reward: its child returns too (no os._exit), and would answer before the parent."""
    child = os.fork()
    if child == 0:
        return 0.5
    os.waitpid(child, 0)
    return 1.0

def exits(completion, gold):
    os._exit(3)

def spawns(completion, gold):
    """"spawn": starts a helper that would live an hour, its pid in the file $HELPER ("escape": in a session
    of its own, which no process group reaches); "hang": hangs."""
    if "spawn" in completion or "escape" in completion:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                                  start_new_session="escape" in completion)
        Path(os.environ["HELPER"] + ".tmp").write_text(str(helper.pid))
        os.replace(os.environ["HELPER"] + ".tmp", os.environ["HELPER"])  # the test reads a whole pid
    if "hang" in completion:
        time.sleep(3600)
    return 1.0

def value(completion, gold):
    import numpy, torch
    return {"tensor": torch.tensor(0.5), "bf16": torch.tensor(0.25, dtype=torch.bfloat16),
            "numpy": numpy.float32(0.75), "bool": True, "int64": numpy.int64(1),
            "several": torch.tensor([1.0, 0.0])}[completion]

def trl_tensor(prompts, completions, **kwargs):
    import torch
    return torch.full((len(completions),), 0.5)
'''


@pytest.fixture()
def worker_rewards(tmp_path, monkeypatch):
    """The module worker_rewards importable; yields the file where the pid of the helper it starts appears
    (the helper is killed after the test, should it have outlived its reward)."""
    (tmp_path / "worker_rewards.py").write_text(WORKER_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("HELPER", str(tmp_path / "helper.pid"))
    yield tmp_path / "helper.pid"
    with contextlib.suppress(FileNotFoundError, ProcessLookupError):
        os.kill(int((tmp_path / "helper.pid").read_text()), signal.SIGKILL)


def ends_soon(pid: int) -> bool:
    deadline = time.monotonic() + 30
    while alive(pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    return not alive(pid)


def test_an_answer_to_another_call_is_never_taken_for_this_one(worker_rewards):
    """A call abandoned at its time limit, or a process the reward forked, could leave an answer in the
    socket: the next call takes its own answer, not that one."""
    worker = RewardWorker("worker_rewards:parity", 60.0, one_by_one=True)
    worker.start()
    worker.channel.send((0, ["q"], ["odd"], ["g"]))  # answered, but no call waits for it: a stray
    assert worker(["q"], ["even"], ["g"]) == [0.0]
    worker.stop()


def test_a_reward_that_forks_answers_each_call_once_with_its_own_value(worker_rewards):
    worker = RewardWorker("worker_rewards:forks", 60.0, one_by_one=True)
    assert worker(["q", "q"], ["a", "b"], ["g", "g"]) == [1.0, 1.0]
    worker.stop()


def test_a_reward_that_ends_its_process_is_one_line_with_the_exit_code(worker_rewards):
    worker = RewardWorker("worker_rewards:exits", 60.0, one_by_one=True)
    with pytest.raises(RewardError, match=r"'worker_rewards:exits': its process ended \(exit code 3\)"):
        worker(["q"], ["a"], ["g"])


@pytest.mark.parametrize("start", ["spawn", "escape"])
def test_the_time_limit_ends_what_the_reward_started(worker_rewards, start):
    worker = RewardWorker("worker_rewards:spawns", 600.0, one_by_one=True)
    assert worker(["q"], [start], ["g"]) == [1.0]
    worker.time_limit = 1.0
    assert worker(["q"], ["hang"], ["g"]) == [0.0]  # killed at the limit, its group with it
    assert ends_soon(int(worker_rewards.read_text())), "the reward's helper outlived its time limit"


@pytest.mark.parametrize("end, start", [("returns", "spawn"), ("SIGKILL", "spawn"), ("SIGKILL", "escape")])
def test_what_the_reward_started_ends_with_the_run(worker_rewards, tmp_path, end, start):
    """A process scores one completion, as a run does, and either ends (its finalizer) or is SIGKILLed while
    the reward hangs (no finalizer runs): the helper the reward started ends either way, even one in a
    session of its own."""
    completion = start if end == "returns" else f"{start}, hang"
    code = ("from verifier import load_reward\n"
            f"print(load_reward('worker_rewards:spawns', time_limit=600)(['q'], [{completion!r}], ['g']))")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(tmp_path), str(ROOT)])}
    run = subprocess.Popen([sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True)
    try:
        if end == "SIGKILL":
            deadline = time.monotonic() + 240
            while not worker_rewards.exists() and run.poll() is None and time.monotonic() < deadline:
                time.sleep(0.1)
            run.kill()
        out = run.communicate(timeout=120)[0]
    finally:
        run.kill()
    assert out.strip() == ("[1.0]" if end == "returns" else "")
    assert ends_soon(int(worker_rewards.read_text())), "the reward's helper outlived its run"


BAD_MODULES = {
    "syntax": ("def fn(completion, gold):\n    return (\n", "SyntaxError: '(' was never closed", ":2: "),
    "name": ("import os\nTHRESHOLD = undefined_name\n", "NameError: name 'undefined_name' is not defined",
             ":2: "),
}


@pytest.mark.parametrize("kind", BAD_MODULES)
def test_a_reward_module_that_does_not_import_is_one_line_exit_2(tmp_path, kind):
    source, says, line = BAD_MODULES[kind]
    (tmp_path / "mymod.py").write_text(source)
    run = python_run(TINY + ["--reward", "mymod:fn", "--out", str(tmp_path / "run")], tmp_path)
    err = run.communicate(timeout=240)[1]
    assert run.returncode == 2 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "'mymod'" in last and says in last and f"{tmp_path / 'mymod.py'}{line}" in last, last


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_a_reward_module_imports_is_one_line_exit_128_plus_it(tmp_path, signum):
    (tmp_path / "mymod.py").write_text("import os, time\nfrom pathlib import Path\n\n"
                                       "Path(os.environ['IMPORTING']).touch()\ntime.sleep(3600)\n")
    importing = tmp_path / "importing"
    run = python_run(TINY + ["--reward", "mymod:fn", "--out", str(tmp_path / "run")], tmp_path,
                     IMPORTING=str(importing))
    try:
        deadline = time.monotonic() + 240
        while not importing.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        run.send_signal(signum)
        err = run.communicate(timeout=60)[1]
    finally:
        run.kill()
    assert run.returncode == 128 + signum and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[signum]
    assert f"interrupted ({name}) while importing the reward module 'mymod'" in last, last  # and where it was


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_the_reward_s_process_imports_it_stops_at_once_in_one_line(tmp_path, signum):
    """The run's own import returned; its reward's process waits at import for a lock the run's import took.
    One Ctrl-C there (the first evaluation: train.py's handler only asks its loop to stop) ends the run at
    once in one line, not after the import's 60 s limit."""
    (tmp_path / "locked.py").write_text("import os, time\nfrom pathlib import Path\n\n"
                                        "lock = Path(os.environ['LOCK'])\nif lock.exists():\n"
                                        "    Path(f'{lock}.waiting').touch()\n    time.sleep(3600)\n"
                                        "lock.touch()\n\ndef fn(c, g):\n    return 1.0\n")
    waiting = tmp_path / "lock.waiting"
    run = python_run(TINY + ["--reward", "locked:fn", "--out", str(tmp_path / "run")], tmp_path,
                     LOCK=str(tmp_path / "lock"))
    try:
        deadline = time.monotonic() + 240
        while not waiting.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        sent = time.monotonic()
        run.send_signal(signum)
        err = run.communicate(timeout=60)[1]
        took = time.monotonic() - sent
    finally:
        run.kill()
    assert waiting.exists() and took < 10 and "Traceback" not in err, (took, err[-2000:])
    name = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}[signum]
    assert err.strip().splitlines()[-1] == (f"error: reward 'locked:fn': interrupted ({name}) while its "
                                            "process imported it: does its import hang?")


@pytest.mark.parametrize("time_limit", [0, 60], ids=["in-process", "own-process"])
def test_what_a_reward_returns_is_a_float_where_it_returns_it(worker_rewards, time_limit):
    """A 0-d tensor (any dtype), a numpy scalar, a bool: a float before it leaves the reward's process, which
    a tensor could not (torch sends it as shared memory, refused by the pipe); a tensor of several numbers is
    refused in one line, on either path (issue 61)."""
    kinds = ["tensor", "bf16", "numpy", "bool", "int64"]
    reward = load_reward("worker_rewards:value", time_limit=time_limit)
    rewards = reward(["q"] * 5, kinds, ["g"] * 5)
    assert rewards == [0.5, 0.25, 0.75, 1.0, 1.0] and {type(r) for r in rewards} == {float}
    with pytest.raises(RewardError, match=r"returned tensor\(\[1\., 0\.\]\), a Tensor, not a number, for "
                                          "completion 0 of the batch, 'several'"):
        reward(["q"], ["several"], ["g"])
    trl = load_reward("worker_rewards:trl_tensor", time_limit=time_limit)
    rewards = trl(["q"] * 2, ["a", "b"], ["g"] * 2)
    assert rewards == [0.5, 0.5] and {type(r) for r in rewards} == {float}


def test_a_reward_whose_import_hangs_in_its_process_ends_at_the_import_s_limit(tmp_path, monkeypatch):
    """The run imported the module already (a bad spec fails there); its process may still hang importing it
    (a lock, a service): past the limit, one line, and the process is gone."""
    (tmp_path / "hangs_there.py").write_text("import time\ntime.sleep(3600)\ndef fn(c, g): return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setattr(verifier, "IMPORT_LIMIT", 1.0)
    worker = RewardWorker("hangs_there:fn", 0.5, one_by_one=True)
    says = r"'hangs_there:fn': its process had not imported it after 1 s \(the longer of --reward-timeout"
    with fails_after(60), pytest.raises(RewardError, match=says):
        worker(["q"], ["a"], ["g"])
    assert worker.process is None and not worker.end.alive  # ended and reaped

"""A reward in a process of its own (verifier.RewardWorker) keeps to its own calls and processes: an answer
to another call is never taken for this one, whatever the reward forks or starts ends with it (at the time
limit, at the run's end, when the run is SIGKILLed), and a reward module that does not import, or hangs while
it imports until Ctrl-C, ends train.py in one line (issue 54)."""

import contextlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from test_faults import ROOT, TINY
from test_nothing_lost import alive, python_run
from verifier import RewardError, RewardWorker

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
    """"spawn": starts a helper that would live an hour, its pid in the file $HELPER; "hang": hangs."""
    if "spawn" in completion:
        helper = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(3600)"],
                                  stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        Path(os.environ["HELPER"] + ".tmp").write_text(str(helper.pid))
        os.replace(os.environ["HELPER"] + ".tmp", os.environ["HELPER"])  # the test reads a whole pid
    if "hang" in completion:
        time.sleep(3600)
    return 1.0
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


def test_the_time_limit_ends_what_the_reward_started(worker_rewards):
    worker = RewardWorker("worker_rewards:spawns", 600.0, one_by_one=True)
    assert worker(["q"], ["spawn"], ["g"]) == [1.0]
    worker.time_limit = 1.0
    assert worker(["q"], ["hang"], ["g"]) == [0.0]  # killed at the limit, its group with it
    assert ends_soon(int(worker_rewards.read_text())), "the reward's helper outlived its time limit"


@pytest.mark.parametrize("end", ["returns", "SIGKILL"])
def test_what_the_reward_started_ends_with_the_run(worker_rewards, tmp_path, end):
    """A process scores one completion, as a run does, and either ends (its finalizer) or is SIGKILLed while
    the reward hangs (no finalizer runs): the helper the reward started ends either way."""
    completion = "spawn" if end == "returns" else "spawn, hang"
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


def test_ctrl_c_while_a_reward_module_imports_is_one_line_exit_130(tmp_path):
    (tmp_path / "mymod.py").write_text("import os, time\nfrom pathlib import Path\n\n"
                                       "Path(os.environ['IMPORTING']).touch()\ntime.sleep(3600)\n")
    importing = tmp_path / "importing"
    run = python_run(TINY + ["--reward", "mymod:fn", "--out", str(tmp_path / "run")], tmp_path,
                     IMPORTING=str(importing))
    try:
        deadline = time.monotonic() + 240
        while not importing.exists() and run.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        run.send_signal(signal.SIGINT)
        err = run.communicate(timeout=60)[1]
    finally:
        run.kill()
    assert run.returncode == 130 and "Traceback" not in err, err[-2000:]
    last = err.strip().splitlines()[-1]
    assert "Ctrl-C" in last and "'mymod'" in last, last  # and where it was: in mymod.py, or in what it called

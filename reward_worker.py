"""A reward computed in a child process, so that a call past its time limit is stopped wherever it is stuck.

A user's reward (module:function) and math-verify may hang: sympy on a huge power, a regex that backtracks, a
service that never answers. SIGALRM only interrupts Python bytecode in the main thread, and a thread cannot be
stopped at all (one stuck in C code even holds the GIL), so the reward runs in a process of its own: the run
waits for each call at most `time_limit` seconds, then kills the process, scores that call's completions 0 and
starts another. verifier.verify, pure Python with bounded work, runs in the run's own process.

The two processes talk over the child's stdin and stdout, one pickle a message (the user's own prints go to
stderr): first (sys.path, spec), answered by "ready"; then each call's (questions, completions, golds),
answered by ("ok", rewards) or ("raised", the exception in one line, its traceback printed by the child).
"""

import os
import pickle
import select
import signal
import subprocess
import sys
import traceback
import weakref
from collections import Counter

from verifier import RewardError, _batch_reward


class RewardWorker:
    """The batch reward of `spec` (`verifier.load_reward`), each call run in the child process with a time
    limit. `one_by_one`: an f(completion, gold) is called, and timed, once per completion; a TRL-style
    function once per batch. A call past the limit scores 0, with a warning the first time, and adds its
    completions to counts["reward_timeouts"]."""

    def __init__(self, spec: str, time_limit: float, one_by_one: bool, counts: Counter | None = None):
        self.spec, self.time_limit, self.one_by_one = spec, time_limit, one_by_one
        self.counts = Counter() if counts is None else counts
        self.process: subprocess.Popen | None = None
        self.warned = False

    def __call__(self, questions: list[str], completions: list[str], golds: list[str]) -> list:
        if not self.one_by_one:
            return self.call(questions, completions, golds)
        return [reward for question, completion, gold in zip(questions, completions, golds)
                for reward in self.call([question], [completion], [gold])]

    def call(self, questions: list[str], completions: list[str], golds: list[str]) -> list:
        """One call of the reward in the child: its rewards, or 0 for each completion past the time limit."""
        if self.process is None:
            self.start()
        self.send((questions, completions, golds))
        if not select.select([self.process.stdout], [], [], self.time_limit)[0]:
            self.stop()  # stuck: the next call starts a fresh process
            self.counts["reward_timeouts"] += len(completions)
            if not self.warned:
                self.warned = True
                print(f"warning: reward {self.spec!r} took over {self.time_limit:g} s (--reward-timeout) on "
                      f"{completions[0][:60]!r}: scored 0, and so is every call past the limit (counted as "
                      "reward_timeouts in metrics.jsonl; warned once)", file=sys.stderr)
            return [0.0] * len(completions)
        status, value = self.receive()
        if status == "raised":
            what = repr(completions[0][:60]) if self.one_by_one else f"a batch of {len(completions)} completions"
            raise RewardError(f"reward {self.spec!r} raised {value} on {what} of problem "
                              f"{questions[0][:60]!r} (its traceback above)")
        return value

    def start(self) -> None:
        """The child, ready to take calls once it has imported the reward (not timed: a slow import is no
        hang; a bad spec was refused before any model loaded)."""
        self.process = subprocess.Popen([sys.executable, __file__], stdin=subprocess.PIPE,
                                        stdout=subprocess.PIPE)
        weakref.finalize(self, self.process.kill)  # never outlives the run, however the run ends
        self.send((sys.path, self.spec))
        self.receive()

    def stop(self) -> None:
        self.process.kill()
        self.process.wait()
        self.process = None

    def send(self, message) -> None:
        pickle.dump(message, self.process.stdin)
        self.process.stdin.flush()

    def receive(self):
        try:
            return pickle.load(self.process.stdout)
        except EOFError:  # the child died: os._exit, a crash in C code, killed from outside
            code = self.process.wait()
            self.process = None
            raise RewardError(f"reward {self.spec!r}: its process ended (exit code {code}) during a call")


def serve() -> None:
    """The child: build the reward, then answer calls until the run closes stdin."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the whole process group: the run decides
    channel = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # the reward's own prints go to stderr, not into the channel
    requests = sys.stdin.buffer
    sys.path[:], spec = pickle.load(requests)
    reward = _batch_reward(spec)[0]
    pickle.dump("ready", channel)
    channel.flush()
    while True:
        try:
            questions, completions, golds = pickle.load(requests)
        except EOFError:  # the run has ended
            return
        try:
            answer = ("ok", reward(questions, completions, golds))
        except Exception as e:  # the user's bug: its traceback here, one line for the run's error
            traceback.print_exc()
            answer = ("raised", f"{type(e).__name__}: {e}")
        pickle.dump(answer, channel)
        channel.flush()


if __name__ == "__main__":
    serve()

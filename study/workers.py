"""The study's runs side by side in worker processes (`run_all`), and how they stop: Ctrl-C or SIGTERM starts
no run after it, and the runs under way save their step."""

import multiprocessing
import os
import signal
import time
from concurrent.futures import ALL_COMPLETED, FIRST_EXCEPTION, ProcessPoolExecutor, wait
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from infra.hardware import pick_device
from loop.processes import STOP_SIGNALS, on_stop_signals


class Stopped(KeyboardInterrupt):
    """Ctrl-C or SIGTERM (`stop_handler`): no run starts after it, and the runs under way save their step."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS[signum])
        self.signum = signum

    def __reduce__(self):  # a worker's, sent to `run_all` (by default its name alone would be)
        return Stopped, (self.signum,)


def stop_handler() -> Callable:
    """A handler of Ctrl-C and SIGTERM (`main`, and a worker's task): the first raises Stopped at once
    (`run_all` passes it on to the workers, whose runs save their step); a later one raises nothing, and ends
    this process's workers at once (SIGKILL: each keeps its last checkpoint), so that nothing waits on a
    worker that cannot stop. Never twice: a second Stopped could escape the code that tells the workers (two
    signals sent together run their handlers one after the other). Inside train.main, train.py's own handler
    ends the step under way and saves it instead."""
    received: list[int] = []

    def on_signal(signum: int, frame) -> None:
        received.append(signum)
        if len(received) == 1:
            raise Stopped(signum)
        signal_all(multiprocessing.active_children(), signal.SIGKILL)

    return on_signal


class Progress:
    """The study's progress, a line as each of its runs ends (train.py's bar shows the run's own): how many of
    the runs it had left to train are done, and the minutes left by the plan, `planned` (each run's folder ->
    its seconds, `plan.run_seconds`), `parallel` runs at once."""

    def __init__(self, planned: dict[Path, float], parallel: int):
        self.left, self.total, self.parallel = dict(planned), len(planned), parallel
        self.start = time.monotonic()

    def ran(self, run: tuple) -> None:
        """`run` (`runs.Run`) ended; one it had not planned (finished before the study) says nothing."""
        out, _, algo, _ = run
        if self.left.pop(out / algo, None) is None:
            return
        done, minutes = self.total - len(self.left), (time.monotonic() - self.start) / 60
        print(f"study: {done} of {self.total} runs done in {minutes:.1f} min, about "
              f"{sum(self.left.values()) / self.parallel / 60:.0f} min left by the plan", flush=True)


@dataclass
class Workers:
    """How a study's runs run: `jobs` at once (`run_all`), its `progress` said as each ends."""
    jobs: int
    progress: Progress | None = None

    def run(self, tasks: list[tuple]) -> list:
        return run_all(tasks, self.jobs, self.progress)


def run_all(tasks: list[tuple], jobs: int, progress: Progress | None = None) -> list:
    """fn(*args) for each task (fn, *args), in order; with jobs > 1 in that many processes that split the
    cores. A study's tasks are (fn, run, ...), a `runs.Run` second: `progress` says each run ended.

    Runs are small (16-64 rows): on 2 cores two 1-thread runs side by side did ~15% more work per second than
    one 2-thread run (measured). With CUDA devices, each worker has one of its own (`start_worker`). Spawned,
    not forked: a forked child inherits torch's thread pool in a bad state. After a failure, Ctrl-C or SIGTERM
    no run starts: the pool hands tasks to its workers ahead of time, which cancelling cannot take back, so
    the workers are told through `stopping` (`with_threads`).

    A stop reaches the workers from here alone, one SIGTERM each, on which a run saves its step and ends. A
    second signal would end it unsaved (train.py's rule), so the workers never see the terminal's Ctrl-C: they
    are spawned with SIGINT blocked, and every thread they start inherits the block. A second signal here ends
    them at once (`stop_handler`). Every wait here is awake to a signal (`wait_awake`)."""
    def said(task: tuple) -> None:
        if progress:
            progress.ran(task[1])

    if jobs == 1:
        results = []
        for task in tasks:
            results.append(task[0](*task[1:]))
            said(task)
        return results
    threads = max(1, (os.cpu_count() or 1) // jobs)
    spawn = multiprocessing.get_context("spawn")
    stopping, started = spawn.Event(), spawn.Value("i", 0)
    devices = torch.cuda.device_count() if torch.cuda.is_available() else 0  # a worker each (`start_worker`)
    with ProcessPoolExecutor(jobs, mp_context=spawn, initializer=start_worker,
                             initargs=(stopping, started, devices)) as pool:
        futures = []  # none yet, for a stop during `submit`
        try:
            unblocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})  # workers spawn in submit
            try:
                futures = [pool.submit(with_threads, threads, *task) for task in tasks]
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, unblocked)
            for future, task in zip(futures, tasks):  # one failed, stopped or never started: not done
                future.add_done_callback(lambda f, task=task: stopping.is_set() or f.cancelled()
                                         or f.exception() or said(task))
            wait_awake(futures, FIRST_EXCEPTION)
        except KeyboardInterrupt:  # Ctrl-C or SIGTERM (`stop_handler`), passed on
            stopping.set()
            signal_all(multiprocessing.active_children(), signal.SIGTERM)
            pool.shutdown(wait=False, cancel_futures=True)
            wait_awake(futures, ALL_COMPLETED)  # each run saves its step, or a second signal kills its worker
            raise
        if any(f.done() and f.exception() for f in futures):  # said now, not after every queued run
            stopping.set()
            pool.shutdown(cancel_futures=True)  # the runs under way end
        return [f.result() for f in futures]


def default_jobs(device: str) -> int:
    """--jobs where it is not given: one run a GPU with CUDA (`start_worker`); else 2, which on 2 cores did
    ~15% more work per second than one run of 2 threads (`run_all`)."""
    return torch.cuda.device_count() if pick_device(device).type == "cuda" else 2


def runs_at_once(jobs: int, device: str) -> tuple[int, int]:
    """(runs at once, runs sharing one device's memory) for `jobs` workers of runs on --device `device`: with
    CUDA, one a GPU while there are as many (`start_worker`); on the CPU all of them, splitting its cores and
    sharing its memory."""
    if pick_device(device).type == "cuda":
        devices = torch.cuda.device_count()
        return min(jobs, devices), -(-jobs // devices)
    return jobs, jobs


SIGNAL_CHECK = 0.2  # seconds: how late a signal taken by another thread may be seen (`wait_awake`)


def wait_awake(futures: list, return_when: str) -> None:
    """wait(futures, return_when=...) in short waits, so that a signal's handler runs at most SIGNAL_CHECK s
    late: Python runs it in the main thread alone, and the kernel may hand a process's signal to any thread
    that does not block it (tqdm's monitor, left by an earlier run in this process; the pool's own), most of
    all the second of two sent together, which one long wait would hold until a run ended. A future that
    `shutdown(cancel_futures=True)` cancelled counts as done (`wait` would wait for it to the end)."""
    while not all(f.done() for f in futures):
        done, _ = wait(futures, SIGNAL_CHECK, return_when)
        if return_when == FIRST_EXCEPTION and any(f.exception() for f in done):
            return


def signal_all(processes: list, signum: int) -> None:
    """Send `signum` to each of these processes that is still there."""
    for process in processes:
        with suppress(ProcessLookupError):
            os.kill(process.pid, signum)


STOPPING = None  # in a worker of `run_all`: its event, set when no more runs may start (`start_worker`)


def start_worker(stopping, started, devices: int) -> None:
    """A worker of `run_all`: it ignores SIGTERM between tasks (`with_threads` takes it during one), and keeps
    `stopping`. With `devices` CUDA devices, the k-th worker started sees the k-th alone (mod their number;
    among those CUDA_VISIBLE_DEVICES names, if it names any), set before this process touches CUDA: one
    device a worker, so runs side by side never share one while there are as many devices as --jobs."""
    global STOPPING
    STOPPING = stopping
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    if devices:
        visible = os.environ.get("CUDA_VISIBLE_DEVICES", ",".join(map(str, range(devices)))).split(",")
        with started.get_lock():
            os.environ["CUDA_VISIBLE_DEVICES"] = visible[started.value % len(visible)]
            started.value += 1


def with_threads(threads: int, fn: Callable, *args):
    """fn(*args) in a worker process limited to `threads` intra-op threads; nothing (None) once `run_all` has
    set the stop event. SIGTERM stops it at once (`stop_handler`), or, inside train.main, after its step,
    saved. The handler comes first: a SIGTERM sent after `stopping` was set then either finds the handler or
    finds `stopping` set."""
    with on_stop_signals(stop_handler()):
        if STOPPING.is_set():
            return None
        torch.set_num_threads(threads)
        return fn(*args)

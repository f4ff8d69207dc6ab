"""A run's processes: one, or several under torchrun (their collectives), and how they stop: Ctrl-C or SIGTERM
ends the step under way, saved; an expected failure exits with one line.
"""

import os
import signal
import sys
import threading
from contextlib import contextmanager
from datetime import timedelta
from typing import Callable

import torch
import torch.distributed as dist

from infra.hardware import out_of_memory, pick_device
from infra.written import NotWritten
from loop.run_folder import RunFolderError
from verifier import RewardError


# How long a process waits in a collective for the others. The first process evaluates and saves alone while
# the others wait in the next step's first collective; nccl's watchdog aborts that wait after 10 minutes by
# default (gloo after 30), less than an evaluation of MATH-500 at 1.5B can take. We chose a long wait over
# evaluating on every process: the cost is that a real hang surfaces only after it.
COLLECTIVE_WAIT = timedelta(hours=2)


def init_processes(device_name: str = "auto") -> tuple[int, int, torch.device]:
    """(rank, world size, device) for --device auto|cpu|cuda (`hardware.pick_device`): one process unless
    launched by torchrun (nccl on CUDA, gloo on CPU), each then on the GPU of its LOCAL_RANK."""
    device = pick_device(device_name)
    if "RANK" not in os.environ:
        return 0, 1, device
    if device.type == "cuda":
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", timeout=COLLECTIVE_WAIT)
    return dist.get_rank(), dist.get_world_size(), device


def close_processes() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def all_sum(values: list[float], device: torch.device) -> list[float]:
    """Elementwise sum of `values` over all processes (unchanged in a single process)."""
    if not dist.is_initialized():
        return values
    total = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(total)
    return total.tolist()


def gather_groups(local: torch.Tensor, error: RewardError | None = None) -> torch.Tensor:
    """[B/N, G] rows of each of N processes -> [B, G] in rank order (the order of the step's prompts). A
    process whose reward failed sends NaN rows and its `error`: every process then raises that error, rather
    than wait for the failed one (a checked reward is never NaN)."""
    if not dist.is_initialized():
        return local
    nccl = dist.get_backend() == "nccl"  # nccl gathers CUDA tensors only
    device = torch.device("cuda", torch.cuda.current_device()) if nccl else torch.device("cpu")
    parts = [torch.empty_like(local, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(parts, local.to(device))
    if any(part.isnan().any() for part in parts):
        errors = [None] * dist.get_world_size()
        dist.all_gather_object(errors, error)
        raise next(e for e in errors if e is not None)
    return torch.cat(parts).cpu()


def sum_gradients(model) -> None:
    """Sum each trained parameter's gradient over processes (under LoRA the adapters alone: a frozen weight
    has none, and gets none); one without a gradient gets zeros, so that every process (even one that had no
    row to train) joins the same all-reduces and takes the same step."""
    for p in (p for p in model.parameters() if p.requires_grad):
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if dist.is_initialized():
            dist.all_reduce(p.grad)


# ------------------------------------------------------------------------------ stopping

STOP_SIGNALS = {signal.SIGINT: "Ctrl-C", signal.SIGTERM: "SIGTERM"}  # SIGTERM: schedulers, `timeout`


@contextmanager
def on_stop_signals(handler):
    """Inside the block, Ctrl-C and SIGTERM call `handler(signum, frame)`; the handlers before it come back
    after. Only the main thread receives signals: elsewhere nothing changes."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = {signum: signal.signal(signum, handler) for signum in STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


@contextmanager
def ctrl_c_stops_after_the_step():
    """Inside the block, a first Ctrl-C or SIGTERM only asks to stop (the yielded list gets its signal
    number): the loop ends its step, so that a checkpoint holds whole steps. The loop checks the request
    itself, so an interrupt can never be lost inside a library that swallows exceptions. A second one stops
    at once, unsaved."""
    requested: list[int] = []

    def on_signal(signum, frame):
        if requested:
            raise KeyboardInterrupt
        requested.append(signum)
        os.write(2, f"\n{STOP_SIGNALS[signum]}: stopping at the end of the step under way "
                    "(a second one stops at once, unsaved)\n".encode())

    with on_stop_signals(on_signal):
        yield requested


class StoppedWhileScoring(KeyboardInterrupt):
    """Ctrl-C or SIGTERM while a step's rewards were computed (`stops_at_once`): the step is dropped, as its
    update has not happened, and the one before it is saved."""

    def __init__(self, signum: int):
        super().__init__(STOP_SIGNALS[signum])
        self.signum = signum


@contextmanager
def stops_at_once():
    """Inside the block, Ctrl-C or SIGTERM raises StoppedWhileScoring at once instead of asking the step to
    end: around the wait for a reward, which may never return (a reward stuck in C code holds even the time
    limit's wait only until the signal arrives)."""
    def on_signal(signum, frame):
        raise StoppedWhileScoring(signum)

    with on_stop_signals(on_signal):
        yield


@contextmanager
def bad_input_is_one_line(report: Callable[[str], None] = lambda line: sys.exit(f"error: {line}")):
    """Around what reads a run's inputs before its first step (train.parse_args's checks, run.start_run): a
    missing file, a bad data line, flag, model or prompt, a reward module that does not import (OSError,
    ValueError, ImportError, raised with a message naming it) exits with that message, joined into one line
    however many it has, through `report` (argparse's parser.error at parse time), not a traceback. Raised
    later, a ValueError is a bug, and keeps its traceback. Usable as a decorator."""
    try:
        yield
    except (OSError, ValueError, ImportError) as e:
        report(" ".join(str(e).split()))


@contextmanager
def exits_cleanly():
    """train.py's way out: Ctrl-C or SIGTERM ends the step under way (while the flags, data and models load:
    the run stops before its first step), then exits with code 128 + the signal (130, 143) once it is saved
    (`ctrl_c_stops_after_the_step` yields the stop requests); an unknown model, a missing file, a damaged run
    folder, a file that is not the run's (infra/written.py) or a bad reward exits with one line, not a
    traceback; the processes of torchrun are closed whichever way it ends. A filesystem failure (a full disk,
    a read-only folder) is one line too: what was saved before it stays whole; so is running out of device
    memory, with what to change (`hardware.out_of_memory`)."""
    requested: list[int] = []
    try:
        with ctrl_c_stops_after_the_step() as requested:
            yield requested
    except (OSError, RunFolderError, RewardError, NotWritten) as e:
        sys.exit(f"error: {e}")
    except torch.OutOfMemoryError as e:  # the steps before it saved (`run.before_failed_step`)
        sys.exit(f"error: {out_of_memory(e)}")
    except KeyboardInterrupt as e:  # the checkpoint is saved and said so (or a second signal); no traceback
        sys.exit(128 + (requested[0] if requested else getattr(e, "signum", signal.SIGINT)))
    finally:
        close_processes()

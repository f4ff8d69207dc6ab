"""What the benchmarks share: timing a call, running one config in a process of its own, and markdown
tables (the peak memory: hardware.peak_memory_bytes)."""

import multiprocessing
import statistics
import time
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import torch


def best_seconds(fn: Callable, reps: int = 3, warmup: bool = True) -> float:
    """The fastest of `reps` calls of fn() (after one untimed call if `warmup`): the least disturbed by the
    rest of the machine."""
    if warmup:
        fn()
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def sync(device: torch.device) -> None:
    """Wait for the device's queued work, so that a timer stops when it is done (CUDA runs asynchronously)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_isolated(fn: Callable, *args):
    """fn(*args) in a fresh (spawned) Python process, so that its peak memory is measured alone."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"

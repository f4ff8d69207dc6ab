"""Accuracy and speed of verifier.verify on real data, optionally against math-verify.

Usage (from the repo root): python benchmarks/verifier_bench.py [--data-dir ../shared/data]

- GSM8K: 5,276 real model solutions with correctness labels; we report label agreement.
- MATH-500: each reference solution against its own answer (should accept) and against the
  next problem's answer (should reject; pairs whose golds normalise equal are skipped).
Times are per call (extraction + normalisation + comparison), with the garbage collector off.
"""
from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from verifier import normalise, verify  # noqa: E402

GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
Verifier = Callable[[str, str], bool]


def _read_jsonl(path: Path) -> list[dict]:
    with path.open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def load_cases(data_dir: Path) -> dict[str, list[tuple[str, str, bool]]]:
    """(completion, gold, expected) triples for each check."""
    gsm8k = []
    for row in _read_jsonl(data_dir / "gsm8k_model_solutions.jsonl"):
        gold = row["ground_truth"].rsplit("A:", 1)[1].strip()  # ground truth ends "A: <number>"
        for model in GSM8K_MODELS:
            gsm8k.append((row[model]["solution"], gold, row[model]["is_correct"]))
    math500 = _read_jsonl(data_dir / "math500_test.jsonl")
    self_cases = [(r["solution"], r["answer"], True) for r in math500]
    cross_cases = []
    for i, row in enumerate(math500):
        other = math500[(i + 1) % len(math500)]["answer"]
        if normalise(other) != normalise(row["answer"]):
            cross_cases.append((row["solution"], other, False))
    return {"gsm8k": gsm8k, "math_self": self_cases, "math_cross": cross_cases}


def run(check: Verifier, cases: list[tuple[str, str, bool]]) -> tuple[int, list[float]]:
    """Number of verdicts equal to `expected`, and the seconds each call took."""
    agree, seconds = 0, []
    gc.disable()
    try:
        for completion, gold, expected in cases:
            start = time.perf_counter()
            verdict = bool(check(completion, gold))
            seconds.append(time.perf_counter() - start)
            agree += verdict == expected
    finally:
        gc.enable()
    return agree, seconds


def math_verify_check() -> Verifier | None:
    """math-verify's documented use (gold wrapped in $...$), or None if not installed."""
    try:
        from math_verify import parse, verify as mv_verify
    except ImportError:
        return None
    return lambda completion, gold: mv_verify(parse(f"${gold}$"), parse(completion))


def report(name: str, check: Verifier, cases: dict) -> float:
    """Print one verifier's table; return its median µs per call over all inputs."""
    print(f"\n{name}")
    print(f"{'check':<24}{'result':>16}{'median µs':>12}{'p99 µs':>10}{'worst µs':>11}")
    every = []
    for label, key, fmt in (
        ("GSM8K label agreement", "gsm8k", lambda a, n: f"{a}/{n} {100 * a / n:.2f}%"),
        ("MATH-500 self-accept", "math_self", lambda a, n: f"{a}/{n}"),
        ("MATH-500 cross-accept", "math_cross", lambda a, n: f"{n - a}/{n}"),
    ):
        agree, seconds = run(check, cases[key])
        every += seconds
        us = sorted(s * 1e6 for s in seconds)
        p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
        print(f"{label:<24}{fmt(agree, len(seconds)):>16}"
              f"{statistics.median(us):>12.1f}{p99:>10.1f}{us[-1]:>11.1f}")
    return statistics.median(every) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=ROOT.parent / "shared" / "data")
    args = parser.parse_args(argv)
    if not (args.data_dir / "math500_test.jsonl").exists():
        print(f"data folder {args.data_dir} not found; nothing to benchmark")
        return 0
    cases = load_cases(args.data_dir)
    ours = report("verifier.verify (this repo)", verify, cases)
    check = math_verify_check()
    if check is None:
        print("\nmath-verify not installed (pip install math-verify) - comparison skipped")
        return 0
    theirs = report("math-verify", check, cases)
    print(f"\nmedian µs per call over all inputs: ours {ours:.1f}, math-verify {theirs:.1f}"
          f" -> ours is {theirs / ours:.0f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Accuracy and speed of verifier.verify on real data, optionally against math-verify.

Usage (from the repo root): python benchmarks/verifier_bench.py [--data-dir data/downloads]
(`python data/prepare.py math gsm8k-solutions` fetches the files it reads there)

- GSM8K: 5,276 real model solutions with correctness labels; we report label agreement.
- MATH-500: each reference solution against its own answer (should accept) and against the
  next problem's answer (should reject; pairs whose golds normalise equal are skipped).
- Suite: the hand-written gold/completion pairs of tests/verifier_cases.py (format coverage and
  must-reject near misses), needs no data folder.
- Hostile inputs: the slowest of best-of-3 timings over deep nesting, 10^5 digits, 9^{9^{9}}, ...
Each verifier is compared with a naive baseline (last number in the text, compared as a number)
and with math-verify when installed. Times are per call, with the garbage collector off.
"""
from __future__ import annotations

import gc
import re
import statistics
import sys
import time
from fractions import Fraction
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from benchmarks.timing import best_seconds  # noqa: E402
from data.prepare import DOWNLOADS  # noqa: E402
from infra.flags import FlagParser  # noqa: E402
from loop.run_folder import read_jsonl  # noqa: E402
from tests.verifier_cases import CASES  # noqa: E402
from verifier import load_reward, normalise, verify  # noqa: E402

GSM8K_MODELS = ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification")
Verifier = Callable[[str, str], bool]


def load_cases(data_dir: Path) -> dict[str, list[tuple[str, str, bool]]]:
    """(completion, gold, expected) triples for each check."""
    gsm8k = []
    for row in read_jsonl(data_dir / "gsm8k_model_solutions.jsonl"):
        gold = row["ground_truth"].rsplit("A:", 1)[1].strip()  # ground truth ends "A: <number>"
        for model in GSM8K_MODELS:
            gsm8k.append((row[model]["solution"], gold, row[model]["is_correct"]))
    math500 = read_jsonl(data_dir / "math500_test.jsonl")
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
        return load_reward("math-verify")
    except ImportError:
        return None


_LAST_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def naive_check(completion: str, gold: str) -> bool:
    """The baseline many RL scripts use: the last number in the text equals the gold's number."""
    found = _LAST_NUMBER.findall(completion.replace(",", ""))
    want = _LAST_NUMBER.findall(gold.replace(",", ""))
    if not found:
        return False
    try:
        return len(want) == 1 and Fraction(found[-1]) == Fraction(want[0])
    except ValueError:
        return False


def suite_cases() -> list[tuple[str, str, bool]]:
    return [(c.completion, c.gold, c.expected) for c in CASES]


HOSTILE = [
    "\\boxed{" * 100_000,
    "\\boxed{" + "{" * 100_000,
    "\\boxed{" + "9" * 100_000 + "}",
    "\\boxed{9^{9^{9}}}",
    "\\boxed{9^{9^{9^{9^{9}}}}}",
    "\\boxed{2^{10^{100}}}",
    "\\boxed{(((((((((((((((((((((((((((((((((((((((((1)))))))))))))))))))))))))))))))))))))))))}",
    "\\boxed{" + "\\frac{1}{" * 60 + "2" + "}" * 60 + "}",
    "\\boxed{" + "\\frac12" * 50 + "}",
    "\\boxed{" + "\\sqrt{" * 60 + "2" + "}" * 60 + "}",
    "\\boxed{" + "x^" * 150 + "2}",
    "\\boxed{" + "+".join(["x"] * 150) + "}",
    "\\boxed{" + "170!" * 20 + "}",
    "\\boxed{" + "(" * 100 + "1," * 50 + ")" * 100 + "}",
    "\\boxed{1} " * 20_000,
    "$" + "1+" * 50_000 + "$",
    "1" * 100_000,
    "the answer is " * 20_000,
    "\\frac12" * 50_000,
    "\\(" * 50_000,
    "\\begin{pmatrix}" + "1 & " * 2000 + "\\end{pmatrix}",
    "\\boxed{\\begin{pmatrix}" + "1 \\\\ " * 60 + "\\end{pmatrix}}",
    "\\boxed{" + "x<" * 100 + "1}",
    "\\boxed{\\{" + "1," * 150 + "1\\}}",
]
HOSTILE_GOLDS = ("1", "x", "\\frac{1}{2}", "(1, 2)", "\\{1, 2\\}", "9^{9^{9}}")


def hostile_worst(check: Verifier) -> tuple[float, str]:
    """Slowest best-of-3 seconds per call over the hostile inputs, and that input's head."""
    worst, which = 0.0, ""
    for text in HOSTILE:
        for gold in HOSTILE_GOLDS + (text[:300],):
            best = best_seconds(lambda: check(text, gold), reps=3, warmup=False)
            if best > worst:
                worst, which = best, text[:40]
    return worst, which


def report(name: str, check: Verifier, cases: dict) -> float:
    """Print one verifier's table; return its median µs per call over all inputs."""
    print(f"\n{name}")
    print(f"{'check':<24}{'result':>16}{'median µs':>12}{'p99 µs':>10}{'worst µs':>11}")
    every = []
    for label, key, fmt in (
        ("suite agreement", "suite", lambda a, n: f"{a}/{n} {a / n:.3f}"),
        ("GSM8K label agreement", "gsm8k", lambda a, n: f"{a}/{n} {100 * a / n:.2f}%"),
        ("MATH-500 self-accept", "math_self", lambda a, n: f"{a}/{n}"),
        ("MATH-500 cross-accept", "math_cross", lambda a, n: f"{n - a}/{n}"),
    ):
        if key not in cases:
            continue
        agree, seconds = run(check, cases[key])
        every += seconds
        us = sorted(s * 1e6 for s in seconds)
        p99 = us[min(len(us) - 1, int(0.99 * len(us)))]
        print(f"{label:<24}{fmt(agree, len(seconds)):>16}"
              f"{statistics.median(us):>12.1f}{p99:>10.1f}{us[-1]:>11.1f}")
    return statistics.median(every) * 1e6


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data-dir", type=Path, default=DOWNLOADS)
    parser.add_argument("--skip-math-verify", action="store_true", help="leave math-verify out")
    args = parser.parse_args(argv)
    cases: dict = {"suite": suite_cases()}
    if (args.data_dir / "math500_test.jsonl").exists():
        cases.update(load_cases(args.data_dir))
    else:
        print(f"no math500_test.jsonl in {args.data_dir} (python data/prepare.py math gsm8k-solutions): "
              "only the suite is measured")
    ours = report("verifier.verify (this repo)", verify, cases)
    worst, which = hostile_worst(verify)
    print(f"{'hostile inputs, worst':<24}{worst * 1e3:>14.2f} ms  ({which!r}...)")
    report("naive last-number baseline", naive_check, cases)
    check = None if args.skip_math_verify else math_verify_check()
    if check is None:
        print("\nmath-verify not installed (pip install math-verify) - comparison skipped")
        return 0
    theirs = report("math-verify", check, cases)
    print(f"\nmedian µs per call over all inputs: ours {ours:.1f}, math-verify {theirs:.1f}"
          f" -> ours is {theirs / ours:.0f}x faster")
    return 0


if __name__ == "__main__":
    sys.exit(main())

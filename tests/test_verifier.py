"""Tests for verifier.py: extraction rules, normalisations, robustness, and real data."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from verifier import extract_answer, normalise, verify  # noqa: E402

DATA = Path(__file__).resolve().parent.parent.parent / "shared" / "data"

EXTRACTION = [
    ("so $\\boxed{42}$.", "42"),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt{3}}{2}"),  # nested braces
    ("first \\boxed{1}, then \\boxed{2}", "2"),  # last boxed wins
    ("\\fbox{7} is it", "7"),
    ("hence $\\boxed 5$.", "5"),
    ("\\boxed{3} then \\boxed{4", "3"),  # an unclosed last box falls back to the one before
    ("work\n#### 18.00", "18.00"),
    ("The answer is 1,000.", "1,000"),
    ("Final Answer: The final answer is $\\frac{1}{2}$. I hope it is correct.", "\\frac{1}{2}"),
    ("**Answer:** $18 dollars per day", "18"),
    ("9 * 2 = 18\nA: 18", "18"),
    ("The answer is: (B)", "(B)"),
    ("the answer is 5 and #### 6", "6"),  # #### outranks a phrase
    ("3 apples and 4 pears, 7.5 in total", "7.5"),  # last number
    ("no numbers here", None),
    ("", None),
]

CASES = [  # (completion, gold, expected)
    ("\\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("The answer is 1,000.", "1000", 1.0),
    ("#### 18.00", "18", 1.0),
    ("\\boxed{\\frac{\\sqrt{3}}{2}}", "\\frac{\\sqrt3}{2}", 1.0),
    ("\\boxed{1} then \\boxed{2}", "2", 1.0),
    ("\\boxed{1} then \\boxed{2}", "1", 0.0),
    ("\\boxed{\\dfrac{1}{2}}", "\\frac12", 1.0),
    ("\\boxed{\\tfrac{9}{19}}", "\\frac9{19}", 1.0),
    ("\\boxed{\\frac{270}{7}}", "\\frac{270}7\\text{ degrees}", 1.0),  # unit text dropped
    ("\\boxed{5.4}", "5.4 \\text{ cents}", 1.0),
    ("\\boxed{864}", "864 \\mbox{ inches}^2", 1.0),
    ("\\boxed{11\\sqrt{2}}", "11\\sqrt2", 1.0),
    ("\\boxed{90}", "90^\\circ", 1.0),
    ("\\boxed{90^{\\circ}}", "90", 1.0),
    ("\\boxed{50\\%}", "50", 1.0),
    ("\\boxed{\\$18.90}", "18.9", 1.0),
    ("\\boxed{10080}", "10,\\!080", 1.0),
    ("\\boxed{1{,}000}", "1000", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{y=2x+3}", "y = 2x + 3", 1.0),
    ("\\boxed{.5}", "0.5", 1.0),
    ("\\boxed{-0.5}", "-\\frac{1}{2}", 1.0),
    ("\\boxed{1/2}", "\\frac{1}{2}", 1.0),
    ("\\boxed{3.0}", "3", 1.0),
    ("\\boxed{0.3333333}", "\\frac{1}{3}", 1.0),  # relative tolerance 1e-6
    ("\\boxed{0.333}", "\\frac{1}{3}", 0.0),
    ("A: 8.333333333333334", "\\frac{25}{3}", 1.0),
    ("\\boxed{999999.5}", "1000000", 0.0),  # no loose relative tolerance on big values
    ("\\boxed{1000000000001}", "1000000000000", 0.0),  # integers compare exactly
    ("\\boxed{\\begin{pmatrix} 1 \\\\ 32 \\end{pmatrix}}",
     "\\begin{pmatrix} 13 \\\\ 2 \\end{pmatrix}", 0.0),
    ("\\boxed{\\begin{pmatrix} -1/3 \\\\ 2/3 \\end{pmatrix}}",
     "\\begin{pmatrix}-1/3\\\\2/3\\end{pmatrix}", 1.0),
    ("\\boxed{3 \\pm 2\\sqrt{2}}", "3 \\pm 2 \\sqrt{2}", 1.0),
    ("\\boxed{(-\\infty,0]}", "(-\\infty, 0]", 1.0),
    ("\\boxed{x \\in [-2,7]}", "[-2, 7]", 1.0),
    ("\\boxed{\u22121}", "-1", 1.0),  # unicode minus
    ("\\boxed{\\text{Evelyn}}", "\\text{Evelyn}", 1.0),
    ("\\boxed{Evelyn}", "\\text{Navin}", 0.0),
    ("\\boxed{C}", "\\text{(C)}", 1.0),
    ("\\boxed{(3, 1.5)}", "\\left( 3, \\frac{3}{2} \\right)", 1.0),  # tuples elementwise
    ("\\boxed{(3,4)}", "(3,4]", 0.0),  # interval ends must agree
    ("\\boxed{(1,2)}", "(1,2,3)", 0.0),
    ("\\boxed{p-q}", "p - q", 1.0),
    ("\\boxed{3R^2}", "3r^2", 0.0),
    ("\\boxed{52_8}", "52", 0.0),
    ("A: 26", "18", 0.0),
    ("The answer is 7", "-7", 0.0),
    ("no answer at all", "5", 0.0),
    ("\\boxed{5}", "", 0.0),
    ("\\boxed{1/0}", "0", 0.0),
]


@pytest.mark.parametrize("text, expected", EXTRACTION)
def test_extract_answer(text: str, expected: str | None) -> None:
    assert extract_answer(text) == expected


@pytest.mark.parametrize("completion, gold, expected", CASES)
def test_verify_table(completion: str, gold: str, expected: float) -> None:
    assert verify(completion, gold) == expected


@pytest.mark.parametrize("bad", [None, 5, b"\\boxed{5}", ["5"], object()])
def test_non_string_inputs_score_zero(bad: object) -> None:
    assert verify(bad, "5") == 0.0  # type: ignore[arg-type]
    assert verify("\\boxed{5}", bad) in (0.0, 1.0)  # type: ignore[arg-type]


@settings(deadline=None, max_examples=150)
@given(st.text(), st.text())
def test_never_raises_on_arbitrary_text(completion: str, gold: str) -> None:
    assert verify(completion, gold) in (0.0, 1.0)


@settings(deadline=None, max_examples=150)
@given(st.text(alphabet="\\boxed{}frac#A:answer is0123456789.,-$%^ \n()[]", max_size=80),
       st.text(alphabet="\\{}frac0123456789.,-$%^ ()", max_size=20))
def test_never_raises_on_latexish_text(completion: str, gold: str) -> None:
    assert verify(completion, gold) in (0.0, 1.0)


@settings(deadline=None, max_examples=100)
@given(st.integers(min_value=-10**12, max_value=10**12))
def test_integers(n: int) -> None:
    assert verify(f"\\boxed{{{n}}}", str(n)) == 1.0
    assert verify(f"The answer is {n}.", str(n)) == 1.0
    assert verify(f"\\boxed{{{n}}}", str(n + 1)) == 0.0
    assert verify(f"#### {n + 1}", str(n)) == 0.0


@settings(deadline=None, max_examples=100)
@given(st.integers(min_value=1000, max_value=10**12))
def test_thousands_separators(n: int) -> None:
    assert verify(f"The answer is {n:,}.", str(n)) == 1.0
    assert verify(f"\\boxed{{{n}}}", f"{n:,}") == 1.0
    assert verify(f"\\boxed{{{n:,}}}".replace(",", "{,}"), str(n)) == 1.0


@pytest.mark.parametrize("text", [
    "\\boxed{" * 100_000,
    "\\boxed{" + "{" * 100_000,
    "1" * 100_000,
    "\\boxed{" + "9" * 100_000 + "}",
    "the answer is " * 20_000,
    "A: " * 50_000,
    "1," * 100_000,
    "a" * 1_000_000,
    "\\frac12" * 50_000,
    "(" * 100_000 + "," * 100_000,
    "\u00e9\U0001F600" * 50_000,
])
def test_adversarial_inputs_are_fast(text: str) -> None:
    for gold in ("1", "1" * 100_000, text[-300:], text):
        start = time.perf_counter()
        assert verify(text, gold) in (0.0, 1.0)
        assert time.perf_counter() - start < 0.5  # generous: the benchmark measures real speed


def _read(name: str) -> list[dict]:
    if not (DATA / name).exists():
        pytest.skip(f"shared data {DATA / name} not present")
    with (DATA / name).open(encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def test_gsm8k_labels_agree() -> None:
    rows = _read("gsm8k_model_solutions.jsonl")
    wrong = []
    for row in rows:
        gold = row["ground_truth"].rsplit("A:", 1)[1].strip()
        for model in ("6b_finetuning", "6b_verification", "175b_finetuning", "175b_verification"):
            sample = row[model]
            if (verify(sample["solution"], gold) == 1.0) != sample["is_correct"]:
                wrong.append((gold, sample["solution"][-80:]))
    assert len(rows) == 1319 and wrong == []


def test_math500_self_and_cross() -> None:
    rows = _read("math500_test.jsonl")
    accepted = sum(verify(r["solution"], r["answer"]) for r in rows)
    assert accepted >= 0.99 * len(rows)
    cross = [
        (r["answer"], other)
        for i, r in enumerate(rows)
        if normalise(other := rows[(i + 1) % len(rows)]["answer"]) != normalise(r["answer"])
        and verify(r["solution"], other) == 1.0
    ]
    assert cross == []

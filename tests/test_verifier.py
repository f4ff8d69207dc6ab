"""Tests for verifier.py: extraction rules, normalisations, the case suite, pluggable rewards,
robustness (hostile inputs are refused fast), and real data."""
from __future__ import annotations

import json
import sys
import time
from pathlib import Path

import pytest
from hypothesis import given, settings, strategies as st

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import verifier  # noqa: E402
from tests.verifier_cases import CASES as SUITE, Case  # noqa: E402
from verifier import extract_answer, load_reward, normalise, verify  # noqa: E402

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
    ("\\boxed{1} then \\boxed 2", "2", 1.0),  # the last box wins, whichever its spelling
    ("\\boxed 1 then \\boxed{2}", "2", 1.0),
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


@pytest.mark.parametrize("case", SUITE, ids=[f"{i}-{c.topic}" for i, c in enumerate(SUITE)])
def test_suite(case: Case) -> None:
    assert verify(case.completion, case.gold) == float(case.expected)


def test_suite_is_broad_and_strict() -> None:
    assert len(SUITE) >= 150
    assert sum(not c.expected for c in SUITE) >= len(SUITE) / 3
    assert len({c.topic for c in SUITE}) >= 20


STRICT = [  # (completion, gold, expected): one check per rule a plausible bug would break
    ("\\boxed{(1, 2)}", "(1, 2)", 1.0),
    ("\\boxed{(2, 1)}", "(1, 2)", 0.0),  # tuples are ordered
    ("\\boxed{[1, 4)}", "[1, 4)", 1.0),
    ("\\boxed{(1, 4]}", "[1, 4)", 0.0),  # both ends' brackets count
    ("\\boxed{[1, 4]}", "[1, 4)", 0.0),
    ("\\boxed{(1, 4)}", "[1, 4)", 0.0),
    ("$1 \\le x < 4$", "[1, 4)", 1.0),
    ("$1 < x \\le 4$", "(1, 4]", 1.0),
    ("$1 < x < 4$", "[1, 4)", 0.0),  # < is open, \\le is closed
    ("$1 \\le x \\le 4$", "[1, 4)", 0.0),
    ("$x \\ge 2$", "[2, \\infty)", 1.0),
    ("$x > 2$", "[2, \\infty)", 0.0),
    ("$x < 2$", "(2, \\infty)", 0.0),  # direction matters
    ("$2 > x$", "(-\\infty, 2)", 1.0),
    ("\\boxed{\\{5, 3\\}}", "\\{3, 5\\}", 1.0),  # sets are order-free
    ("\\boxed{\\{5, 4\\}}", "\\{3, 5\\}", 0.0),
    ("\\boxed{\\{3, 3\\}}", "\\{3, 5\\}", 0.0),  # as multisets
    ("\\boxed{\\sqrt{12}}", "2\\sqrt{3}", 1.0),
    ("\\boxed{\\sqrt{3}}", "2\\sqrt{3}", 0.0),
    ("\\boxed{\\sqrt{2}}", "2", 0.0),
    ("\\boxed{\\sqrt[3]{27}}", "\\sqrt{9}", 1.0),  # two formulas: by value
    ("\\boxed{\\sqrt[3]{-8}}", "-\\sqrt{4}", 1.0),
    ("\\boxed{\\sqrt[3]{27}}", "3", 0.0),  # a number's answer is a number: arithmetic left undone is none
    ("\\boxed{1/2}", "2", 0.0),
    ("\\boxed{0.3333333}", "\\frac{1}{3}", 1.0),
    ("\\boxed{0.33333}", "\\frac{1}{3}", 0.0),  # tolerance is 1e-6, not 1e-5
    ("\\boxed{999999.5}", "1000000", 0.0),  # integers exactly
    ("\\boxed{1000001}", "1000000", 0.0),
    ("\\boxed{1\\,000\\,000}", "1000000", 1.0),
    ("\\boxed{12 345}", "12345", 1.0),
    ("\\boxed{1 2345}", "12345", 0.0),  # separators only between groups of three
    ("\\boxed{1,2345}", "12345", 0.0),
    ("\\boxed{12,34}", "1234", 0.0),
    ("\\boxed{x^2}", "x^3", 0.0),
    ("\\boxed{7x^2}", "3x", 0.0),  # equal at x = 3/7, the first test point: all points count
    ("\\boxed{2 3}", "6", 0.0),  # two numbers side by side are no product
    ("\\boxed{2 \\cdot 3}", "6", 0.0),  # the question's arithmetic restated, not done
    ("\\boxed{2^{10}}", "1024", 0.0),
    ("551 * 65", "35815", 0.0),  # a whole completion that restates "What is 551 * 65?"
    ("8 + 5", "13", 0.0),
    ("8 + 5 = 13", "13", 1.0),  # the stated result counts
    ("\\boxed{2.5 \\times 10^{-5}}", "0.000025", 1.0),  # scientific notation is a number written out
    ("\\boxed{2^{10}}", "4^5", 1.0),
    ("\\boxed{\\frac{x}{2} + \\frac12}", "\\frac{x+1}{2}", 1.0),
    ("\\boxed{\\frac{x}{2} + \\frac13}", "\\frac{x+1}{2}", 0.0),
    ("\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}}",
     "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", 1.0),
    ("\\boxed{\\begin{pmatrix} 1 & 2 \\\\ 4 & 3 \\end{pmatrix}}",
     "\\begin{bmatrix} 1 & 2 \\\\ 3 & 4 \\end{bmatrix}", 0.0),
    ("\\boxed{3} and \\boxed{5}", "3, 5", 1.0),
    ("\\boxed{3} and \\boxed{5}", "5", 1.0),  # one gold answer: the last box
    ("\\boxed{3} and \\boxed{5}", "3", 0.0),
    ("\\boxed{3} and \\boxed{4}", "3, 5", 0.0),
    ("\\boxed{-5}", "5", 0.0),
    ("\\boxed{5\\%}", "0.05", 1.0),
    ("\\boxed{5\\%}", "0.5", 0.0),
    ("\\boxed{x = 3}", "3", 1.0),
    ("\\boxed{11a + c}", "7 = 11a + c", 0.0),
]


@pytest.mark.parametrize("completion, gold, expected", STRICT)
def test_strict_rules(completion: str, gold: str, expected: float) -> None:
    assert verify(completion, gold) == expected


@pytest.mark.parametrize("completion, gold", [(c, g) for c, g, e in STRICT if e == 1.0])
def test_gold_and_completion_are_read_alike(completion: str, gold: str) -> None:
    """Swapping the roles (the gold boxed, the completion's answer as gold) keeps the verdict."""
    inner = extract_answer(completion)
    if "boxed" in completion and completion.count("boxed") == 1 and "=" not in gold:
        assert verify(f"\\boxed{{{gold}}}", inner) == 1.0


def test_a_numbers_answer_is_a_number_and_a_formulas_any_equal_value() -> None:
    """The one asymmetry of gold and completion: a gold written as a number wants a number (restating the
    question's arithmetic is no answer), a gold written as a formula takes whatever has its value."""
    assert verify("\\boxed{3}", "\\sqrt[3]{27}") == 1.0 and verify("\\boxed{\\sqrt[3]{27}}", "3") == 0.0
    assert verify("\\boxed{1.414214}", "\\sqrt{2}") == 1.0 and verify("\\boxed{\\sqrt{2}}", "1.414214") == 0.0
    assert verify("What is 7 * 3? 7 * 3", "21") == 0.0 and verify("7 * 3 = 21", "21") == 1.0


# A runaway guard, not a speed test (benchmarks/bench.py measures speed): CPU seconds of this thread, so a
# busy machine adds nothing, and 40x what a call takes here (at most 6 ms), so a slower one passes too;
# a power computed takes 13 s here, a box scan made quadratic 0.9 s.
CPU_CAP_S = 0.25


def test_hostile_powers_are_refused_fast() -> None:
    for text in ("\\boxed{9^{9^{9}}}", "\\boxed{2^{10^{100}}}", "\\boxed{(10^{4000})^{4000}}",
                 "\\boxed{170!!}", "\\boxed{" + "\\sqrt{" * 200 + "2" + "}" * 200 + "}",
                 "\\boxed{" + "(" * 300 + "1" + ")" * 300 + "}", "\\boxed{" + "2^" * 100 + "2}"):
        for gold in ("1", "9^{9^{9}}", "x", text[7:-1]):
            start = time.thread_time()
            assert verify(text, gold) in (0.0, 1.0)
            assert time.thread_time() - start < CPU_CAP_S
    assert verify("\\boxed{9^{9^{9}}}", "9^{9^{9}}") == 1.0  # equal as written, never computed
    assert verify("\\boxed{2^{100}}", "4^{50}") == 1.0  # exact while small enough


def test_formula_parser_and_values() -> None:
    value = verifier._interpret("\\frac{1}{2} + \\sqrt{4} \\cdot 3").value
    assert value == verifier.Fraction(13, 2)  # exact arithmetic where possible
    assert verifier._interpret("\\frac12").value == verifier.Fraction(1, 2)
    assert verifier._interpret("\\sqrt{\\frac{9}{4}}").value == verifier.Fraction(3, 2)  # exact roots
    assert verifier._interpret("\\sqrt[3]{27}").value == 3 and verifier._interpret("8^{2/3}").value == 4
    assert verifier._interpret("2x").names == frozenset({"x"})
    assert verifier._interpret("x_1 + \\alpha").names == frozenset({"x_1", "\\alpha"})
    assert verifier._interpret("52_8") == verifier.Raw("52_8")  # a base subscript is not a product


def test_answer_structures() -> None:
    """How lists are read: the kind decides whether order counts (see _same)."""
    sets, lists = ("\\{1, 3\\}", "{1, 3}", "3 \\pm 2", "1 \\text{ or } 5"), ("1, 3", "1 \\text{ and } 3")
    assert [verifier._interpret(s).kind for s in sets] == ["set"] * 4
    assert [verifier._interpret(s).kind for s in lists] == ["list"] * 2
    assert verifier._interpret("(1, 3]") == verifier.Seq("tuple", "(]",
                                                         [verifier._interpret(x) for x in "13"])
    assert verifier._interpret("0 < f(x) \\le 1").brackets == "(]"
    decimal, listed = verifier._interpret("1,22").options  # a decimal comma, or the list 1, 22
    assert decimal.value == verifier.Fraction(122, 100) and listed.kind == "list"
    assert verifier._interpret("1,000; 2").items[0].value == 1000  # no decimal reading fits 1,000
    assert verifier._interpret("AB = 4").names_value and verifier._interpret("|AB| = 4").names_value
    assert (not verifier._interpret("2x + z = 4").names_value
            and not verifier._interpret("|x| = 4").names_value)


# ------------------------------------------------------------------ pluggable rewards
def test_load_reward_default_is_verify() -> None:
    completions, golds = ["\\boxed{5}", "It is 6.", "so 1/2"], ["5", "5", "0.5"]
    for spec in ("verifier", ""):
        expected = [verify(c, g) for c, g in zip(completions, golds)]
        assert load_reward(spec)(["q"] * 3, completions, golds) == expected


def test_load_reward_module_function(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "my_rewards.py").write_text(
        "def exact(completion, gold):\n    return float(completion.strip() == gold)\nVALUE = 3\n"
        "def one_argument(completion):\n    return 1.0\n")
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "mod.py").write_text("def fn(completion, gold):\n    return 0.5\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    assert load_reward("my_rewards:exact")(["q", "q"], ["5", "5"], ["5", "6"]) == [1.0, 0.0]
    assert load_reward("pkg.mod:fn")(["q"], ["a"], ["b"]) == [0.5]
    for spec, words in (("no_such_module_xyz:fn", "no module"), ("my_rewards:nope", "no function"),
                        ("my_rewards:VALUE", "not callable"), ("my_rewards", "expected"),
                        (":fn", "expected"), ("my_rewards:", "expected"),
                        ("my_rewards:one_argument", "neither f\\(completion, gold\\)")):
        with pytest.raises(ValueError, match=words) as err:
            load_reward(spec)
        assert spec in str(err.value) and "\n" not in str(err.value)


TRL_REWARDS = """
calls = []

def accuracy(prompts, completions, solution, **kwargs):  # as TRL's accuracy_reward, conversational
    calls.append((prompts, completions, solution, kwargs))
    return [1.0 if c[0]["content"].strip() == s else 0.0 for c, s in zip(completions, solution)]

def length(completions, **kwargs):  # as the TRL docs' reward_len: no prompts parameter of its own
    return [float(len(c[0]["content"])) for c in completions]

def unsure(completions, solution):  # no **kwargs: gets only what it names; None: no verdict
    return [None if c[0]["content"] == "?" else 1.0 for c in completions]

def short(completions, **kwargs):
    return [1.0]

def needs_answer(prompts, completions, answer):  # a column we do not pass
    return [0.0] * len(completions)
"""


def test_load_reward_calls_a_trl_style_function_once_per_batch(tmp_path: Path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "trl_rewards.py").write_text(TRL_REWARDS)
    monkeypatch.syspath_prepend(str(tmp_path))
    import trl_rewards

    reward = load_reward("trl_rewards:accuracy", time_limit=0)  # in this process: its calls are seen here
    assert reward(["What is 2 + 3?", "What is 2 + 3?"], ["5", "6"], ["5", "5"]) == [1.0, 0.0]
    assert len(trl_rewards.calls) == 1  # once for the batch, not once per completion
    prompts, completions, solution, extra = trl_rewards.calls[0]
    assert prompts == [[{"role": "user", "content": "What is 2 + 3?"}]] * 2
    assert completions == [[{"role": "assistant", "content": "5"}], [{"role": "assistant", "content": "6"}]]
    assert solution == ["5", "5"] and extra == {}
    assert load_reward("trl_rewards:length", (0, 5))(["q", "q"], ["ab", "abc"], ["x", "x"]) == [2.0, 3.0]
    assert load_reward("trl_rewards:unsure")(["q", "q"], ["?", "5"], ["5", "5"]) == [0.0, 1.0]
    with pytest.raises(ValueError, match="1 rewards for 2 completions"):
        load_reward("trl_rewards:short")(["q", "q"], ["a", "b"], ["x", "x"])
    with pytest.raises(ValueError, match="solution=") as err:
        load_reward("trl_rewards:needs_answer")
    assert "answer" in str(err.value) and "\n" not in str(err.value)


def test_load_reward_math_verify() -> None:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        pytest.skip("math-verify not installed; the missing-package error is tested below")
    reward = load_reward("math-verify")
    assert reward(["q"] * 3, ["The answer is $\\boxed{\\frac{1}{2}}$", "The answer is $\\boxed{3}$", None],
                  ["\\frac12", "4", "4"]) == [1.0, 0.0, 0.0]  # None: never raises


def test_load_reward_math_verify_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    import builtins

    real_import = builtins.__import__

    def no_math_verify(name, *args, **kwargs):
        if name == "math_verify" or name.startswith("math_verify."):
            raise ImportError("No module named 'math_verify'")
        return real_import(name, *args, **kwargs)

    monkeypatch.setattr(builtins, "__import__", no_math_verify)
    with pytest.raises(ImportError, match="pip install math-verify"):
        load_reward("math-verify")


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
    "\\boxed{1} " * 20_000,
    "$" + "1+" * 50_000 + "$",
    "\\(" * 50_000,
    "\\boxed{" + "\\frac{1}{" * 100 + "2" + "}" * 100 + "}",
    "\\boxed{\\begin{pmatrix}" + "1 & " * 2_000 + "\\end{pmatrix}}",
    "\\boxed{" + "1,2;" * 3_000 + "}",
    "\\boxed{" + "p=1, q=2; " * 1_000 + "}",
    "\\boxed{" + "\\{x \\mid " * 200 + "x > 1" + "\\}" * 200 + "}",
    "\\boxed{" + "{" * 200 + "1,2" + "}" * 200 + "}",
    "\\boxed{|" + "A" * 5_000 + "| = 1}",
    "\\boxed{" + "V_1:" * 2_000 + "V = 1}",
    "\\boxed{0 < f(" + "(" * 1_000 + "x" + ")" * 1_000 + ") < 1}",
    "14{,}" * 50_000,
    "\\boxed{" + "\\\\left(" * 2_000 + "}",
])
def test_adversarial_inputs_are_fast(text: str) -> None:
    for gold in ("1", "1" * 100_000, text[-300:], text):
        start = time.thread_time()
        assert verify(text, gold) in (0.0, 1.0)
        assert time.thread_time() - start < CPU_CAP_S


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

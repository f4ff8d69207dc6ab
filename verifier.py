"""Rule-based answer verifier for math reasoning rewards (pure standard library, no eval).

In RLVR the verifier is the only teacher: a false negative turns a right answer into a wrong
one, so this module reads an answer the way a human grader would, while staying strict.

Order of checks in ``verify(completion, gold)``:

1. Extraction (``extract_answer``): the last ``\\boxed{...}`` / ``\\fbox{...}`` (Hendrycks
   ``last_boxed_only_string``); GSM8K's ``#### x``; an answer phrase ("The answer is", "Answer:",
   "A:", Minerva's "Final Answer: The final answer is ..."); a short completion that is only a
   formula (``k = \\cfrac{1}{3}``); the last ``$...$`` / ``\\(...\\)`` / ``\\[...\\]`` formula
   when no digit follows it; the last number (or ``a/b``).
2. Verbatim equality, then equality of Hendrycks MATH ``_strip_string``-style normal forms.
3. Structural equality of both answers, read by the same rules (``_interpret``):
   matrices cell by cell (same shape); sets (``\\{...\\}``, ``{...}``, ``\\pm``, ``\\cup``, "or")
   as multisets (order-free), sets of tuples too; ``(a, b]``-style tuples and intervals element by
   element with equal brackets; a bare list (``3, 5``, "and") as a set, or as the point ``(3, 5)``
   in its order (a tuple is not a set, and a list is no interval); one-variable inequalities as
   intervals (``1 \\le x < 4`` = ``[1, 4)``, ``x > 2`` = ``(2, \\infty)``), also the bounds of a
   named quantity (``0 < f(x) < 1`` = ``(0, 1)``) and set-builder ``\\{x \\mid -2 \\le x \\le 7\\}``;
   labels dropped (``x =``, ``f(x) =``, ``AB =``, ``|AB| =``, ``V_1:V_2 =``, ``x \\in``,
   ``(x, y) \\in``), except that values under the same labels pair by label (``AB=4, CD=5`` is
   not ``AB=5, CD=4``; numbered roots ``x_1, x_2`` come in any order), and several labelled
   solutions are points (``p=5, q=2; p=7, q=2`` = ``(5, 2), (7, 2)``); a completion's "... = 5"
   states 5; equations side by side or as the same equation up to scale (2x + 4y = 3 vs
   y = -x/2 + 3/4); text answers case-insensitively; anything else is a formula, parsed by a small
   recursive-descent parser and compared by value.
4. Several boxes, in the completion or in a gold solution, as one list (``\\boxed{1}\\boxed{2}`` is
   ``1, 2``); a completion's last box alone still answers a gold of one answer.

Conventions for formulas: ``\\frac \\dfrac \\tfrac \\cfrac`` (also ``\\frac12``), ``\\sqrt[n]{}``,
``^``, implicit products (``2\\sqrt{3}``, ``2x``), ``\\pi``, ``e``, ``i``, ``\\sin``..``\\exp``,
``!``, ``\\binom``. Values are exact ``Fraction`` where possible, complex floats otherwise;
formulas with variables are compared at three fixed rational points. Two exact values that
include an integer must be equal exactly (999999 is not 1000000); other exact values may differ
by a relative 1e-6 (a rounded 0.3333333 for 1/3); computed (irrational) values by 1e-9. A gold
written as a number (``35815``, ``0.25``, ``3/4``, ``2.5 \\times 10^{-5}``) is matched only by a
number: ``551 * 65`` leaves the arithmetic undone (it restates "What is 551 * 65?"), while a gold
written as a formula (``2\\sqrt{3}``) takes anything of its value (``\\sqrt{12}``, ``3.4641016``).
Cosmetics: thousands separators (``1,000``, ``1\\,000``, ``1 000``, LaTeX's ``14{,}916``), a decimal
comma where no thousands reading fits (``1,22`` is 1.22, or the list 1, 22; ``1,234`` stays 1234;
``0,111`` is 0.111, as no number starts with 0 and a thousands group; ``1{,}5`` is only 1.5)
with semicolons between items (``1,5; 2,5``), ``\\left``/``\\right``, backslashes doubled throughout
(``\\\\left( 3, -1 \\\\right)``, an answer escaped twice), units in ``\\text{}``/``\\mbox{}`` and
trailing unit words, ``^\\circ``, ``\\$``, and ``%`` (50% matches 50 and 0.5). Multiple-choice
``\\textbf{(C)}`` reads as ``C``.

Every path is bounded: length caps, a recursion-depth cap, exact powers capped by result size
(``9^{9^{9}}`` is refused in microseconds), no nested regex quantifiers. ``verify`` never raises.

>>> verify("The probability is $\\\\frac{3}{4}$.", "\\\\frac{3}{4}")
1.0
>>> verify("\\\\boxed{(2, 1)}", "(1, 2)")
0.0
"""
from __future__ import annotations

import cmath
import contextlib
import ctypes
import importlib
import inspect
import math
import numbers
import os
import re
import signal
import subprocess
import sys
import threading
import time
import traceback
import weakref
from collections import Counter
from fractions import Fraction
from functools import lru_cache
from multiprocessing.connection import Connection, Pipe
from typing import Callable, NamedTuple, Union

MAX_TEXT = 50_000  # final answers live at the end; scanning only the tail bounds the time
MAX_BOX_TEXT = 10_000  # boxes are looked for in this tail: the brace scan is a Python loop
MAX_SNIPPET = 200  # an answer longer than this is no answer a grader would accept
MAX_NORMALISE = 400  # longer strings are compared raw; normalising them buys nothing
MAX_PARSE = 400  # longer answers are compared as strings only
MAX_DEPTH = 40  # nesting depth of brackets / \frac the parser follows
MAX_DIGITS = 300  # digits in one literal (also keeps int() far from its 4300-digit limit)
MAX_BITS = 20_000  # exact values larger than this are refused (2^{10^9} must not be computed)
MAX_ITEMS = 32  # elements of a list, set, tuple or matrix
MAX_BOXES = 8  # boxes read together as one list
MAX_VARS = 8
REL_TOL = 1e-6  # rounded decimals: 0.3333333 for 1/3, 1.414214 for \sqrt{2}
FLOAT_TOL = 1e-9  # two computed values (2\sqrt{3} vs \sqrt{12}): only float noise
ABS_TOL = 1e-12  # \sin\pi vs 0

# Commas only in groups of 3 (unambiguous), LaTeX's {,} too; {,} also as a decimal comma (1{,}5).
_NUM = r"-?(?:\d+(?:(?:,|\{,\})\d{3})*(?:(?:\.|\{,\})\d+)?|\.\d+)"
_NUMBER = re.compile(rf"(?<![A-Za-z]){_NUM}(?:/\d+(?:\.\d+)?)?")  # "1/2" is one answer, not "2"
# The last-number rule reads digits joined by commas whole: "1,5" is 1.5 or the list 1, 5, never 5.
_LAST_NUMBER = re.compile(rf"(?<![A-Za-z]){_NUM}(?:,\d+)*(?:/\d+(?:\.\d+)?)?")
_BOX_OR_BRACE = re.compile(r"\\(?:boxed|fbox)\s*\{|[{}]")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is", "final answer:", "Answer =", and the "Q: ... A: ..." convention.
_PHRASE = re.compile(r"(?i:answer)[ \t]*(?:(?i:is)\b[ \t]*:?|[:=])|\bA:")
_LEAD_NUMBER = re.compile(rf"\$?\s*({_NUM})(?:\s*\\?%)?(?:\s+[A-Za-z].*)?")  # "18 dollars"
# A word outside commands and \text{}: 3+ letters, or a common 2-letter one ("It is 54." is no product
# I*t*i*s*54). Not "or": "1 or 2" is a list of answers.
_PROSE = re.compile(r"(?<![\\A-Za-z])(?:[A-Za-z]{3,}"
                    r"|(?i:is|it|so|be|as|to|we|an|at|by|if|of|on|no|do|he|us)(?![A-Za-z]))")
_ENVIRONMENT = re.compile(r"\\(?:begin|end)\{\w+\*?\}")
_DIGIT = re.compile(r"\d")

# ------------------------------------------------------------------ string normal form (MATH)
_UNIT_TEXT = re.compile(r"\\(?:text|mbox)\{\s[^{}]*\}(?:\^\{?\d\}?)?")  # "5 \text{ cm}^2"
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|(?<!\\)\\[!,;: ]|\^\{?\\circ\}?|\\?%|\\?\$|\s")
_FRAC_ARGS = re.compile(r"\\frac(\{[^{}]*\}|\w)(\{[^{}]*\}|\w)")  # \frac12, \frac{270}7, \frac9{19}
_SQRT = re.compile(r"\\sqrt(\w)")
_LEAD_DOT = re.compile(r"(?<!\d)\.(?=\d)")
# No number starts with 0 and a thousands group: 0,111 is a decimal comma, 0.111.
_THOUSANDS = re.compile(r"-?[1-9]\d{0,2}(?:,\d{3})+(?:\.\d+)?")
_COMMA_NUMBER = re.compile(r"-?\d+,\d+")
_LETTER_CHOICE = re.compile(r"\(([A-Z])\)")
_DIGIT_SPACE = re.compile(r"(?<=\d)\s+(?=\d)")
_SPACED_THOUSANDS = re.compile(r"(?<![\d.])[1-9]\d{0,2}(?: \d{3})+(?![\d.])")
_SPELLINGS = (("\\dfrac", "\\frac"), ("\\tfrac", "\\frac"), ("\\cfrac", "\\frac"),
              ("\u2212", "-"))  # one spelling of each, in the normal form and for the parser alike
_BRACED_COMMA = re.compile(r" ?\{ ?, ?\} ?")  # LaTeX's {,} (14{,}916), with the spaces math mode ignores
_BRACED_DECIMAL = re.compile(r"(?<=\d) ?\{ ?, ?\} ?(?=\d)(?!\d{3}(?!\d))")  # 1{,}5, 3{,}1416


def _boxes(text: str) -> list[tuple[int, str]]:
    """(start, content) of every balanced \\boxed{...} / \\fbox{...}, in one linear scan."""
    found, stack = [], []
    for m in _BOX_OR_BRACE.finditer(text):
        token = m.group()
        if token == "{":
            stack.append(-1)
        elif token != "}":
            stack.append(m.end())
        elif stack:
            start = stack.pop()
            if start >= 0:
                found.append((start, text[start : m.start()]))
    return sorted(found)


def _last_boxed(text: str, boxes: list[tuple[int, str]]) -> str | None:
    """Content of the last balanced box, or the token after a later "\\boxed 5"."""
    start = max(text.rfind("\\boxed "), text.rfind("\\fbox "))
    if start >= 0 and (not boxes or start > boxes[-1][0]):
        token = text[start + 6 : start + 6 + MAX_SNIPPET].split(None, 1)
        if token and token[0].split("$")[0]:  # Hendrycks takes the token up to "$"
            return token[0].split("$")[0]
    return boxes[-1][1] if boxes else None


def _clean_snippet(snippet: str) -> str | None:
    """Trim an answer phrase's tail to the answer: one sentence, a bare leading number."""
    s = snippet[:MAX_SNIPPET].strip().strip("*").strip()
    if not s.startswith("$") and s.count("$") >= 2 and not s.split("$")[-1].strip(" .,;!"):
        return s.split("$")[-2].strip() or None  # "is the point $(3,-1)$."
    s = s.split(". ", 1)[0].rstrip(". ").strip("$").strip()
    lead = _LEAD_NUMBER.fullmatch(s)
    if lead:
        return lead.group(1)
    if "$" in s and not _is_formula(s):  # "The volume of $ABCH$ is 120": the number
        numbers = _NUMBER.findall(s)
        return numbers[-1] if numbers else None
    return s or None


def _is_formula(s: str) -> bool:
    """No words outside LaTeX commands, environments and \\text{} (which may hold units)."""
    return not _PROSE.search(_TEXT.sub("", _ENVIRONMENT.sub("", s)))


def _final_formula(text: str) -> str | None:
    """The last $...$ ($$...$$, \\(...\\), \\[...\\]) formula in the text, if no digit follows it."""
    tail = text[-2000:]
    close = max(tail.rfind("$"), tail.rfind("\\)"), tail.rfind("\\]"))
    if close < 0 or _DIGIT.search(tail, close):
        return None  # "costs $5 and $10": a later number, so these are dollars, not formulas
    if tail[close] == "$":
        end = close
        while end > 0 and tail[end - 1] == "$":  # "$$" closes display math
            end -= 1
        width = close + 1 - end
        start = tail.rfind("$" * width, 0, end)
    else:
        end, width = close, 2
        start = tail.rfind("\\(" if tail[close + 1] == ")" else "\\[", 0, end)
    content = tail[start + width : end].strip().rstrip(".,;") if start >= 0 else ""
    if not content or len(content) > MAX_SNIPPET or not _is_formula(content):
        return None
    return content


_NOT_NUMBER = re.compile(r"[^\d.,/-]")


def _last_match(pattern: re.Pattern, text: str) -> re.Match | None:
    """The last match, looked for in the tail first: 10^4 earlier matches cost nothing."""
    start = len(text) - 2_000
    if start > 0:  # begin between tokens, so a number is not cut in two
        cut = _NOT_NUMBER.search(text, start)
        start = cut.start() if cut else 0
    for begin in ((start, 0) if start > 0 else (0,)):
        last = None
        for last in pattern.finditer(text, begin):
            pass
        if last is not None:
            return last
    return None


def _extract(text: str) -> tuple[str | None, list[str]]:
    """(final answer, contents of all boxes) of a completion."""
    if not isinstance(text, str) or not text:
        return None, []
    text = text[-MAX_TEXT:]
    box_text = text[-MAX_BOX_TEXT:]
    boxes = _boxes(box_text)
    boxed = _last_boxed(box_text, boxes)
    if boxed is not None:
        return boxed.strip(), [b.strip() for _, b in boxes]
    for pattern in (_HASHES, _PHRASE):
        last = _last_match(pattern, text)
        if last is not None:
            tail = last.group(1) if pattern is _HASHES else text[last.end() :].split("\n", 1)[0]
            answer = _clean_snippet(tail)
            if answer is not None:
                return answer, []
    bare = text.strip().strip("$").strip()
    short = len(bare) <= MAX_SNIPPET and "\n" not in bare and "$" not in bare
    if short and _is_formula(bare):
        return bare or None, []  # the whole completion is a formula
    formula = _final_formula(text)
    if formula:
        return formula, []
    last_number = _last_match(_LAST_NUMBER, text)
    if last_number is None and short and len(bare.split()) <= 2:  # "odd", "Evelyn": a word answer
        return bare or None, []
    return (last_number.group() if last_number else None), []


def extract_answer(text: str) -> str | None:
    """The final answer stated in a completion, or None if it states none."""
    return _extract(text)[0]


def _braced_commas(s: str) -> str:
    """LaTeX's {,}: a thousands separator before a group of three digits (14{,}916), else a decimal
    comma (1{,}5 is 1.5; no one writes the list 1, 5 or the number 15 so)."""
    return _BRACED_COMMA.sub(",", _BRACED_DECIMAL.sub(".", s))


@lru_cache(maxsize=4096)  # golds repeat: every completion of a GRPO group shares one
def normalise(answer: str) -> str:
    """Canonical string form of an answer, following Hendrycks MATH ``_strip_string``."""
    s = answer.strip()
    if len(s) > MAX_NORMALISE:
        return s
    for old, new in _SPELLINGS:
        s = s.replace(old, new)
    s = _braced_commas(s)
    without_units = _UNIT_TEXT.sub("", s).strip()
    s = without_units if without_units else s  # "\text{ cm}" alone is the answer itself
    s = _TEXT.sub(r"\1", s)
    s = _SPACED_THOUSANDS.sub(lambda m: m.group().replace(" ", ""), s)  # "1 000" is 1000
    s = _DIGIT_SPACE.sub("\u00b7", s)  # but "2 3" is not 23
    spaced_comma = ", " in s  # "1, 000" is a list, not 1000
    s = _DROP.sub("", s)
    s = _FRAC_ARGS.sub(lambda m: "\\frac" + "".join(
        g if g.startswith("{") else "{" + g + "}" for g in m.groups()), s)
    s = _SQRT.sub(r"\\sqrt{\1}", s)
    s = _LEAD_DOT.sub("0.", s).rstrip(".")
    if s.count("=") == 1 and _LABEL.fullmatch(s.split("=")[0]):  # "x=5" -> "5"
        s = s.split("=")[1]
    if s.startswith(("x\\in", "k\\in")):  # "x \in [-2,7]" -> "[-2,7]"
        s = s[4:]
    if _THOUSANDS.fullmatch(s) and not spaced_comma:
        s = s.replace(",", "")
    return _LETTER_CHOICE.sub(r"\1", s)  # "\text{(C)}" -> "C"


# ------------------------------------------------------------------ cleaning for the parser
_REPLACEMENTS = _SPELLINGS + (
    ("\\dbinom", "\\binom"), ("\\tbinom", "\\binom"), ("\u00b7", "\\cdot"), ("\u00d7", "\\times"),
    ("\u00f7", "\\div"), ("\u2264", "\\le "), ("\u2265", "\\ge "),
    ("\u221e", "\\infty"), ("\u03c0", "\\pi"), ("\\leqslant", "\\le"), ("\\geqslant", "\\ge"),
    ("\\leq", "\\le"), ("\\geq", "\\ge"), ("<=", "\\le "), (">=", "\\ge "), ("\\lt", "<"),
    ("\\gt", ">"), ("\\lbrace", "\\{"), ("\\rbrace", "\\}"), ("\\lbrack", "["), ("\\rbrack", "]"),
    ("\\lvert", "|"), ("\\rvert", "|"), ("\\vert", "|"), ("\\langle", "("), ("\\rangle", ")"),
    ("\\displaystyle", ""), ("\\!", ""), ("\\neq", "\\ne "), ("!=", "\\ne "), ("\\approx", "="),
    ("\\$", ""), ("$", ""), ("\\infin", "\\infty"), ("\u00b0", "^\\circ"),
)
_DELIMITER = re.compile(r"(?<!\\)\\[()\[\]]")  # \( x \) and \[ x \] around a formula
_SIZING = re.compile(r"\\(?:left|right|[bB]igg?[lr]?)(?![A-Za-z])\.?")
_SPACE = re.compile(r"(?<!\\)\\[,;: ]|\\q?quad(?![A-Za-z])|~")
_DEGREES = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ(?![A-Za-z])|\\degree(?![A-Za-z])")
_CONNECTOR = re.compile(r"\\(?:text|textnormal|mbox|textrm)\{\s*(and|or)\s*\}|\s(and|or)\s")
_UNIT = re.compile(r"(?<=[\d})\]])\s*\\(?:text|textnormal|mbox|mathrm|textrm|textit|textbf)\{\s*"
                   r"[A-Za-z]{2,}[A-Za-z .]*\}(?:\s*\^\s*\{?\d\}?)?|(?<=[\d})])\s+[A-Za-z]{2,}"
                   r"(?:\s+[A-Za-z]{2,})*\.?(?:\s*\^\s*\{?\d\}?)?\s*$")
_WRAPPER = re.compile(
    r"\\(?:text|textnormal|textbf|textit|textrm|mbox|mathrm|mathbf|mathit|operatorname|boxed)"
    r"\s*\{([^{}]*)\}")
_PERCENT = re.compile(r"(?:\\?%|\s(?:percent|pct)\.?)\s*$")
_CHOICE = re.compile(r"\(?([A-E])[).:]?")
_PLAIN_FUNCTION = re.compile(r"(?<![\\A-Za-z])(sin|cos|tan|ln|log|exp|sqrt)(?![A-Za-z])")
_WORD = re.compile(r"(?<![\\A-Za-z])[A-Za-z]{3,}|(?<![\\A-Za-z])(?i:no|yes)(?![A-Za-z])")
_NAME = r"[A-Za-z](?:_\{?[\w,]+\}?)?"  # x, x_1, x_{12}, x_{1,2}
_VARIABLE = re.compile(_NAME + r"(?:\([^()]*\))?|\\[A-Za-z]+")  # bounded in 1 < x < 4, 0 < f(x) < 1
# The left side of "x = 5" when it only names the value: a name (x, f', \theta, \angle A, the segment
# AB, f(x)), a ratio of names (V_1:V_2), a length or size (|AB|; not |x|, whose equation has two
# solutions), or the names of a point, (x, y).
_ONE_LABEL = _NAME + r"'*|\\[A-Za-z]+|[A-Z]{2,3}|[A-Za-z]\([A-Za-z](?:,[A-Za-z])*\)"
_LABEL = re.compile(rf"(?:{_ONE_LABEL})(?::(?:{_ONE_LABEL}))*|\|[A-Z]{{1,3}}\||\([A-Za-z](?:,[A-Za-z])+\)")
_SET_BUILDER = re.compile(r"[A-Za-z]\s*(?:\\mid|\||:)(.+)", re.S)
_IN_PREFIX = re.compile(r"^(?:[A-Za-z]|\(\s*[A-Za-z](?:\s*,\s*[A-Za-z])+\s*\))\s*\\in(?![A-Za-z])")
_MATRIX_ENV = r"\{(?:[pbBvV]?matrix|array|smallmatrix)\}"
_MATRIX = re.compile(r"\\begin" + _MATRIX_ENV + r"(?:\{[^{}]*\})?(.*)\\end" + _MATRIX_ENV, re.S)
_RELATION = re.compile(r"\\le(?![A-Za-z])|\\ge(?![A-Za-z])|<|>")
_BACKSLASHES = re.compile(r"\\+")
_DOUBLED_COMMAND = re.compile(r"\\\\[A-Za-z]")


def _single_backslashes(s: str) -> str:
    """An answer escaped twice (a JSON string in a JSON string) has every backslash doubled:
    \\\\left( 3, -1 \\\\right). Halve them only when one doubles a command's backslash and every run
    of backslashes is even: an answer escaped once has lone ones (\\begin{pmatrix} x \\\\y ...), and
    its row breaks stay."""
    if _DOUBLED_COMMAND.search(s) and all(len(run) % 2 == 0 for run in _BACKSLASHES.findall(s)):
        return s.replace("\\\\", "\\")
    return s


@lru_cache(maxsize=8192)
def _clean(answer: str) -> str:
    """Drop LaTeX cosmetics (doubled backslashes, sizing, spacing, units, degrees, thousands separators)."""
    s = _single_backslashes(answer.strip())
    for old, new in _REPLACEMENTS:
        if old in s:
            s = s.replace(old, new)
    s = _braced_commas(s)
    s = _DELIMITER.sub("", s)
    s = _SIZING.sub("", s)
    s = _SPACE.sub(" ", s)
    s = _DEGREES.sub("", s)
    s = _CONNECTOR.sub(lambda m: "," if "and" in m.groups() else " \\cup ", s)  # "or": a set
    without_units = _UNIT.sub("", s).strip()
    s = without_units or s  # "\text{cm}" alone is the answer itself
    for _ in range(3):  # \textbf{\text{(C)}}: unwrap a few levels
        s = _WRAPPER.sub(r"\1", s)
    s = _PLAIN_FUNCTION.sub(r"\\\1", s)
    s = _SPACED_THOUSANDS.sub(lambda m: m.group().replace(" ", ""), s.strip())
    if _THOUSANDS.fullmatch(s):  # a bare "1,000" is a number, "(1,000)" is not
        s = s.replace(",", "")
    return s.strip()


# ------------------------------------------------------------------ formula parser
class _Refused(Exception):
    """A formula the parser does not read, or a value too large to compute."""


Value = Union[Fraction, complex, float]  # float only for +-infinity
Node = tuple

_TOKEN = re.compile(r"\s*(?:(\d+(?:\.\d*)?(?:[eE][-+]?\d+)?|\.\d+)|(\\[A-Za-z]+|\\[{}|])"
                    r"|([A-Za-z])|(\S))")
_FUNCTIONS = {
    "sin": cmath.sin, "cos": cmath.cos, "tan": cmath.tan, "ln": cmath.log, "exp": cmath.exp,
    "sec": lambda z: 1 / cmath.cos(z), "csc": lambda z: 1 / cmath.sin(z),
    "cot": lambda z: 1 / cmath.tan(z), "arcsin": cmath.asin, "arccos": cmath.acos,
    "arctan": cmath.atan, "sinh": cmath.sinh, "cosh": cmath.cosh, "tanh": cmath.tanh,
    "log": cmath.log,  # natural, as both sides are read the same way
}
_CONSTANTS = {"pi": complex(math.pi), "e": complex(math.e), "i": 1j}
_GREEK = frozenset("alpha beta gamma delta epsilon varepsilon zeta eta theta vartheta kappa "
                   "lambda mu nu xi rho sigma tau phi varphi chi psi omega Gamma Delta Theta "
                   "Lambda Xi Sigma Phi Psi Omega".split())
_PRODUCT = frozenset(("*", "\\cdot", "\\times", "\\ast"))
_QUOTIENT = frozenset(("/", "\\div"))


def _tokenize(s: str) -> list[tuple[str, str]]:
    tokens, pos = [], 0
    while pos < len(s):
        m = _TOKEN.match(s, pos)
        if m is None:  # only trailing spaces are left
            break
        pos = m.end()
        kind = ("num", "cmd", "var", "op")[m.lastindex - 1]
        if kind == "num" and len(m.group(1)) > MAX_DIGITS:
            raise _Refused("literal too long")
        tokens.append((kind, m.group(m.lastindex)))
    return tokens


class _Parser:
    """Recursive descent over tokens: expr = term (+|- term)*; term = signed (op? power)*."""

    def __init__(self, text: str) -> None:
        self.tokens = _tokenize(text)
        self.i = 0
        self.depth = 0

    def peek(self) -> tuple[str, str]:
        return self.tokens[self.i] if self.i < len(self.tokens) else ("end", "")

    def take(self) -> tuple[str, str]:
        token = self.peek()
        self.i += 1
        return token

    def expect(self, value: str) -> None:
        if self.take()[1] != value:
            raise _Refused(f"expected {value}")

    def parse(self) -> Node:
        node = self.expr()
        if self.i != len(self.tokens):
            raise _Refused("trailing tokens")
        return node

    def expr(self) -> Node:
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise _Refused("too deep")
        node = self.term()
        while self.peek()[1] in ("+", "-"):
            op = self.take()[1]
            node = ("add" if op == "+" else "sub", node, self.term())
        self.depth -= 1
        return node

    def starts_factor(self) -> bool:
        kind, value = self.peek()
        if kind in ("num", "var") or value in ("(", "{", "["):
            return True
        name = value[1:]
        return kind == "cmd" and (name in _FUNCTIONS or name in _CONSTANTS or name in _GREEK
                                  or name in ("frac", "sqrt", "infty", "binom", "log"))

    def term(self) -> Node:
        node = self.signed()
        while True:
            kind, value = self.peek()
            if value in _PRODUCT:
                self.take()
                node = ("mul", node, self.signed())
            elif value in _QUOTIENT:
                self.take()
                node = ("div", node, self.signed())
            elif self.starts_factor():
                if kind == "num" and self.tokens[self.i - 1][0] == "num":
                    raise _Refused("two numbers side by side")  # "2 3" is no product
                node = ("mul", node, self.power())
            else:
                return node

    def signed(self) -> Node:
        if self.peek()[1] in ("+", "-"):
            negative = self.take()[1] == "-"
            node = self.signed()
            return ("neg", node) if negative else node
        return self.power()

    def power(self) -> Node:
        base = self.postfix()
        if self.peek()[1] == "^":
            self.take()
            return ("pow", base, self.argument(signed=True))
        return base

    def postfix(self) -> Node:
        node = self.primary()
        while self.peek()[1] == "!":
            self.take()
            node = ("fact", node)
        return node

    def argument(self, signed: bool = False) -> Node:
        """A brace group or one token: \\frac12, x^2, \\sqrt3 (x^23 is x^2 * 3, as in LaTeX)."""
        kind, value = self.peek()
        if value == "{":
            self.take()
            node = self.expr()
            self.expect("}")
            return node
        if signed and value in ("+", "-"):
            self.take()
            node = self.argument()
            return ("neg", node) if value == "-" else node
        if kind == "num" and len(value) > 1:  # split off one digit, leave the rest
            self.tokens[self.i] = ("num", value[1:])
            return ("num", Fraction(value[0]))
        return self.primary()

    def primary(self) -> Node:
        kind, value = self.take()
        if kind == "num":
            return ("num", Fraction(value))
        if kind == "var":
            if value in ("e", "i"):
                return ("const", value)
            return ("var", value + self.subscript())
        if value in ("(", "[", "{"):
            self.depth += 1
            node = self.expr()
            self.depth -= 1
            self.expect({"(": ")", "[": "]", "{": "}"}[value])
            return node
        if value == "|":
            node = self.expr()
            self.expect("|")
            return ("abs", node)
        if kind != "cmd":
            raise _Refused(f"unexpected {value!r}")
        name = value[1:]
        if name == "frac":
            return ("div", self.argument(), self.argument())
        if name == "binom":
            return ("binom", self.argument(), self.argument())
        if name == "sqrt":
            index: Node = ("num", Fraction(2))
            if self.peek()[1] == "[":
                self.take()
                index = self.expr()
                self.expect("]")
            return ("root", self.argument(), index)
        if name == "infty":
            return ("inf",)
        if name in _CONSTANTS:
            return ("const", name)
        if name in _GREEK:
            return ("var", value + self.subscript())
        if name in _FUNCTIONS:
            return self.function(name)
        raise _Refused(f"unknown command {value}")

    def subscript(self) -> str:
        """x_1, x_{12}: a subscript is part of a variable's name."""
        if self.peek()[1] != "_":
            return ""
        self.take()
        if self.peek()[1] == "{":
            self.take()
            parts = []
            while self.peek()[1] not in ("}", ""):
                parts.append(self.take()[1])
            self.expect("}")
            return "_" + "".join(parts)
        return "_" + self.take()[1]

    def function(self, name: str) -> Node:
        """\\sin x, \\sin(2x), \\sin^2 x, \\log_2 8."""
        base = None
        if name == "log" and self.peek()[1] == "_":
            self.take()
            base = self.argument()
        exponent = None
        if self.peek()[1] == "^":
            self.take()
            exponent = self.argument(signed=True)
        if self.peek()[1] in ("(", "{", "["):
            arg = self.primary()
        else:  # \sin 2x: the argument is the product that follows
            arg = self.power()
            while self.peek()[0] in ("num", "var"):
                arg = ("mul", arg, self.power())
        node: Node = ("log", arg, base) if base is not None else ("fn", name, arg)
        return ("pow", node, exponent) if exponent is not None else node


# ------------------------------------------------------------------ evaluation
def _check(v: Value) -> Value:
    """Refuse values too large to keep exact (and non-finite floats)."""
    if isinstance(v, Fraction):
        if v.numerator.bit_length() + v.denominator.bit_length() > MAX_BITS:
            raise _Refused("value too large")
    elif isinstance(v, complex) and not (math.isfinite(v.real) and math.isfinite(v.imag)):
        raise _Refused("not finite")
    return v


def _exact_root(a: Fraction, n: int) -> Fraction | None:
    """The exact n-th root of a non-negative rational, if it is rational."""
    def int_root(k: int) -> int | None:
        if k.bit_length() > 2000:
            return None
        r = round(k ** (1.0 / n)) if k.bit_length() < 1000 else math.isqrt(k) if n == 2 else None
        if r is None:
            return None
        for c in (r - 1, r, r + 1):
            if c >= 0 and c ** n == k:
                return c
        return None
    p, q = int_root(a.numerator), int_root(a.denominator)
    return Fraction(p, q) if p is not None and q is not None else None


def _root(a: Value, n: Value) -> Value:
    if isinstance(n, Fraction) and n.denominator == 1 and 2 <= n <= 64 and isinstance(a, Fraction):
        exact = _exact_root(abs(a), int(n))
        if a >= 0 and exact is not None:
            return exact
        if a < 0 and n % 2 == 1:  # real odd root: \sqrt[3]{-8} = -2
            return -exact if exact is not None else -complex(float(-a) ** (1 / float(n)))
    return _power(a, 1 / n)


def _power(a: Value, b: Value) -> Value:
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if b.denominator == 1:
            size = max(a.numerator.bit_length(), a.denominator.bit_length())
            if abs(b.numerator) * size > MAX_BITS:
                raise _Refused("power too large")  # 9^{9^{9}}: refused before computing
            return a ** b.numerator
        if a > 0 and b.denominator <= 64:  # 8^{2/3} = 4 exactly
            root = _exact_root(a, b.denominator)
            if root is not None:
                return _power(root, Fraction(b.numerator))
    if isinstance(b, Fraction) and abs(b) > 10_000:
        raise _Refused("power too large")
    return complex(a) ** complex(b)


def _eval(node: Node, env: dict[str, Value]) -> Value:
    tag = node[0]
    if tag == "num":
        return node[1]
    if tag == "var":
        return env[node[1]]
    if tag == "const":
        return _CONSTANTS[node[1]]
    if tag == "inf":
        return math.inf
    if tag == "neg":
        return -_eval(node[1], env)
    if tag in ("fn", "log"):
        arg = _eval(node[2] if tag == "fn" else node[1], env)
        if isinstance(arg, float):
            raise _Refused("function of infinity")
        if tag == "log":
            base = _eval(node[2], env)
            return _check(cmath.log(complex(arg)) / cmath.log(complex(base)))
        return _check(complex(_FUNCTIONS[node[1]](complex(arg))))
    if tag == "abs":
        v = _eval(node[1], env)
        return abs(v) if isinstance(v, Fraction) else complex(abs(v))
    if tag == "fact":
        v = _eval(node[1], env)
        if not (isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= 170):
            raise _Refused("factorial of a non-integer or a large number")
        return Fraction(math.factorial(int(v)))
    a, b = _eval(node[1], env), _eval(node[2], env)
    if isinstance(a, float) or isinstance(b, float):
        raise _Refused("arithmetic with infinity")
    if tag == "add":
        return _check(a + b)
    if tag == "sub":
        return _check(a - b)
    if tag == "mul":
        return _check(a * b)
    if tag == "div":
        return _check(a / b)
    if tag == "pow":
        return _check(_power(a, b))
    if tag == "root":
        return _check(_root(a, b))
    if tag == "binom":
        if not all(isinstance(v, Fraction) and v.denominator == 1 and 0 <= v <= 1000 for v in (a, b)):
            raise _Refused("binomial of non-integers")
        return Fraction(math.comb(int(a), int(b)))
    raise _Refused(f"unknown node {tag}")


def _variables(node: Node) -> frozenset[str]:
    if node[0] == "var":
        return frozenset((node[1],))
    found = frozenset()
    for child in node[1:]:
        if isinstance(child, tuple):
            found |= _variables(child)
    return found


# Distinct rationals: variable j takes _POINTS[(j + 3k) % 11] at point k (deterministic).
_POINTS = tuple(Fraction(p, q) for p, q in ((3, 7), (11, 13), (-5, 17), (19, 23), (29, 11),
                                            (-31, 37), (41, 19), (7, 43), (-47, 29), (53, 59),
                                            (61, 31)))


def _close(a: Value, b: Value) -> bool:
    """Exact for integers, relative 1e-6 for rounded decimals, 1e-9 for computed values."""
    if isinstance(a, float) or isinstance(b, float):  # +-infinity
        return a == b
    if isinstance(a, Fraction) and isinstance(b, Fraction):
        if a == b:
            return True
        if a.denominator == 1 or b.denominator == 1:
            return False  # 999999.5 is not 1000000
        return abs(a - b) <= REL_TOL * max(abs(a), abs(b))
    rounded = any(isinstance(v, Fraction) and v.denominator != 1 for v in (a, b))
    tol = REL_TOL if rounded else FLOAT_TOL
    za, zb = complex(a), complex(b)
    return abs(za - zb) <= max(tol * max(abs(za), abs(zb)), ABS_TOL)


# ------------------------------------------------------------------ structured answers
class Formula(NamedTuple):
    ast: Node
    names: frozenset[str]  # its variables
    value: Value | None  # computed once when read, if it has no variables


class Seq(NamedTuple):
    """Several answers. A tuple, (1, 2) or the interval [1, 4), is ordered and its brackets count;
    a set, \\{1, 2\\} or 1 \\pm 2 or x = 1 or x = 2, is not ordered. A bare list 1, 2 is either: a
    set written without braces, or a point without its parentheses."""
    kind: str  # "tuple", "set" or "list"
    brackets: str  # a tuple's, "()" or "[)" ...; "" for a set or a list
    items: list[Answer]


class Matrix(NamedTuple):
    rows: list[list[Answer]]


class Equation(NamedTuple):
    lhs: Answer | None  # None when the parser does not read it
    rhs: Answer
    names_value: bool  # "x = 5", "a = b = 5": the right side is the answer


class Text(NamedTuple):
    key: str  # lower case, letters and digits only: "Evelyn" and "\text{evelyn}" agree


class AnyOf(NamedTuple):
    options: list[Answer]  # readings that are all right: 50% is 50 and 0.5


class Raw(NamedTuple):
    form: str  # the normal form of an answer nothing above reads


Answer = Union[Formula, Seq, Matrix, Equation, Text, AnyOf, Raw]


def _is_number(node: Node) -> bool:
    """A number written out, with no arithmetic left to do: 12, -3, 0.25, 3/4, \\frac{-2}{3}, 2.5 \\times
    10^{-5}. A gold that is one is matched only by one: a policy rewarded for 551 * 65 against 35815 learns to
    restate the question's arithmetic instead of doing it (DAPO did, within 40 steps: docs/results.md)."""
    tag = node[0]
    if tag == "neg":
        return _is_number(node[1])
    if tag == "div":  # a fraction of integers (a decimal is already one "num")
        return node[2][0] == "num" and (node[1][0] == "num" or node[1][0] == "neg" and node[1][1][0] == "num")
    if tag == "mul":  # scientific notation
        return _is_number(node[1]) and _is_power_of_ten(node[2])
    return tag == "num" or _is_power_of_ten(node)


def _is_power_of_ten(node: Node) -> bool:
    """10^k for an integer k: 10^{-4}, the exponent of scientific notation."""
    if node[0] != "pow" or node[1] != ("num", 10):
        return False
    exponent = node[2][1] if node[2][0] == "neg" else node[2]
    return exponent[0] == "num" and exponent[1].denominator == 1


def _formula_equal(a: Formula, b: Formula) -> bool:
    """Same value, or for formulas with variables, the same value at three fixed points."""
    if a.value is not None and b.value is not None:
        return _close(a.value, b.value)
    names = sorted(a.names | b.names)
    if len(names) > MAX_VARS:
        return False
    try:
        for k in range(3):
            env = {n: _POINTS[(j + 3 * k) % len(_POINTS)] for j, n in enumerate(names)}
            if not _close(_eval(a.ast, env), _eval(b.ast, env)):
                return False
    except (_Refused, ArithmeticError, ValueError, TypeError, KeyError):
        return False
    return True


def _split_top(s: str, sep: str) -> list[str]:
    """Split on `sep` outside (), [], {}, \\{\\} (any closer closes any opener: [1, 4) is balanced)."""
    parts, depth, start, i, n = [], 0, 0, 0, len(sep)
    word = sep[-1].isalpha()  # "\\cup" must not split "\\cupcake"
    while i < len(s):
        if depth == 0 and s.startswith(sep, i) and not (word and s[i + n : i + n + 1].isalpha()):
            parts.append(s[start:i])
            i += n
            start = i
            continue
        ch = s[i]
        if ch == "\\":  # an escaped pair: only \\{ and \\} nest
            nxt = s[i + 1 : i + 2]
            depth += (nxt == "{") - (nxt == "}")
            i += 2
            continue
        depth += (ch in "([{") - (ch in ")]}")
        i += 1
    return parts + [s[start:]]


def _closing(s: str, start: int) -> int:
    """Index of the bracket closing the one at s[start] (any closer), or -1."""
    depth = 0
    for i in range(start, len(s)):
        if s[i] in "([{":
            depth += 1
        elif s[i] in ")]}":
            depth -= 1
            if depth == 0:
                return i
    return -1


def _list_parts(s: str) -> list[str]:
    """The items of a list: split on semicolons if there are any (1,5; 2,5 has decimal commas)."""
    parts = _split_top(s, ";")
    return parts if len(parts) > 1 else _split_top(s, ",")


def _items(parts: list[str], depth: int) -> list[Answer] | None:
    if len(parts) > MAX_ITEMS:
        return None
    items = [_structure(p, depth + 1) for p in parts]
    return None if any(x is None for x in items) else items


def _inequality(s: str, depth: int) -> Answer | None:
    """1 \\le x < 4 -> [1, 4); x > 2 -> (2, \\infty); 3 \\ge x -> (-\\infty, 3]."""
    pieces = _RELATION.split(s)
    ops = _RELATION.findall(s)
    strip = [p.strip() for p in pieces]
    is_var = [bool(_VARIABLE.fullmatch(p)) and p not in ("\\infty", "\\pi") for p in strip]
    less = [op in ("<", "\\le") for op in ops]
    closed = [op in ("\\le", "\\ge") for op in ops]
    if len(ops) == 2 and is_var[1] and less[0] == less[1]:
        lo, hi, lo_closed, hi_closed = strip[0], strip[2], closed[0], closed[1]
        if not less[0]:
            lo, hi, lo_closed, hi_closed = hi, lo, hi_closed, lo_closed
    elif len(ops) == 1 and (is_var[0] or is_var[1]):
        value, closed_end = (strip[1], closed[0]) if is_var[0] else (strip[0], closed[0])
        upper = less[0] == is_var[0]  # x < 3 or 3 > x: 3 is the upper end
        lo, hi = ("-\\infty", value) if upper else (value, "\\infty")
        lo_closed, hi_closed = (False, closed_end) if upper else (closed_end, False)
    else:
        return None
    ends = _items([lo, hi], depth)
    if ends is None:
        return None
    return Seq("tuple", ("[" if lo_closed else "(") + ("]" if hi_closed else ")"), ends)


def _formula(s: str) -> Answer | None:
    try:
        ast = _Parser(s).parse()
    except (_Refused, ValueError, ZeroDivisionError, IndexError):
        return None
    names = _variables(ast)
    value = None
    if not names:
        try:
            value = _eval(ast, {})
        except (_Refused, ArithmeticError, ValueError, TypeError):
            return None
    return Formula(ast, names, value)


def _matrix(body: str, depth: int) -> Answer | None:
    rows = [r for r in _split_top(body, "\\\\") if r.strip()]
    if not rows or len(rows) > MAX_ITEMS:
        return None
    cells = [_items(_split_top(r, "&"), depth) for r in rows]
    if any(c is None for c in cells) or len({len(c) for c in cells}) != 1:
        return None
    return Matrix(cells)


def _structure(s: str, depth: int) -> Answer | None:
    """Read one cleaned answer (see the module docstring for the order of these rules)."""
    s = s.strip().rstrip(".").strip()
    if not s or depth > 4:
        return None
    bare = "list"
    while s.startswith("{") and _closing(s, 0) == len(s) - 1:
        s, bare = s[1:-1].strip(), "set"  # {1, 3}: a set with its braces unescaped, not a list
    m = _MATRIX.fullmatch(s) or (s[:1] in "([" and _MATRIX.fullmatch(s[1:-1].strip()))
    if m:
        return _matrix(m.group(1), depth)
    for sign in ("\\pm", "\\mp"):
        if sign in s:
            plus, minus = s.replace(sign, "+", 1), s.replace(sign, "-", 1)
            items = _items([plus, minus], depth)
            return Seq("set", "", items) if items else None
    if _COMMA_NUMBER.fullmatch(s):  # 1,22: a decimal comma (as in 1,5; 2,5), or the list 1, 22
        if _THOUSANDS.fullmatch(s):  # 1,000 stays one thousand (_clean reads a bare one)
            return _formula(s.replace(",", ""))
        decimal = _formula(s.replace(",", "."))
        return AnyOf([decimal, Seq(bare, "", _items(s.split(","), depth))])
    for sep in ("\\cup", ";", ","):  # _clean wrote "or" as \cup and "and" as a comma
        parts = _split_top(s, sep)
        if len(parts) > 1 and all(p.strip() for p in parts):
            if sep != "\\cup" and s[0] in "([" and _closing(s, 0) == len(s) - 1:
                break  # a tuple or interval, read below
            items = _items(parts, depth)
            return Seq("set" if sep == "\\cup" else bare, "", items) if items else None
    if s.startswith("\\{") and s.endswith("\\}"):
        rule = _SET_BUILDER.fullmatch(s[2:-2].strip())
        if rule:  # \{x \mid -2 \le x \le 7\}: the interval of its condition
            return _structure(rule.group(1), depth + 1)
        items = _items(_list_parts(s[2:-2]), depth)
        return Seq("set", "", items) if items else None
    if _IN_PREFIX.match(s):
        return _structure(_IN_PREFIX.sub("", s), depth)
    sides = _split_top(s, "=")
    if len(sides) > 1:  # x = 5, f(x) = ..., a = b = 5
        lhs, rhs = _structure(sides[0], depth + 1), _structure(sides[-1], depth + 1)
        value = bool(_LABEL.fullmatch(re.sub(r"\s", "", sides[0]))) or len(sides) > 2
        return Equation(lhs, rhs, value) if rhs and (lhs or value) else None
    if _RELATION.search(s):
        return _inequality(s, depth)
    if s[0] in "([" and _closing(s, 0) == len(s) - 1 and len(_list_parts(s[1:-1])) > 1:
        items = _items(_list_parts(s[1:-1]), depth)
        return Seq("tuple", s[0] + s[-1], items) if items else None
    if _PERCENT.search(s):
        base = _PERCENT.sub("", s).strip()
        options = [x for x in (_structure(base, depth + 1),
                               _formula(f"({base})/100")) if x is not None]
        return AnyOf(options) if options else None
    choice = _CHOICE.fullmatch(s)
    if choice:
        return _formula(choice.group(1))
    if _WORD.search(s):  # a word, not a product of letters: "odd", "Evelyn"
        return Text(re.sub(r"[^a-z0-9]", "", s.lower()))
    return _formula(s) or Raw(normalise(s))


@lru_cache(maxsize=8192)  # golds repeat across a group; completions are short
def _interpret(answer: str) -> Answer | None:
    if len(answer) > MAX_PARSE:
        return None
    return _structure(_clean(answer), 0)


def _proportional(a: Equation, b: Equation) -> bool:
    """Equations with the same solutions up to scale: 2x + 4y - 3 = 0 and y = -x/2 + 3/4."""
    if not all(isinstance(side, Formula) for side in (a.lhs, a.rhs, b.lhs, b.rhs)):
        return False
    da, db = ("sub", a.lhs.ast, a.rhs.ast), ("sub", b.lhs.ast, b.rhs.ast)
    names = sorted(a.lhs.names | a.rhs.names | b.lhs.names | b.rhs.names)
    if not names or len(names) > MAX_VARS:
        return False
    try:
        ratios = []
        for k in range(3):
            env = {n: _POINTS[(j + 3 * k) % len(_POINTS)] for j, n in enumerate(names)}
            ratios.append(_eval(da, env) / _eval(db, env))
        return ratios[0] != 0 and all(_close(r, ratios[0]) for r in ratios[1:])
    except (_Refused, ArithmeticError, ValueError, TypeError, KeyError):
        return False


def _multiset_equal(xs: list[Answer], ys: list[Answer]) -> bool:
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:  # greedy matching is enough: equal answers are (nearly) transitive
        for j, y in enumerate(left):
            if _same(x, y):
                del left[j]
                break
        else:
            return False
    return True


def _numbered(labels: list[Answer | None]) -> bool:
    """x_1, x_2, ...: the solutions of one unknown, numbered in no particular order."""
    names = [x.ast[1] if isinstance(x, Formula) and x.ast[0] == "var" else "" for x in labels]
    return all("_" in n for n in names) and len({n.partition("_")[0] for n in names}) == 1


def _unordered_equal(xs: list[Answer], ys: list[Answer]) -> bool:
    """Multisets. Values under the same labels pair by label: AB=5, CD=4 is not AB=4, CD=5 (but
    AB=4, CD=5 is 4, 5; y = 5 is x = 5; and the roots x_1, x_2 may come in either order)."""
    labels = [v.lhs for v in xs + ys if isinstance(v, Equation) and v.names_value]
    if (len(labels) == len(xs) + len(ys) and not _numbered(labels)
            and _multiset_equal(labels[: len(xs)], labels[len(xs) :])):
        xs, ys = ([Seq("tuple", "()", [v.lhs, v.rhs]) for v in vs] for vs in (xs, ys))
    return _multiset_equal(xs, ys)


def _same(a: Answer | None, b: Answer | None) -> bool:
    """Structural equality of two interpreted answers: a the completion's, b the gold's (not symmetric: a gold
    written as a number is matched only by a number)."""
    if a is None or b is None:
        return False
    if isinstance(a, AnyOf):
        return any(_same(x, b) for x in a.options)
    if isinstance(b, AnyOf):
        return any(_same(a, y) for y in b.options)
    # Equations; `a` is always the completion's side. A stated "... = 5" matches the gold 5;
    # the gold "7 = 11a + c" is an equation, so "11a + c" does not match it, but "x = 5" does.
    a_eq, b_eq = isinstance(a, Equation), isinstance(b, Equation)
    if a_eq and (not b_eq or (a.names_value and b.names_value and _same(a.rhs, b.rhs))):
        return _same(a.rhs, b)
    if b_eq and not a_eq:
        return b.names_value and _same(a, b.rhs)
    if isinstance(a, Seq) and isinstance(b, Seq):
        kinds = {a.kind, b.kind}
        if "tuple" not in kinds:  # sets and bare lists: any order
            return _unordered_equal(a.items, b.items)
        if kinds == {"tuple"}:
            in_order = a.brackets == b.brackets  # (1, 4] is not [1, 4]
        else:  # a tuple is not a set; a bare list 3, 5 is the point (3, 5), in order, and no interval
            in_order = kinds == {"tuple", "list"} and "()" in (a.brackets, b.brackets)
        return in_order and len(a.items) == len(b.items) and all(
            _same(x, y) for x, y in zip(a.items, b.items))
    if isinstance(a, Seq) and a.kind == "set" and len(a.items) == 1:  # \{2\} is the answer 2
        return _same(a.items[0], b)
    if isinstance(b, Seq) and b.kind == "set" and len(b.items) == 1:
        return _same(a, b.items[0])
    if type(a) is not type(b):  # a Text and a Raw of the same string still differ
        return False
    if isinstance(a, Formula):
        if _is_number(b.ast) and not _is_number(a.ast):  # "What is 551 * 65?" is not answered by 551 * 65
            return False
        return _formula_equal(a, b)
    if isinstance(a, Matrix):
        return len(a.rows) == len(b.rows) and all(len(r) == len(s) and all(
            _same(x, y) for x, y in zip(r, s)) for r, s in zip(a.rows, b.rows))
    if isinstance(a, Equation):
        return (_same(a.lhs, b.lhs) and _same(a.rhs, b.rhs)) or (
            _same(a.lhs, b.rhs) and _same(a.rhs, b.lhs)) or _proportional(a, b)
    return a == b  # Text and Raw: the same key or normal form


def _matches(predicted: str, gold: str) -> bool:
    if normalise(predicted) == normalise(gold):
        return True
    return _same(_interpret(predicted), _interpret(gold))


def _joined(boxes: list[str]) -> str | None:
    """Several boxes as one list: each box is one answer of several (its commas may be decimal)."""
    return "; ".join(boxes) if 1 < len(boxes) <= MAX_BOXES else None


def verify(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer matches the gold answer, else 0.0. Never raises."""
    try:
        if isinstance(answer, (int, float)):
            answer = str(answer)
        if not isinstance(answer, str) or not answer.strip():
            return 0.0
        predicted, boxes = _extract(completion)
        if predicted is None:
            return 0.0
        gold = answer.strip()
        if "\\boxed" in gold or "\\fbox" in gold:  # a gold solution: read it like a completion
            boxed, gold_boxes = _extract(gold)
            gold = _joined(gold_boxes) or boxed or gold
        if predicted == gold or _matches(predicted, gold):  # verbatim first: the common case
            return 1.0
        joined = _joined(boxes)  # "\boxed{3} and \boxed{5}" for the gold "3, 5"
        return 1.0 if joined and _matches(joined, gold) else 0.0
    except Exception:  # a reward function must not crash a training run
        return 0.0


# ------------------------------------------------------------------ pluggable rewards
def _math_verify_reward() -> Callable[[str, str], float]:
    try:
        from math_verify import parse, verify as mv_verify
    except ImportError as err:
        raise ImportError("reward 'math-verify' needs the optional package: "
                          "pip install math-verify") from err

    def reward(completion: str, gold: str) -> float:
        """math-verify's documented use: the gold wrapped in $...$ so it is read as LaTeX."""
        try:
            gold_text = gold if "$" in gold or "\\boxed" in gold else f"${gold}$"
            return 1.0 if mv_verify(parse(gold_text), parse(completion)) else 0.0
        except Exception:  # never crash a training run
            return 0.0

    return reward


Reward = Callable[[list[str], list[str], list[str]], list[float]]  # (questions, completions, golds) -> [N]
TRL_GOLD = "solution"  # the keyword a TRL-style function gets the golds under (as TRL's accuracy_reward)


def reward_range(text: str) -> tuple[float, float]:
    """The --reward-range flag, "lo,hi": two finite numbers, lo < hi (argparse names the flag otherwise)."""
    low, high = (float(x) for x in text.split(","))
    if not (math.isfinite(low) and math.isfinite(high) and low < high):
        raise ValueError(f"need finite lo < hi; got {text!r}")
    return low, high


class RewardError(ValueError):
    """A reward that is not a finite number inside the declared range: one line, and the run stops."""


REWARD_TIMEOUT = 5.0  # seconds a reward call may take (--reward-timeout); math-verify's own default


def load_reward(spec: str = "verifier", reward_range: tuple[float, float] = (0.0, 1.0),
                time_limit: float = REWARD_TIMEOUT, counts: Counter | None = None) -> Reward:
    """The rewards of a batch of completions, checked where they enter (`checked`), from a spec: "verifier"
    (this module's ``verify``), "math-verify" (the optional package, imported only when asked), or
    "module:function", a user's function of either shape, told apart by its signature:

    - ``f(completion, gold) -> float``, called once per completion;
    - TRL's ``f(prompts, completions, **kwargs) -> list[float]`` (it has a ``completions`` parameter),
      called once per batch with the keywords it accepts: ``prompts`` and ``completions`` as TRL passes
      them for a conversational dataset (each a list of {"role", "content"} messages; our prompts go
      through the chat template) and the golds as ``solution=``; a None in what it returns scores 0, with
      a warning the first time (TRL's convention: the reward does not apply).

    A bad spec, or a function of neither shape, raises ValueError in one line naming what was expected; a
    module that does not import (a SyntaxError, a NameError) too, naming file:line. Ctrl-C or SIGTERM while
    the module imports (one that hangs) ends the process with one line and exit code 130 or 143.

    Any reward but the verifier (pure Python, bounded work: it runs here) runs in a process of its own
    (`RewardWorker`), each call limited to `time_limit` seconds: a call past it scores 0, and its
    completions are added to counts["reward_timeouts"]. time_limit 0: no limit, the reward runs here.

    >>> load_reward()(["What is 2 + 3?"] * 2, ["\\boxed{5}", "6"], ["5", "5"])
    [1.0, 0.0]
    """
    reward, one_by_one = _batch_reward(spec)  # a bad spec fails here, in one line
    if time_limit and spec not in VERIFIER:
        reward = RewardWorker(str(spec), time_limit, one_by_one, counts)
    return checked(reward, str(spec), reward_range)


VERIFIER = ("verifier", "", None)  # the specs of this module's `verify`


def _batch_reward(spec: str) -> tuple[Reward, bool]:
    """The unchecked batch reward of a spec (`load_reward`), and whether it calls a function once per
    completion (else once per batch, TRL's way)."""
    if spec in VERIFIER:
        return per_completion(verify), True
    if spec in ("math-verify", "math_verify"):
        return per_completion(_math_verify_reward()), True
    module_name, sep, attr = str(spec).partition(":")
    if not sep or not module_name or not attr:
        raise ValueError(f"reward spec {spec!r}: expected 'verifier', 'math-verify' or "
                         "'module:function'")
    try:
        with _interruptible():
            module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(f"reward spec {spec!r}: no module {module_name!r} ({err})") from err
    except KeyboardInterrupt as err:  # a signal while it hangs: comes before the scripts' own handlers
        signum, name = _signal_of(err)
        print(f"interrupted ({name}) while importing the reward module {module_name!r}, at {_where(err)}",
              file=sys.stderr)
        sys.exit(128 + signum)
    except Exception as err:  # the module's bug (SyntaxError, NameError, ...): where it is, not a traceback
        what = err.msg if isinstance(err, SyntaxError) else err
        raise ValueError(f"reward spec {spec!r}: the module {module_name!r} does not import: {_where(err)}: "
                         f"{type(err).__name__}: {what}") from None
    fn = getattr(module, attr, None)
    if fn is None:
        raise ValueError(f"reward spec {spec!r}: module {module_name!r} has no function {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward spec {spec!r}: {module_name}.{attr} is not callable")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # a builtin without one: trust it to be f(completion, gold)
        return per_completion(fn, spec), True
    if "completions" in signature.parameters:
        return _trl_style(fn, signature, spec), False
    try:
        signature.bind("completion", "gold")
    except TypeError:
        raise ValueError(f"reward spec {spec!r}: {attr}{signature} is neither f(completion, gold) -> float "
                         "nor TRL's f(prompts, completions, **kwargs) -> list[float]") from None
    return per_completion(fn, spec), True


@contextlib.contextmanager
def _interruptible():
    """Inside the block a first Ctrl-C or SIGTERM raises KeyboardInterrupt(its number), whatever handler the
    script set: train.py's only asks its loop to stop, which an import that never returns never reaches."""
    if threading.current_thread() is not threading.main_thread():  # only the main thread gets signals
        yield
        return

    def interrupt(signum, frame):
        raise KeyboardInterrupt(signum)

    previous = {signum: signal.signal(signum, interrupt) for signum in (signal.SIGINT, signal.SIGTERM)}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _signal_of(err: KeyboardInterrupt) -> tuple[int, str]:
    """The signal that `_interruptible` raised `err` for: its number, and its name as a user knows it."""
    signum = err.args[0] if err.args else signal.SIGINT
    return signum, "Ctrl-C" if signum == signal.SIGINT else signal.Signals(signum).name


def _where(err: BaseException) -> str:
    """file:line where an exception arose: a SyntaxError's own, else its traceback's innermost frame."""
    if isinstance(err, SyntaxError):
        return f"{err.filename}:{err.lineno}"
    frame = traceback.extract_tb(err.__traceback__)[-1]
    return f"{frame.filename}:{frame.lineno}"


def per_completion(fn: Callable[[str, str], float], spec: str = "verifier") -> Reward:
    """A batch reward from f(completion, gold) -> float, called once per completion, each value made a float
    at the call (`as_float`). If it raises (a bug in a user's reward): RewardError (`raised`)."""
    def reward(questions: list[str], completions: list[str], golds: list[str]) -> list[float | str]:
        rewards = []
        for question, completion, gold in zip(questions, completions, golds):
            try:
                rewards.append(as_float(fn(completion, gold)))
            except Exception as err:
                raise raised(spec, err, f"the completion {completion[:60]!r} of problem {question[:60]!r}, "
                                        f"gold {gold[:60]!r}") from None
        return rewards
    return reward


def as_float(value) -> float | str:
    """A reward's value as a Python float, made where the reward returns it: in a reward's own process before
    it crosses the pipe, where a tensor would cross as shared memory, and fail. Real numbers of any kind
    count, as in TRL: Python's (bool too), numpy's scalars (numpy.bool_ too) and 0-d tensors on any device.
    Anything else comes back as a description ("'1', a str, not a number"), for `checked` to refuse."""
    if getattr(value, "ndim", None) == 0 and hasattr(value, "item"):
        value = value.item()  # a numpy scalar or 0-d array; a 0-d tensor, copied to the host from a GPU
    if not isinstance(value, numbers.Real):
        return f"{value!r}, a {type(value).__name__}, not a number"
    try:
        return float(value)
    except OverflowError:  # 10**400: no float holds it
        return f"an {type(value).__name__} beyond a float's range"


def raised(spec: str, err: Exception, on: str) -> RewardError:
    """The error that ends a run whose reward raised `err` on `on` (a completion, a batch), the same in the
    run's process and in a reward's own: one line naming the reward and the exception. The user's traceback
    goes to stderr before it, from the reward's own frame, marked as the reward's."""
    print(f"reward {spec!r} raised; its traceback, in the reward's code:", file=sys.stderr)
    traceback.print_exception(type(err), err, err.__traceback__.tb_next, file=sys.stderr)
    what = " ".join(f"{type(err).__name__}: {err}".split())
    return RewardError(f"reward {spec!r} raised {what} on {on} (its traceback above)")


def checked(reward: Reward, spec: str, reward_range: tuple[float, float]) -> Reward:
    """`reward` (a float, or a description of what was no number, for each completion: `as_float`) with every
    value checked where it enters the run: a number, finite, inside reward_range; else RewardError, one line
    naming the spec, the problem and the completion. A string "1" would train as 1.0 unseen, and a NaN would
    silently skip every update."""
    lo, hi = reward_range

    def checked_reward(questions: list[str], completions: list[str], golds: list[str]) -> list[float]:
        rewards = reward(questions, completions, golds)
        for i, (value, question) in enumerate(zip(rewards, questions)):
            problem = f"completion {i} of the batch, {completions[i][:60]!r}, of problem {question[:60]!r}"
            if isinstance(value, str):
                raise RewardError(f"reward {spec!r} returned {value}, for {problem}")
            if not (math.isfinite(value) and lo <= value <= hi):
                raise RewardError(f"reward {spec!r} returned {value} for {problem}: rewards must be finite "
                                  f"and within --reward-range {lo:g},{hi:g}")
        return rewards
    return checked_reward


def _trl_style(fn: Callable, signature: inspect.Signature, spec: str) -> Reward:
    """A batch reward from a TRL-style function: one call per batch, with the keywords it accepts."""
    takes_any = any(p.kind is p.VAR_KEYWORD for p in signature.parameters.values())
    names = [n for n in ("prompts", "completions", TRL_GOLD) if takes_any or n in signature.parameters]
    try:
        signature.bind(**dict.fromkeys(names))
    except TypeError as err:
        raise ValueError(f"reward spec {spec!r}: a TRL-style reward is called with prompts=, completions= "
                         f"and {TRL_GOLD}= (the golds); {fn.__name__}{signature} can't be ({err})") from None

    def reward(questions: list[str], completions: list[str], golds: list[str]) -> list[float | str]:
        batch = {"prompts": [[{"role": "user", "content": q}] for q in questions],
                 "completions": [[{"role": "assistant", "content": c}] for c in completions],
                 TRL_GOLD: list(golds)}
        try:  # a list, or a tensor of one reward each: each a float here (`as_float`)
            returned = list(fn(**{n: batch[n] for n in names}))
            rewards = [0.0 if r is None else as_float(r) for r in returned]
        except Exception as err:
            raise raised(spec, err, f"a batch of {len(completions)} completions (one call), the first of "
                                    f"problem {questions[0][:60]!r}") from None
        if len(rewards) != len(completions):
            raise RewardError(f"reward {spec!r}: {len(rewards)} rewards for {len(completions)} completions")
        nones = sum(r is None for r in returned)
        if nones and not warned:  # TRL warns too: a None means "does not apply", scored 0 here
            warned.append(True)
            print(f"warning: reward {spec!r} returned None for {nones} of {len(rewards)} "
                  "completions: they score 0 (warned once per run)", file=sys.stderr)
        return rewards  # checked where they enter (`checked`)
    warned: list[bool] = []
    return reward


# ------------------------------------------------------------------ a reward in a process of its own
# A user's reward (module:function) and math-verify may hang: sympy on a huge power, a regex that backtracks,
# a service that never answers. SIGALRM only interrupts Python bytecode in the main thread, and a thread
# cannot be stopped (one stuck in C code even holds the GIL), so such a reward runs in a process of its own:
# the run waits for each call at most `time_limit` seconds, then kills the process, scores that call's
# completions 0 and starts another. `verify`, pure Python with bounded work, runs in the run's own process.
#
# The process the run starts (`supervise`) runs no user code: it forks the worker, which imports the reward
# and serves the calls (`serve`), and stays above it as its subreaper (Linux's PR_SET_CHILD_SUBREAPER).
# Whatever the reward starts (a pool, a server, a shell command, a daemon, a child in a session of its own,
# which no process group reaches) stays below it, as an orphan is handed to it rather than to init; and it
# kills all of that with the worker: at the time limit and at the run's end (the run asks with SIGTERM), when
# the run dies, even SIGKILLed (the kernel's SIGTERM, `die_with`), and when the worker dies (a crash, os._exit
# in the reward). Off Linux, only the process group is reached.
#
# The two talk over a socket pair, one pickle a message (multiprocessing's Connection): first (sys.path,
# spec), answered by "ready"; then each call's (id, questions, completions, golds), answered by (id, "ok",
# rewards: a float each, or what was no number described, `as_float`) or (id, "raised", the one line of
# `raised`, its traceback printed by the worker). An answer is taken only for the call it names: a stray one
# (from a process the reward forked, say) never shifts the rest.


WORKER_FLAG = "--reward-worker"  # `python verifier.py --reward-worker`: supervise(), started by a run
IMPORT_LIMIT = 60.0  # seconds the worker may take to import the reward, at least: a fresh interpreter imports
# what the run had imported already (torch alone takes seconds, far more on a loaded machine)
LINUX = sys.platform.startswith("linux")


class RewardWorker:
    """The batch reward of `spec` (`load_reward`), each call run in a child process with a time limit.
    `one_by_one`: an f(completion, gold) is called, and timed, once per completion; a TRL-style function once
    per batch. A call past the limit scores 0, with a warning the first time, and adds its completions to
    counts["reward_timeouts"]."""

    def __init__(self, spec: str, time_limit: float, one_by_one: bool, counts: Counter | None = None):
        self.spec, self.time_limit, self.one_by_one = spec, time_limit, one_by_one
        self.counts = Counter() if counts is None else counts
        self.process: subprocess.Popen | None = None
        self.channel: Connection | None = None
        self.calls = 0  # the id of the latest call
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
        self.calls += 1
        self.channel.send((self.calls, questions, completions, golds))
        deadline = time.monotonic() + self.time_limit
        while self.channel.poll(max(0.0, deadline - time.monotonic())):
            call, status, value = self.receive()
            if call != self.calls:  # a stray: a second answer from a process the reward forked, say
                continue
            if status == "raised":
                raise RewardError(value)
            return value
        self.stop()  # stuck: the next call starts a fresh process
        self.counts["reward_timeouts"] += len(completions)
        if not self.warned:
            self.warned = True
            print(f"warning: reward {self.spec!r} took over {self.time_limit:g} s (--reward-timeout) on "
                  f"{completions[0][:60]!r}: scored 0, and so is every call past the limit (counted as "
                  "reward_timeouts in metrics.jsonl; warned once)", file=sys.stderr)
        return [0.0] * len(completions)

    def start(self) -> None:
        """The child, ready to take calls once it has imported the reward, which may take the time limit but
        at least IMPORT_LIMIT seconds (a slow import is no hang, one that never ends is: RewardError)."""
        self.channel, its_end = Pipe()
        self.process = subprocess.Popen(  # supervise()
            [sys.executable, __file__, WORKER_FLAG, str(os.getpid()), str(its_end.fileno())],
            stdin=subprocess.DEVNULL, pass_fds=[its_end.fileno()], start_new_session=True)
        its_end.close()
        self.end = weakref.finalize(self, end_worker, self.process)  # never outlives the run, however it ends
        self.channel.send((sys.path, self.spec))
        limit = max(IMPORT_LIMIT, self.time_limit)
        try:
            with _interruptible():  # as the run's own import: train.py's handler would wait out the limit
                ready = self.channel.poll(limit)
        except KeyboardInterrupt as err:  # a RewardError: in a step, the steps before it are saved
            self.stop()
            raise RewardError(f"reward {self.spec!r}: interrupted ({_signal_of(err)[1]}) while its process "
                              "imported it: does its import hang?") from None
        if not ready:
            self.stop()
            raise RewardError(f"reward {self.spec!r}: its process had not imported it after {limit:g} s (the "
                              f"longer of --reward-timeout and {IMPORT_LIMIT:g} s): does its import hang?")
        self.receive()

    def stop(self) -> None:
        self.end()  # once: the finalizer is spent
        self.process = self.channel = None

    def receive(self):
        try:
            return self.channel.recv()
        except EOFError:  # the child died: os._exit, a crash in C code, killed from outside
            process = self.process
            self.stop()
            raise RewardError(f"reward {self.spec!r}: its process ended (exit code {process.returncode}) "
                              "during a call") from None


def end_worker(process: subprocess.Popen) -> None:
    """End a reward's process and everything below it (`supervise` ends it all on SIGTERM), then reap it."""
    process.terminate()
    process.wait()


def die_with(parent: int, signum: int = signal.SIGKILL) -> bool:
    """On Linux the kernel sends `signum` to this process when the thread that started it, the `parent`'s,
    ends, even by SIGKILL and while a reward spins in C code (PR_SET_PDEATHSIG); elsewhere the run's finalizer
    stops the worker. False if the parent has ended already."""
    if LINUX:
        ctypes.CDLL(None).prctl(1, signum)  # 1: PR_SET_PDEATHSIG
    return os.getppid() == parent  # else it ended before the line above


def supervise(run: int, channel_fd: int) -> None:
    """The process that the run `run` starts for a reward: the worker's parent and the subreaper of all below
    it. It waits until the worker ends or SIGTERM comes (from the run, or from the kernel as the run ends),
    then kills everything below it (`end_below`) and exits with the worker's exit code."""
    waited = {signal.SIGTERM, signal.SIGCHLD}
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, waited)  # kept pending for sigwait, never lost
    signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # a SIG_IGN inherited from the run would reap for it
    if not die_with(run, signal.SIGTERM):
        return
    if LINUX:
        ctypes.CDLL(None).prctl(36, 1)  # 36: PR_SET_CHILD_SUBREAPER: orphans below come here, not to init
    supervisor = os.getpid()
    worker = os.fork()
    if worker == 0:
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        if die_with(supervisor):
            serve(channel_fd)
        return
    os.close(channel_fd)  # the run reads the worker's end alone: its answers end when the worker does
    code = None
    while code is None and signal.sigwait(waited) == signal.SIGCHLD:
        code = reap(worker)
    sys.exit(end_below(worker, code))


def reap(worker: int) -> int | None:
    """Reap every child of this process that has ended (the worker, or an orphan handed to it): the worker's
    exit code if it was among them."""
    code = None
    with contextlib.suppress(ChildProcessError):  # no child left
        while (ended := os.waitpid(-1, os.WNOHANG))[0]:
            if ended[0] == worker:
                code = exit_code(ended[1])
    return code


def end_below(worker: int, code: int | None) -> int:
    """Kill every process below this one and reap it; the worker's exit code (`code`, if it was reaped). Only
    this process's own children are killed, each round: it alone reaps them, so none of their pids can name
    another process meanwhile. Their children then come to it (a subreaper), and the next round kills them."""
    if not LINUX:
        os.killpg(0, signal.SIGKILL)  # the group alone is reachable there (this process too)
    while True:
        for child in children(os.getpid()):
            os.kill(child, signal.SIGKILL)
        try:
            pid, status = os.waitpid(-1, 0)
        except ChildProcessError:  # nothing left below
            return 1 if code is None else code
        if pid == worker:
            code = exit_code(status)


def exit_code(status: int) -> int:
    """A wait status as a shell's exit code: 128 + the signal that killed it."""
    code = os.waitstatus_to_exitcode(status)
    return 128 - code if code < 0 else code


def children(parent: int) -> list[int]:
    """The pids of `parent`'s children, from /proc."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError), open(f"/proc/{pid}/stat", "rb") as stat:  # OSError: it has ended
            if int(stat.read().rpartition(b")")[2].split()[1]) == parent:  # "pid (name) state ppid ..."
                found.append(int(pid))
    return found


def serve(channel_fd: int) -> None:
    """The worker: build the reward, then answer calls until the run closes the socket."""
    os.dup2(2, 1)  # the reward's own prints go to stderr: the run's stdout holds the run's lines
    channel = Connection(channel_fd)
    sys.path[:], spec = channel.recv()
    reward = _batch_reward(spec)[0]
    channel.send("ready")
    worker = os.getpid()
    while True:
        try:
            call, questions, completions, golds = channel.recv()
        except EOFError:  # the run has ended
            return
        try:
            answer = (call, "ok", reward(questions, completions, golds))
        except RewardError as e:  # it raised (its traceback printed here), or returned too few: one line
            answer = (call, "raised", str(e))
        if os.getpid() != worker:  # a process the reward forked returned here: it must not answer, nor read
            os._exit(0)
        channel.send(answer)


if __name__ == "__main__":
    if len(sys.argv) != 4 or sys.argv[1] != WORKER_FLAG or not all(a.isdigit() for a in sys.argv[2:]):
        sys.exit(f"verifier.py is a module (the reward); `python verifier.py {WORKER_FLAG} <pid> <fd>` is "
                 "the process a run starts for a reward with a time limit")
    supervise(int(sys.argv[2]), int(sys.argv[3]))

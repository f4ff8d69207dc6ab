"""Rule-based answer verifier for math reasoning rewards (pure standard library).

Conventions followed:
- Extraction: the last ``\\boxed{...}`` (as the Hendrycks MATH ``last_boxed_only_string``),
  then GSM8K's ``#### x``, then an answer phrase ("The answer is", "Answer:", "A:", the
  Minerva "Final Answer: The final answer is ..."), then the last number in the text.
- Normalisation: Hendrycks MATH ``is_equiv`` / ``_strip_string`` (as reused by the PRM800K
  grader), plus numeric equality (1/2 = \\frac{1}{2} = 0.5): exact via ``fractions.Fraction``;
  non-integers also within 1e-6 (a rounded 0.3333333 for 1/3), like math-verify's rounding.

Every step is linear-time: no nested regex quantifiers, brace matching by a scan, length caps.
"""
from __future__ import annotations

import math
import re
from fractions import Fraction
from functools import lru_cache

MAX_TEXT = 50_000  # final answers live at the end; scanning only the tail bounds the time
MAX_SNIPPET = 200  # an answer longer than this is no answer a grader would accept
MAX_NORMALISE = 400  # longer strings are compared raw; normalising them buys nothing
REL_TOL, ABS_TOL = 1e-9, 1e-6  # for non-integers; integers compare exactly

_NUM = r"-?(?:\d+(?:,\d{3})*(?:\.\d+)?|\.\d+)"  # commas only in groups of 3: unambiguous
_NUMBER = re.compile(_NUM)
_BRACE = re.compile(r"[{}]")
_HASHES = re.compile(r"####[ \t]*([^\n]*)")
# "the answer is", "final answer:", "Answer =", and the "Q: ... A: ..." convention.
_PHRASE = re.compile(r"(?i:answer)[ \t]*(?:(?i:is)\b[ \t]*:?|[:=])|\bA:")
_LEAD_NUMBER = re.compile(rf"\$?\s*({_NUM})(?:\s*\\?%)?(?:\s+[A-Za-z].*)?")  # "18 dollars"

_UNIT_TEXT = re.compile(r"\\(?:text|mbox)\{\s[^{}]*\}(?:\^\{?\d\}?)?")  # "5 \text{ cm}^2"
_TEXT = re.compile(r"\\(?:text|textbf|textrm|mbox|mathrm|mathbf)\{([^{}]*)\}")
_DROP = re.compile(r"\\left|\\right|(?<!\\)\\[!,;: ]|\^\{?\\circ\}?|\\?%|\\?\$|\s")
_FRAC_ARGS = re.compile(r"\\frac(\{[^{}]*\}|\w)(\{[^{}]*\}|\w)")  # \frac12, \frac{270}7, \frac9{19}
_SQRT = re.compile(r"\\sqrt(\w)")
_LEAD_DOT = re.compile(r"(?<!\d)\.(?=\d)")
_THOUSANDS = re.compile(r"-?\d{1,3}(?:,\d{3})+(?:\.\d+)?")
_DECIMAL = re.compile(r"-?(?:\d+(?:\.\d*)?|\.\d+)")
_SLASH = re.compile(r"(-?\d+(?:\.\d+)?)/(\d+(?:\.\d+)?)")
_FRAC = re.compile(r"(-?)\\frac\{(-?\d+(?:\.\d+)?)\}\{(-?\d+(?:\.\d+)?)\}")
_LETTER_CHOICE = re.compile(r"\(([A-Z])\)")


def _braced(text: str, start: int) -> str | None:
    """Content of the brace group opening at text[start], or None if never closed."""
    depth = 0
    for m in _BRACE.finditer(text, start):  # jump brace to brace: linear and fast
        depth += 1 if m.group() == "{" else -1
        if depth == 0:
            return text[start + 1 : m.start()]
    return None


def _last_boxed(text: str) -> str | None:
    """Content of the last balanced \\boxed{...} / \\fbox{...} (or \\boxed 5)."""
    end = len(text)
    for _ in range(3):  # try only a few: unbalanced ones could make this quadratic
        start = max(text.rfind("\\boxed", 0, end), text.rfind("\\fbox", 0, end))
        if start < 0:
            return None
        i = start + (6 if text.startswith("\\boxed", start) else 5)
        if text[i : i + 1] == "{":
            content = _braced(text, i)
            if content is not None:
                return content
        elif text[i : i + 1].isspace():  # "\\boxed 5$": Hendrycks takes the token up to "$"
            token = text[i : i + MAX_SNIPPET].split(None, 1)
            if token and token[0].split("$")[0]:
                return token[0].split("$")[0]
        end = start
    return None


def _clean_snippet(snippet: str) -> str | None:
    """Trim an answer phrase's tail to the answer: one sentence, a bare leading number."""
    s = snippet[:MAX_SNIPPET].strip().strip("*").strip()
    s = s.split(". ", 1)[0].rstrip(". ").strip("$").strip()
    lead = _LEAD_NUMBER.fullmatch(s)
    return (lead.group(1) if lead else s) or None


def extract_answer(text: str) -> str | None:
    """The final answer stated in a completion, or None if it states none."""
    if not isinstance(text, str) or not text:
        return None
    text = text[-MAX_TEXT:]
    boxed = _last_boxed(text)
    if boxed is not None:
        return boxed.strip()
    for pattern in (_HASHES, _PHRASE):
        last = None
        for last in pattern.finditer(text):
            pass
        if last is not None:
            tail = last.group(1) if pattern is _HASHES else text[last.end() :].split("\n", 1)[0]
            answer = _clean_snippet(tail)
            if answer is not None:
                return answer
    last_number = None
    for last_number in _NUMBER.finditer(text):
        pass
    return last_number.group() if last_number else None


@lru_cache(maxsize=4096)  # golds repeat: every completion of a GRPO group shares one
def normalise(answer: str) -> str:
    """Canonical string form of an answer, following Hendrycks MATH ``_strip_string``."""
    s = answer.strip()
    if len(s) > MAX_NORMALISE:
        return s
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = s.replace("\u2212", "-")
    without_units = _UNIT_TEXT.sub("", s).strip()
    s = without_units if without_units else s  # "\text{ cm}" alone is the answer itself
    s = _TEXT.sub(r"\1", s)
    s = _DROP.sub("", s)
    s = _FRAC_ARGS.sub(lambda m: "\\frac" + "".join(
        g if g.startswith("{") else "{" + g + "}" for g in m.groups()), s)
    s = _SQRT.sub(r"\\sqrt{\1}", s)
    s = _LEAD_DOT.sub("0.", s).rstrip(".")
    if s.count("=") == 1 and len(s.split("=")[0]) <= 2:  # "x=5" -> "5", "k=2" -> "2"
        s = s.split("=")[1]
    if s.startswith(("x\\in", "k\\in")):  # "x \in [-2,7]" -> "[-2,7]"
        s = s[4:]
    if _THOUSANDS.fullmatch(s):
        s = s.replace(",", "")
    return _LETTER_CHOICE.sub(r"\1", s)  # "\text{(C)}" -> "C"


def _to_number(s: str) -> Fraction | None:
    """Exact value of a plain number, a/b, or \\frac{a}{b}; None for anything else."""
    if len(s) > 60:  # also keeps int() away from the 4300-digit limit
        return None
    try:
        if _DECIMAL.fullmatch(s):
            return Fraction(s)
        m = _SLASH.fullmatch(s)
        if m:
            return Fraction(m.group(1)) / Fraction(m.group(2))
        m = _FRAC.fullmatch(s)
        if m:
            value = Fraction(m.group(2)) / Fraction(m.group(3))
            return -value if m.group(1) else value
    except (ValueError, ZeroDivisionError):
        pass
    return None


def _equal(a: str, b: str) -> bool:
    """Normalised strings equal, or both numbers with (almost) the same value."""
    if a == b:
        return True
    x, y = _to_number(a), _to_number(b)
    if x is None or y is None:
        return False
    if x.denominator == 1 and y.denominator == 1:  # 999999 is not 1000000
        return x == y
    # Rounded decimals (0.3333333 for 1/3) and float noise on large values (1e12 + 1e-4).
    return math.isclose(x, y, rel_tol=REL_TOL, abs_tol=ABS_TOL)


def _split_top_level(s: str) -> list[str]:
    """Split on commas that are not inside braces or brackets."""
    parts, depth, start = [], 0, 0
    for i, ch in enumerate(s):
        depth += (ch in "({[") - (ch in ")}]")
        if ch == "," and depth == 0:
            parts.append(s[start:i])
            start = i + 1
    return parts + [s[start:]]


def _equal_tuples(a: str, b: str) -> bool:
    """Tuples/intervals like (3,\\frac{\\pi}{2}) vs (3,\\frac{\\pi}2) elementwise."""
    if "," not in a or "," not in b:
        return False
    if a[0] in "([" and b[0] in "([":  # brackets must agree: (3,4] is not [3,4]
        if a[0] + a[-1] != b[0] + b[-1]:
            return False
        a, b = a[1:-1], b[1:-1]
    xs, ys = _split_top_level(a), _split_top_level(b)
    return len(xs) == len(ys) and all(_equal(x, y) for x, y in zip(xs, ys))


def verify(completion: str, answer: str) -> float:
    """1.0 if the completion's final answer matches the gold answer, else 0.0. Never raises."""
    try:
        if isinstance(answer, (int, float)):
            answer = str(answer)
        predicted = extract_answer(completion)
        if predicted is None or not isinstance(answer, str) or not answer.strip():
            return 0.0
        if predicted == answer.strip():  # fast path: most correct answers match verbatim
            return 1.0
        p, g = normalise(predicted), normalise(answer)
        return 1.0 if _equal(p, g) or _equal_tuples(p, g) else 0.0
    except Exception:  # a reward function must not crash a training run
        return 0.0

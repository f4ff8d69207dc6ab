"""Problems for training and evaluation: the project's own arithmetic task, and GSM8K/MATH JSONL files.

A problem is a question, a gold answer string that `verifier.verify` compares completions against, the
level it comes from (the mixed task's, or a JSONL file's "level": MATH's), and its dataset's instruction
(a JSONL file's asks for \boxed{}), which the prompt format adds or replaces (model.format_prompts).
Specs accepted by `load_problems`:
  arith-<level>   generated arithmetic, deterministic; levels from easy to hard are listed in LEVELS
  arith-mix       every level at once, in equal shares: easy prompts turn all-correct while hard ones stay
                  all-wrong within one run, so collapse shows at both ends of difficulty together
  path/to.jsonl   GSM8K form {"question", "answer": "... #### 42"} or MATH form {"problem", "answer"}
"""

import hashlib
import json
import math
import random
import re
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import Iterable


@dataclass(frozen=True)
class Problem:
    question: str
    answer: str
    level: str = ""  # arith-mix's level, or a file's (MATH's "Level 1".."Level 5"): accuracy per level
    instruction: str = ""  # the dataset's instruction, which a chat prompt adds (model.format_prompts)
    where: str = field(default="", compare=False)  # file:line of a JSONL problem, for errors that name it


# level: (operator, range of the first operand, range of the second). Ordered from easy to hard for
# SmolLM2-135M at T=1: easy levels give mostly all-correct groups, hard ones mostly all-wrong groups.
LEVELS = {
    "add1": ("+", range(0, 10), range(0, 10)),
    "mul1": ("*", range(1, 10), range(1, 10)),
    "add2": ("+", range(10, 100), range(10, 100)),
    "mul2": ("*", range(10, 100), range(2, 10)),
    "mul3": ("*", range(100, 1000), range(10, 100)),
}
OPERATIONS = {"+": lambda a, b: a + b, "*": lambda a, b: a * b}
TEST_FRACTION = 0.2
MAX_PROBLEMS_PER_LEVEL = 20_000
MIX_TEST_PER_LEVEL = 100  # arith-mix held-out: up to 100 a level (add1, mul1 have 20 and 16): 336 problems
MIX_TRAIN_ROUNDS = 2_000  # arith-mix train list: 2,000 rounds of one problem per level
BOXED_INSTRUCTION = "Put the final answer in \\boxed{}."  # a JSONL problem's (GSM8K, MATH)


def arithmetic_problems(level: str, split: str, seed: int = 0) -> list[Problem]:
    """All problems of a level, shuffled by `seed`; the last TEST_FRACTION of pairs is the test split,
    so train and test never share a problem. Large levels are subsampled to MAX_PROBLEMS_PER_LEVEL."""
    if level not in LEVELS:
        raise ValueError(f"unknown arithmetic level {level!r}; choose one of {', '.join(LEVELS)} or mix")
    op, left, right = LEVELS[level]
    rng = random.Random(f"{level}-{seed}")
    if len(left) * len(right) <= MAX_PROBLEMS_PER_LEVEL:
        pairs = [(a, b) for a in left for b in right]
        rng.shuffle(pairs)
    else:
        pairs = list({(rng.choice(left), rng.choice(right)) for _ in range(MAX_PROBLEMS_PER_LEVEL)})
        pairs.sort()
        rng.shuffle(pairs)
    n_test = max(1, int(len(pairs) * TEST_FRACTION))
    chosen = pairs[-n_test:] if split == "test" else pairs[:-n_test]
    return [Problem(f"What is {a} {op} {b}?", str(OPERATIONS[op](a, b)), level) for a, b in chosen]


def mixed_problems(split: str, seed: int = 0) -> list[Problem]:
    """arith-mix: every level's own split, so train and test stay disjoint. Train interleaves the levels
    round-robin (small levels repeat), so a random prompt is equally likely to come from each level;
    test keeps up to MIX_TEST_PER_LEVEL problems of each level, interleaved, for accuracy per level."""
    per_level = [arithmetic_problems(level, split, seed) for level in LEVELS]
    if split == "test":  # interleaved too, so that a prefix (train.py's --eval-size) keeps every level
        kept = [problems[:MIX_TEST_PER_LEVEL] for problems in per_level]
        return [problems[i] for i in range(MIX_TEST_PER_LEVEL) for problems in kept if i < len(problems)]
    return [problems[i % len(problems)] for i in range(MIX_TRAIN_ROUNDS) for problems in per_level]


def gold_from_gsm8k(solution: str) -> str:
    """GSM8K solutions end with '#### <answer>'; the gold is that answer without thousands separators."""
    return solution.rsplit("####", 1)[1].strip().replace(",", "")


def read_jsonl(path: Path) -> list[Problem]:
    """Read GSM8K-form or MATH-form JSONL; a bad line raises ValueError naming the file and line."""
    if not path.is_file():
        raise FileNotFoundError(f"dataset file not found: {path}")
    problems = []
    with path.open("rb") as f:  # bytes, decoded line by line: a decode error can name its line
        for lineno, raw in enumerate(f, start=1):
            where = f"{path}:{lineno}"
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                raise ValueError(f"{where}: not UTF-8 (byte {raw[e.start]:#x} at column {e.start + 1}); "
                                 "save the file as UTF-8") from None
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except ValueError as e:  # JSONDecodeError, or an integer of over 4,300 digits
                raise ValueError(f"{where}: not valid JSON ({getattr(e, 'msg', e)})") from None
            if not isinstance(row, dict):
                raise ValueError(f"{where}: expected a JSON object, got {type(row).__name__}")
            key = "problem" if "problem" in row else "question"  # MATH form, else GSM8K form
            if key not in row or "answer" not in row:
                raise ValueError(
                    f"{where}: expected fields 'question' and 'answer' (GSM8K form) or 'problem' and "
                    f"'answer' (MATH form); got {sorted(row)}"
                )
            question, answer = row[key], row["answer"]
            if not isinstance(question, str):
                raise ValueError(f"{where}: '{key}' must be a string, got {json.dumps(question)[:40]}")
            # a number is a gold as it reads (AMC's 27.0); null, true, a list or an object is none: its str(),
            # 'None' or "{'a': 1}", would be a gold no completion matches; nor is NaN or Infinity
            number = type(answer) is int or type(answer) is float and math.isfinite(answer)  # not a bool
            if not (isinstance(answer, str) or number):
                raise ValueError(f"{where}: 'answer' must be a string or a number, got "
                                 f"{json.dumps(answer)[:40]}")
            answer = str(answer)
            if key == "question":  # GSM8K form: a worked solution ending '#### x'
                if "####" not in answer:
                    raise ValueError(f"{where}: GSM8K-form 'answer' must end with '#### <final answer>'")
                answer = gold_from_gsm8k(answer)
            if not question.strip() or not answer.strip():
                raise ValueError(f"{where}: empty question or answer")
            problems.append(Problem(question, answer, file_level(row.get("level", ""), where),
                                    instruction=BOXED_INSTRUCTION, where=where))
    if not problems:
        raise ValueError(f"{path}: dataset is empty")
    return problems


def file_level(level, where: str) -> str:
    """A JSONL problem's level as a name: MATH's own files say "Level 2", MATH-500's (PRM800K's) say 2; none
    is ""."""
    if type(level) is int:
        return f"Level {level}"
    if not isinstance(level, str):
        raise ValueError(f"{where}: 'level' must be a string or an integer, got {json.dumps(level)[:40]}")
    return level


def step_problems(problems: list[Problem], size: int, seed: int, step: int, round: int = 0) -> list[Problem]:
    """The `size` prompts of a training step (or of a resampling round in it): the same for every algorithm,
    process and resumed run of a seed."""
    rng = random.Random(seed * 1_000_003 + step + round * 1_000_000_007)
    return rng.sample(problems, min(size, len(problems)))


NO_LEVEL = "no level"  # the one level of a file whose problems have no "level" field


def level_order(names: Iterable[str]) -> list[str]:
    """Level names from easy to hard as the names say: by the first number in each (MATH's "Level 1" to
    "Level 5"; arith's add1, mul1, add2, mul2, mul3), a tie or a name without a number in the order given."""
    number = lambda name: int(m[0]) if (m := re.search(r"\d+", name)) else math.inf  # noqa: E731
    return sorted(dict.fromkeys(names), key=number)  # stable: a tie keeps its order


def by_level(problems: list[Problem]) -> dict[str, list[Problem]]:
    """The problems of each level, easy to hard (`level_order`); a file without levels is one level,
    NO_LEVEL."""
    levels = {}
    for problem in problems:
        levels.setdefault(problem.level or NO_LEVEL, []).append(problem)
    return {name: levels[name] for name in level_order(levels)}


def load_eval_problems(spec: str, seed: int = 0) -> list[Problem]:
    """Problems to evaluate on: the test split of a generated task, or a whole JSONL file."""
    return load_problems(spec, "test" if spec.startswith("arith-") else "all", seed)


def data_hashes(*specs: str) -> dict[str, str]:
    """{path: sha256} of each data file among `specs`: a run's identity includes its data's content, not its
    path alone. A generated task (arith-*) is the code's, and has none."""
    return {spec: hashlib.sha256(Path(spec).expanduser().read_bytes()).hexdigest()
            for spec in specs if spec and not spec.startswith("arith-")}


def data_line(dataset: str, eval_dataset: str) -> str:
    """The study's data in one line, for its plan and report.md: a file by its path and its sha256's first 12
    hex (config.json's data_sha256 holds all of it), a generated task by its name."""
    hashes = data_hashes(dataset, eval_dataset)
    named = [f"{spec} sha256 {hashes[spec][:12]}" if spec in hashes
             else f"{spec}, generated by the code: no file" for spec in (dataset, eval_dataset) if spec]
    return "data: " + "; held out: ".join(named)


def changed_data(recorded: dict, *specs: str) -> str | None:
    """The first data file among `specs` whose content is not the one `recorded` ({path: sha256}, a run's
    config.json "data_sha256"), in words; None when all are."""
    for path, digest in data_hashes(*specs).items():
        if recorded.get(path) != digest:
            then = f"sha256 {recorded[path][:12]}" if path in recorded else "no hash recorded"
            return f"{path} is not the file the run was trained on (sha256 {digest[:12]}; the run's: {then})"
    return None


def held_out_problems(dataset: str, eval_dataset: str, seed: int = 0) -> list[Problem]:
    """What a run of `dataset` is evaluated on: the whole of `eval_dataset` (a file; a generated task: its
    test split), else `dataset`'s test split, which it never trains on."""
    return load_eval_problems(eval_dataset, seed) if eval_dataset else load_problems(dataset, "test", seed)


HELD_OUT_EVERY = 10  # a JSONL file's test split: its 10th, 20th, ... problem


def load_problems(spec: str, split: str = "train", seed: int = 0) -> list[Problem]:
    """Problems for `spec` (arith-<level> or a .jsonl path). A JSONL file is split deterministically:
    the test split is every 10th problem, so `--dataset` alone gives a held-out evaluation set. A file of
    fewer than 10 has no test split (a ValueError naming it: --eval-dataset must give one); it trains
    whole."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be train, test or all; got {split!r}")
    if spec.startswith("arith-"):
        level = spec.removeprefix("arith-")
        generate = mixed_problems if spec == "arith-mix" else partial(arithmetic_problems, level)
        if split == "all":
            return generate("train", seed) + generate("test", seed)
        return generate(split, seed)
    path = Path(spec).expanduser()
    if path.suffix != ".jsonl":
        raise ValueError(f"unknown dataset {spec!r}: use arith-<level> ({', '.join(LEVELS)}), arith-mix "
                         "or a .jsonl file")
    problems = read_jsonl(path)
    if len(problems) < HELD_OUT_EVERY and split == "test":  # else the test split would be the training one
        raise ValueError(f"{path}: {len(problems)} problems, too few to hold out every {HELD_OUT_EVERY}th: "
                         f"give --eval-dataset (a file of held-out problems), or at least {HELD_OUT_EVERY}")
    if split == "all" or len(problems) < HELD_OUT_EVERY:
        return problems
    test = split == "test"
    return [p for i, p in enumerate(problems) if (i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1) == test]

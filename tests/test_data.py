"""Problem sources: the generated arithmetic task and GSM8K/MATH JSONL, with named errors."""

import json
import random
from pathlib import Path

import pytest

from data.tasks import (LEVELS, NO_LEVEL, Problem, by_level, held_out_problems, level_order, load_eval_problems,
                        load_problems)
from infra.written import RECORD, owned
from verifier import verify

SHARED = Path(__file__).resolve().parent.parent.parent / "shared" / "data"


@pytest.mark.parametrize("level", list(LEVELS))
def test_arithmetic_is_deterministic_with_disjoint_splits(level):
    train, test = load_problems(f"arith-{level}", "train"), load_problems(f"arith-{level}", "test")
    assert train == load_problems(f"arith-{level}", "train")  # same seed, same problems, same order
    assert train and test and not set(train) & set(test)
    assert load_problems(f"arith-{level}", "train", seed=1) != train
    for p in train[:20]:
        a, op, b = p.question.removeprefix("What is ").removesuffix("?").split()
        assert int(p.answer) == (int(a) + int(b) if op == "+" else int(a) * int(b))
        assert verify(f"The answer is {p.answer}.", p.answer) == 1.0


def test_arith_mix_balances_levels_and_holds_out_300_stratified_problems():
    train, test = load_problems("arith-mix", "train"), load_problems("arith-mix", "test")
    assert not set(train) & set(test)  # each level keeps its own train/test split
    # small levels whole, others 100
    assert len(test) == 20 + 16 + 3 * 100 and {p.level for p in test} == set(LEVELS)
    for level in LEVELS:
        assert set(p for p in test if p.level == level) <= set(load_problems(f"arith-{level}", "test"))
    first = [p.level for p in train[: 10 * len(LEVELS)]]
    # a random prompt is equally likely from each level
    assert all(first.count(level) == 10 for level in LEVELS)
    assert load_eval_problems("arith-mix") == test
    assert {p.level for p in test[:64]} == set(LEVELS)  # train.py's --eval-size prefix is stratified too


def write(tmp_path, lines: list[str]) -> Path:
    path = tmp_path / "data.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def test_gsm8k_and_math_forms(tmp_path):
    path = write(tmp_path, [json.dumps({"question": "2 apples and 1,000 more?",
                                        "answer": "2 + 1000\n#### 1,002"}), "",
                            json.dumps({"problem": "Half of 1?", "answer": "\\frac{1}{2}", "level": 2}),
                            # the last ####
                            json.dumps({"question": "Twice?", "answer": "#### 3 is wrong\n#### 4"}),
                            json.dumps({"problem": "AMC's?", "answer": 27.0}),  # a number: as it reads
                            json.dumps({"problem": "Int?", "answer": 42})])
    problems = load_problems(str(path), "all")
    assert [p.answer for p in problems] == ["1002", "\\frac{1}{2}", "4", "27.0", "42"]
    assert [p.where for p in problems] == [f"{path}:{line}" for line in (1, 3, 4, 5, 6)]
    assert problems[0].question == "2 apples and 1,000 more?"  # the prompt format adds the instruction
    assert {p.instruction for p in problems} == {"Put the final answer in \\boxed{}."}
    assert load_eval_problems(str(path)) == problems  # a JSONL evaluation set is the whole file
    assert [p.level for p in problems] == ["", "Level 2", "", "", ""]  # MATH-500's level 2


def test_a_files_levels_are_kept_by_name_and_a_bad_one_is_named_with_its_line(tmp_path):
    """MATH's own files say "Level 3", MATH-500's 3: both are "Level 3"; a file without levels is one level
    (""); a level that is neither a string nor an integer is one line naming the file and line."""
    path = write(tmp_path, [json.dumps({"problem": "a?", "answer": "1", "level": "Level 3", "subject": "x"}),
                            json.dumps({"problem": "b?", "answer": "2", "level": 3}),
                            json.dumps({"problem": "c?", "answer": "3"})])
    assert [p.level for p in load_problems(str(path), "all")] == ["Level 3", "Level 3", ""]
    bad = write(tmp_path, [json.dumps({"problem": "a?", "answer": "1", "level": [1]})])
    with pytest.raises(ValueError, match=rf"{bad}:1: 'level' must be a string or an integer, got \[1\]"):
        load_problems(str(bad), "all")


@pytest.mark.parametrize("seed", range(5))
def test_levels_go_easy_to_hard_by_the_number_in_their_names(seed):
    """MATH's "Level 1".."Level 10" by number, not as text; arith's by their digits, a tie in the order given
    (arith-mix's data gives LEVELS' order); a file without levels is one level, NO_LEVEL, holding every
    problem."""
    rng = random.Random(seed)
    math_levels = [f"Level {n}" for n in range(1, 11)]
    assert level_order(rng.sample(math_levels, 10)) == math_levels
    shuffled = rng.sample(list(LEVELS), len(LEVELS))
    ordered = level_order(shuffled)
    assert sorted(ordered) == sorted(LEVELS) and [n[-1] for n in ordered] == sorted(n[-1] for n in LEVELS)
    assert [n for n in ordered if n.endswith("1")] == [n for n in shuffled if n.endswith("1")]
    problems = load_problems("arith-mix", "test")
    assert list(by_level(problems)) == list(LEVELS)
    assert all(p.level == level for level, group in by_level(problems).items() for p in group)
    flat = [Problem(f"{n}?", str(n)) for n in range(7)]
    assert by_level(flat) == {NO_LEVEL: flat}


def test_jsonl_train_test_split_is_disjoint(tmp_path):
    path = write(tmp_path, [json.dumps({"problem": f"q{i}", "answer": str(i)}) for i in range(30)])
    train, test = load_problems(str(path), "train"), load_problems(str(path), "test")
    assert len(train) == 27 and len(test) == 3 and not set(train) & set(test)


def test_a_file_too_small_to_hold_out_every_10th_problem_is_refused_unless_eval_dataset_is_given(tmp_path,
                                                                                                   capsys):
    """Before, a file of fewer than 10 problems trained and tested on the same problems, with no word."""
    import train
    small = write(tmp_path, [json.dumps({"problem": f"q{i}", "answer": str(i)}) for i in range(9)])
    with pytest.raises(ValueError, match=f"^{small}: 9 problems, too few to hold out every 10th: give "
                                         "--eval-dataset"):
        load_problems(str(small), "test")
    assert len(load_problems(str(small), "train")) == 9  # all of it trains: nothing of it is held out
    (tmp_path / "ten").mkdir()
    ten = write(tmp_path / "ten", [json.dumps({"problem": f"q{i}", "answer": str(i)}) for i in range(10)])
    assert [len(load_problems(str(ten), split)) for split in ("test", "train")] == [1, 9]  # the edge splits
    with pytest.raises(SystemExit):
        train.parse_args(["--model", "tiny-qwen2", "--dataset", str(small), "--out", str(tmp_path / "out")])
    err = capsys.readouterr().err
    assert "9 problems, too few to hold out every 10th" in err and err.count("\n") == 1
    held = tmp_path / "held.jsonl"
    held.write_text(json.dumps({"problem": "h", "answer": "1"}) + "\n")
    args = train.parse_args(["--model", "tiny-qwen2", "--dataset", str(small), "--eval-dataset", str(held)])
    assert held_out_problems(args.dataset, args.eval_dataset) == load_problems(str(held), "all")
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("lines, message", [
    (['{"question": "ok", "answer": "#### 1"}', '{"question": "broken"'], ":2: not valid JSON"),
    (['{"question": "ok", "answer": "#### 1"}', '{"prompt": "x", "label": 1}'], ":2: expected fields"),
    (['{"question": "no hashes", "answer": "42"}'], ":1: GSM8K-form 'answer' must end"),
    (['[1, 2]'], ":1: expected a JSON object"),
    (['{"problem": "", "answer": "1"}'], ":1: empty question"),
    (['', '  '], "dataset is empty"),
    # not a string or a number: str() would make a gold no completion matches ('None', "{'a': 1}", "3']")
    (['{"problem": "ok", "answer": "1"}', '{"problem": "q", "answer": null}'],
     ":2: 'answer' must be a string or a number, got null$"),
    (['{"problem": "q", "answer": {"a": 1}}'], ":1: 'answer' must be a string or a number, got {\"a\": 1}$"),
    (['{"problem": "q", "answer": true}'], ":1: 'answer' must be a string or a number, got true$"),
    (['{"problem": "q", "answer": NaN}'], ":1: 'answer' must be a string or a number, got NaN$"),
    (['{"question": "q", "answer": ["#### 3"]}'], ":1: 'answer' must be a string or a number, got \\[\"#"),
    (['{"question": null, "answer": "#### 3"}'], ":1: 'question' must be a string, got null$"),
    (['{"problem": "q", "answer": 1' + "0" * 5000 + '}'], ":1: not valid JSON \\(Exceeds the limit"),
])
def test_bad_jsonl_names_file_and_line(tmp_path, lines, message):
    path = write(tmp_path, lines)
    with pytest.raises(ValueError, match=message) as info:
        load_problems(str(path))
    assert str(path) in str(info.value)


def test_a_line_that_is_not_utf8_is_named(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "ok", "answer": "#### 1"}\n'
                     b'{"question": "caf\xe9?", "answer": "#### 2"}\n')
    with pytest.raises(ValueError) as info:
        load_problems(str(path))
    assert str(info.value) == f"{path}:2: not UTF-8 (byte 0xe9 at column 18); save the file as UTF-8"


def test_unknown_specs(tmp_path):
    with pytest.raises(FileNotFoundError, match="not found"):
        load_problems(str(tmp_path / "missing.jsonl"))
    with pytest.raises(ValueError, match="unknown arithmetic level"):
        load_problems("arith-div9")
    with pytest.raises(ValueError, match="unknown dataset"):
        load_problems("gsm8k")


@pytest.mark.skipif(not SHARED.exists(), reason="shared evaluation data not present")
def test_shared_datasets_load():
    assert len(load_eval_problems(str(SHARED / "gsm8k_test.jsonl"))) == 1319
    math500 = load_eval_problems(str(SHARED / "math500_test.jsonl"))
    assert len(math500) == 500 and all(p.answer for p in math500)


@pytest.fixture
def sources(tmp_path, monkeypatch):
    """data/prepare.py's sources as local files (file:// URLs: urllib reads them as it reads https), one of
    each form; `sources(name, text)` replaces a source's content."""
    from data import prepare

    served = tmp_path / "served"
    served.mkdir()
    contents = {
        "gsm8k_train.jsonl": json.dumps({"question": "2 + 2?", "answer": "2 + 2 = 4\n#### 4"}) + "\n",
        "gsm8k_test.jsonl": json.dumps({"question": "1,000 + 1?", "answer": "#### 1,001"}) + "\n",
        "math_train.jsonl": json.dumps({"problem": "Half of 1?", "solution": "\\boxed{1/2}",
                                        "answer": "\\frac{1}{2}", "level": 2}) + "\n",
        "math500_test.jsonl": json.dumps({"problem": "3 - 4?", "answer": "-1"}) + "\n",
        "gsm8k_model_solutions.jsonl": json.dumps({"question": "q", "ground_truth": "A: 1"}) + "\n",
    }
    files = {name: {file: ((served / file).as_uri(), check) for file, (_, check) in entries.items()}
             for name, entries in prepare.SOURCES.items()}
    monkeypatch.setattr(prepare, "SOURCES", files)

    def serve(file: str, text: str) -> None:
        (served / file).write_text(text)

    for file, text in contents.items():
        serve(file, text)
    return prepare, serve


def test_prepare_writes_files_that_load_as_datasets(sources, tmp_path, capsys):
    prepare, _ = sources
    out = tmp_path / "downloads"
    assert prepare.main(["gsm8k", "math", "--out", str(out)]) == 0
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "gsm8k_test.jsonl", "gsm8k_train.jsonl",
                                                     "math500_test.jsonl", "math_train.jsonl"]
    assert load_problems(str(out / "gsm8k_test.jsonl"), "all")[0].answer == "1001"
    assert load_eval_problems(str(out / "math_train.jsonl"))[0].answer == "\\frac{1}{2}"
    assert prepare.main(["--out", str(out)]) == 0  # all: only the missing file is fetched
    assert "gsm8k_train.jsonl: already there, kept" in capsys.readouterr().out
    assert (out / "gsm8k_model_solutions.jsonl").exists()


@pytest.mark.parametrize("text, says", [
    ("version https://git-lfs.github.com/spec/v1\noid sha256:90d9\n", "not valid JSON"),  # a git LFS pointer
    (json.dumps({"problem": "no answer"}) + "\n", "expected fields"),
    (None, "urlopen error"),  # unreachable
])
def test_prepare_refuses_what_is_no_dataset_in_one_line_and_leaves_nothing(sources, tmp_path, text, says):
    prepare, serve = sources
    if text is None:
        (tmp_path / "served" / "math500_test.jsonl").unlink()
    else:
        serve("math500_test.jsonl", text)
    out = tmp_path / "downloads"
    with pytest.raises(SystemExit) as refused:
        prepare.main(["math", "--out", str(out)])
    message = str(refused.value)
    assert message.startswith("prepare: file://") and "math500_test.jsonl" in message and says in message
    assert "\n" not in message
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "math_train.jsonl"]  # no part left


def test_an_interrupted_prepare_leaves_no_file_that_looks_fetched(sources, tmp_path, monkeypatch):
    """Ctrl-C mid-download: the next run must fetch the file again, not keep half of it."""
    prepare, _ = sources

    def interrupted(path):
        raise KeyboardInterrupt

    url, _ = prepare.SOURCES["math"]["math500_test.jsonl"]
    monkeypatch.setitem(prepare.SOURCES["math"], "math500_test.jsonl", (url, interrupted))
    out = tmp_path / "downloads"
    with pytest.raises(KeyboardInterrupt):
        prepare.main(["math", "--out", str(out)])
    assert not (out / "math500_test.jsonl").exists()


def test_prepare_never_touches_a_part_file_it_did_not_write(sources, tmp_path):
    """Issue 54: before, prepare.py replaced, then deleted, a user's gsm8k_test.jsonl.part."""
    prepare, _ = sources
    out = tmp_path / "downloads"
    out.mkdir()
    (out / "gsm8k_test.jsonl.part").write_text("the user's")
    with pytest.raises(SystemExit) as refused:
        prepare.main(["gsm8k", "--out", str(out)])
    assert str(refused.value).startswith(f"prepare: {out} holds files and no record")
    assert sorted(p.name for p in out.iterdir()) == ["gsm8k_test.jsonl.part"]
    assert (out / "gsm8k_test.jsonl.part").read_text() == "the user's"


@pytest.mark.parametrize("name", ["gsm8k_train.jsonl", "gsm8k_test.jsonl", "gsm8k_train.jsonl.part",
                                  "gsm8k_test.jsonl.part"])
def test_a_symlink_at_a_file_prepare_writes_stops_it_in_one_line_and_its_target_stays(sources, tmp_path,
                                                                                     name):
    prepare, _ = sources
    out = tmp_path / "downloads"
    with owned(out, "downloads") as folder:  # a folder prepare.py writes, as it leaves one
        folder.save()
    target = tmp_path / "target"
    target.write_text("the user's")
    (out / name).symlink_to(target)
    with pytest.raises(SystemExit) as refused:
        prepare.main(["gsm8k", "--out", str(out)])
    line = str(refused.value)
    assert line.startswith(f"prepare: {out / name} is not written here") and "\n" not in line
    assert target.read_text() == "the user's" and (out / name).is_symlink()

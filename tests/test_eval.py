"""eval.py: the pass@k estimator, scoring of known completions, the CLI on the tiny model."""

import json
from math import comb
from pathlib import Path

import pytest
import torch

import eval as evaluation
import model as model_module
from data.tasks import Problem
from eval import evaluate, pass_at_k
from model import Rollout
from verifier import per_completion
from written import RECORD, owned


@pytest.mark.parametrize("n, c, k, expected", [
    (5, 0, 1, 0.0), (5, 5, 3, 1.0), (5, 1, 1, 0.2), (5, 2, 2, 1 - 3 / 10),
    (10, 3, 5, 1 - comb(7, 5) / comb(10, 5)), (8, 4, 8, 1.0), (8, 1, 4, 0.5),
])
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected)


def test_pass_at_k_rejects_k_above_n():
    with pytest.raises(ValueError):
        pass_at_k(2, 1, 3)


def test_evaluate_scores_known_completions(monkeypatch):
    texts = ["7 * 8 = 56", "\\boxed{56}", "It is 54.", "I don't know",  # problem 1: 2 of 4 correct
             "The answer is 1,000.", "1000", "#### 1000", "100"]  # problem 2: 3 of 4 correct

    def fake_sample(model, tokenizer, questions, group_size, max_new_tokens, temperature,
                    **options):
        n = len(questions) * group_size
        return Rollout(torch.zeros(n, 1), torch.ones(n, 1), torch.ones(n, 1), texts[:n],
                       torch.zeros(n, dtype=torch.bool))

    monkeypatch.setattr(evaluation, "sample", fake_sample)
    problems = [Problem("What is 7 * 8?", "56", "mul1"), Problem("What is 10 * 100?", "1000", "mul3")]
    result = evaluate(None, None, problems, max_new_tokens=8, samples=4, temperature=1.0)
    assert result["accuracy"] == pytest.approx(5 / 8)
    assert result["accuracy_by_level"] == {"mul1": 0.5, "mul3": 0.75}
    assert result["pass_at_k"][1] == pytest.approx((0.5 + 0.75) / 2)
    assert result["pass_at_k"][4] == 1.0
    # an equation states its right side
    assert [r["extracted"] for r in result["records"][:3]] == ["7 * 8 = 56", "56", "54"]
    assert [r["correct"] for r in result["records"]] == [True, True, False, False, True, True, True, False]


def test_evaluate_counts_only_full_reward_as_correct_and_reports_pass_at_every_n(monkeypatch):
    """Rewards 1, 0.5, 0 for 3 samples: one correct (partial credit is not), pass@k for k = 1, 2 and n = 3."""
    def fake_sample(model, tokenizer, questions, group_size, max_new_tokens, temperature,
                    **options):
        return Rollout(torch.zeros(3, 1), torch.ones(3, 1), torch.ones(3, 1), ["a", "b", "c"],
                       torch.zeros(3, dtype=torch.bool))

    monkeypatch.setattr(evaluation, "sample", fake_sample)
    result = evaluate(None, None, [Problem("q", "g", "")], max_new_tokens=8, samples=3, temperature=1.0,
                      reward_fn=per_completion(lambda text, gold: {"a": 1.0, "b": 0.5, "c": 0.0}[text]))
    assert result["accuracy"] == pytest.approx(1 / 3)
    assert result["pass_at_k"] == pytest.approx({1: 1 / 3, 2: 1 - comb(2, 2) / comb(3, 2), 3: 1.0})


def test_cli_on_tiny_model_writes_outputs(tmp_path, capsys):
    summary = evaluation.main(["--model", "tiny-qwen2", "tiny-qwen2", "--dataset", "arith-add1",
                               "--limit", "3", "--samples", "2", "--max-new-tokens", "4",
                               "--out", str(tmp_path)])
    assert summary["tiny-qwen2"]["problems"] == 3
    written = json.loads((tmp_path / "summary.json").read_text())
    assert written["models"]["tiny-qwen2"]["samples"] == 2
    rows = [json.loads(line) for line in (tmp_path / "samples-tiny-qwen2.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and set(rows[0]) == {"question", "level", "completion", "extracted", "gold",
                                               "reward", "correct"}
    out = capsys.readouterr().out
    assert "mean@2" in out
    # where it runs, as train.py's first line says it (train.py adds its memory estimate)
    assert out.startswith("[eval tiny-qwen2] cpu (") and "(float32 master weights" in out.splitlines()[0]


def test_the_stop_set_is_worked_out_once_per_model(monkeypatch):
    """Not at every batch: it renders the chat template (model.end_of_turn_token)."""
    calls, real = [], model_module.stop_token_ids
    monkeypatch.setattr(evaluation, "stop_token_ids", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(model_module, "stop_token_ids", lambda *a: pytest.fail("worked out per batch"))
    evaluation.main(["--model", "tiny-qwen2", "--dataset", "arith-add1", "--limit", "3", "--batch-size", "1",
                     "--max-new-tokens", "2"])
    assert len(calls) == 1


@pytest.mark.parametrize("argv, message", [
    (["--dataset", "missing.jsonl"], "not found"),
    (["--model", "no-such-model", "--dataset", "arith-add1"], "unknown model"),
    (["--dataset", "arith-add1", "--samples", "2", "--temperature", "0", "--model", "tiny-qwen2"],
     "temperature"),
    (["--seed", str(2**64)], "--seed: must be in [-9223372036854775808, 18446744073709551615]"),
])
def test_cli_errors_are_one_line(argv, message, capsys):
    with pytest.raises(SystemExit) as info:
        evaluation.main(argv)
    said = str(info.value.code) if info.value.code != 2 else capsys.readouterr().err.strip()  # 2: a flag's
    assert message in said and "\n" not in said


def test_cli_takes_the_reward_flag(tmp_path, monkeypatch):
    (tmp_path / "eval_test_rewards.py").write_text("def always_right(completion, gold):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    summary = evaluation.main(["--model", "tiny-qwen2", "--dataset", "arith-mix", "--limit", "3",
                               "--max-new-tokens", "2", "--reward", "eval_test_rewards:always_right"])
    assert summary["tiny-qwen2"]["accuracy"] == 1.0
    # levels interleaved
    assert summary["tiny-qwen2"]["accuracy_by_level"] == {"add1": 1.0, "mul1": 1.0, "add2": 1.0}


# ---------------------------------------------------------------- --out: only what eval.py wrote (issue 54)

EVAL = ["--model", "tiny-qwen2", "--dataset", "arith-add1", "--limit", "1", "--max-new-tokens", "2"]


def files_under(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def refused_before_any_model(monkeypatch, argv: list[str]) -> str:
    monkeypatch.setattr(evaluation, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    with pytest.raises(SystemExit) as info:
        evaluation.main(argv)
    line = str(info.value.code)
    assert line.startswith("error: ") and "\n" not in line
    return line


def test_eval_out_at_a_run_folder_is_refused_and_its_summary_kept(tmp_path, monkeypatch):
    """Before issue 54, `eval.py --out <run>/grpo` replaced the training run's summary.json."""
    with owned(tmp_path / "runs", "runs") as runs:
        runs.subfolder("grpo", "run").write("summary.json", '{"algo": "grpo"}')
    before = files_under(tmp_path / "runs")
    line = refused_before_any_model(monkeypatch, EVAL + ["--out", str(tmp_path / "runs" / "grpo")])
    assert f"{tmp_path / 'runs' / 'grpo'} holds a run of train.py" in line
    assert files_under(tmp_path / "runs") == before


def test_eval_out_at_a_users_folder_touches_none_of_its_files(tmp_path, monkeypatch):
    """Before issue 54, eval.py replaced a user's summary.json and samples-*.jsonl there and deleted the
    same-named .tmp files."""
    out = tmp_path / "mine"
    out.mkdir()
    for name in ("summary.json", "samples-tiny-qwen2.jsonl", "summary.json.tmp",
                 "samples-tiny-qwen2.jsonl.tmp"):
        (out / name).write_text(f"the user's {name}")
    before = files_under(out)
    line = refused_before_any_model(monkeypatch, EVAL + ["--out", str(out)])
    assert f"{out} holds files and no record" in line
    assert files_under(out) == before


@pytest.mark.parametrize("name", ["summary.json", "samples-tiny-qwen2.jsonl"])
def test_a_symlink_at_a_file_eval_writes_stops_it_in_one_line_and_its_target_stays(tmp_path, monkeypatch,
                                                                                  name):
    with owned(tmp_path / "out", "eval") as folder:  # a folder eval.py writes, as an evaluation leaves it
        folder.save()
    target = tmp_path / "target"
    target.write_text("the user's")
    (tmp_path / "out" / name).symlink_to(target)
    line = refused_before_any_model(monkeypatch, EVAL + ["--out", str(tmp_path / "out")])
    assert line.startswith(f"error: {tmp_path / 'out' / name} is not written here")
    assert target.read_text() == "the user's" and (tmp_path / "out" / name).is_symlink()


def test_eval_writes_its_own_folder_again(tmp_path):
    for seed in ("0", "1"):  # the second replaces the first's files: its own
        evaluation.main(EVAL + ["--out", str(tmp_path / "out"), "--seed", seed])
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == [RECORD, "samples-tiny-qwen2.jsonl",
                                                                    "summary.json"]

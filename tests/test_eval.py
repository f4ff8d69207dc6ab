"""eval.py: the pass@k estimator, scoring of known completions, the CLI on the tiny model."""

import json
import os
from math import comb
from pathlib import Path

import pytest
import torch

import eval as evaluation
import model as model_module
from data.tasks import Problem
from eval import evaluate, pass_at_k
from infra import memory
from infra.memory import STATIC, estimate_memory
from infra.model_files import tiny_qwen2
from model import Rollout
from test_faults import in_a_small_process, killed_at
from infra.written import RECORD, owned
from verifier import per_completion


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
    model, tokenizer = tiny_qwen2()  # a second model: tiny-qwen2 saved to a folder
    for part in (model, tokenizer):
        part.save_pretrained(tmp_path / "tiny")
    out = tmp_path / "out"
    summary = evaluation.main(["--model", "tiny-qwen2", str(tmp_path / "tiny"), "--dataset", "arith-add1",
                               "--limit", "3", "--samples", "2", "--max-new-tokens", "4", "--out", str(out)])
    assert summary["tiny-qwen2"]["problems"] == 3
    written = json.loads((out / "summary.json").read_text())
    assert list(written["models"]) == ["tiny-qwen2", str(tmp_path / "tiny")]
    assert written["models"]["tiny-qwen2"]["samples"] == 2
    rows = [json.loads(line) for line in (out / "samples-tiny-qwen2.jsonl").read_text().splitlines()]
    assert len(rows) == 6 and set(rows[0]) == {"question", "level", "completion", "extracted", "gold",
                                               "reward", "correct"}
    second = f"samples-{evaluation.slug(str(tmp_path / 'tiny'))}.jsonl"
    assert sorted(p.name for p in out.iterdir()) == sorted([RECORD, "summary.json", second,
                                                            "samples-tiny-qwen2.jsonl"])
    said = capsys.readouterr().out
    assert "mean@2" in said and f"wrote {out / 'summary.json'} and 2 samples-*.jsonl beside it" in said
    # where it runs, as train.py's first line says it, with the memory of sampling alone (issue 61)
    first = said.splitlines()[0]
    assert first.startswith("[eval tiny-qwen2] cpu (") and "(float32 master weights" in first
    assert "; memory ~" in first and "sampling (prefill, KV cache)" in first and "AdamW" not in first


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


# ---------------------------------------------------------------- issue 61: names, kills, memory, context


@pytest.mark.parametrize("models, says", [
    (["x/grpo/checkpoint", "x_grpo/checkpoint"], "--model x/grpo/checkpoint and x_grpo/checkpoint would both "
                                                 "write samples-x_grpo_checkpoint.jsonl"),
    (["runs/Tiny", "runs/tiny"], "--model runs/Tiny and runs/tiny would both write samples-runs_tiny.jsonl"),
    (["tiny-qwen2", "tiny-qwen2"], "--model tiny-qwen2 is given twice"),
])
def test_two_models_with_one_result_name_are_refused_before_any_model(tmp_path, monkeypatch, capsys, models,
                                                                       says):
    """Before, the second model's samples replaced the first's, and eval.py said it wrote two files."""
    for loader in ("load_config", "load_tokenizer"):
        monkeypatch.setattr(evaluation, loader, lambda *a, **k: pytest.fail("a model's files were read"))
    with pytest.raises(SystemExit) as info:
        evaluation.main(EVAL[2:] + ["--model", *models, "--out", str(tmp_path / "out")])
    line = capsys.readouterr().err.strip()
    assert info.value.code == 2 and says in line and "\n" not in line
    assert not (tmp_path / "out").exists()


def results_of(generation: str) -> tuple[dict, dict]:
    """(summary, results) of two models as `evaluate` gives them, each record naming `generation`."""
    results = {name: {"accuracy": 0.5, "records": [{"completion": generation}] * 2} for name in ("m1", "m2")}
    return {name: {"accuracy": 0.5} for name in results}, results


def generations(out: Path) -> dict[str, str]:
    """Which evaluation wrote each results file in `out`."""
    found = {}
    for path in out.glob("samples-*.jsonl"):
        found[path.name] = {json.loads(line)["completion"] for line in path.read_text().splitlines()}.pop()
    if (out / "summary.json").exists():
        found["summary.json"] = json.loads((out / "summary.json").read_text())["dataset"]
    return found


def test_results_killed_at_every_moment_of_their_write_never_lie_and_the_next_write_repairs_them(tmp_path):
    """eval.py's write of its results killed before or after each os call that changes --out, once per moment
    (forked): a summary.json left is the one whose samples lie beside it (before, a kill between two files
    left new samples beside the old summary), and the next write into --out leaves its own results whole and
    no temporary (before, temporaries stayed for ever). Forked from a small process (`in_a_small_process`)."""
    in_a_small_process(results_killed_at_every_moment, tmp_path)


def results_killed_at_every_moment(tmp_path: Path) -> None:
    for n in range(10**4):
        out = tmp_path / str(n)
        evaluation.write_results(out, *results_of("old"), "old", 0.0)
        if (pid := os.fork()) == 0:
            try:
                killed_at(n)
                evaluation.write_results(out, *results_of("new"), "new", 0.0)
                os._exit(3)  # the write ended: n is past its last moment
            finally:
                os._exit(4)  # it failed: never back into pytest in this child
        ended = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        assert ended in (0, 3), f"killed at {n}: exit {ended}"
        left = generations(out)
        if "summary.json" in left:
            assert set(left.values()) == {left["summary.json"]}, f"killed at {n}: {left}"
        evaluation.write_results(out, *results_of("next"), "next", 0.0)
        assert sorted(p.name for p in out.iterdir()) == [RECORD, "samples-m1.jsonl", "samples-m2.jsonl",
                                                        "summary.json"], f"killed at {n}"
        assert set(generations(out).values()) == {"next"}
        if ended == 3:
            break
    assert n > 20  # every moment of the write was reached: it makes more changes than this


def test_the_estimate_of_an_evaluation_holds_sampling_alone():
    """eval.py never updates: no optimizer, gradients or update phase; its bf16 copy has no gradients."""
    config = model_module.load_config("tiny-qwen2")
    shapes = dict(rows=8, prompt_len=40, completion_len=64, micro_batch=4, bf16=True, reference=False,
                  checkpointing=False)
    terms = estimate_memory(config, 1000, **shapes, training=False)
    assert terms["weights"] == 4000 and terms["working_copy"] == 2000
    assert terms["optimizer"] == terms["gradients"] == terms["activations"] == terms["logits"] == 0
    assert terms["total"] == sum(terms[k] for k in STATIC) + terms["sampling"]
    trained = estimate_memory(config, 1000, **shapes, training=True)
    assert trained["sampling"] == terms["sampling"] and trained["working_copy"] == 4000


@pytest.mark.parametrize("samples", [1, 4])
def test_the_first_line_estimates_every_row_one_generate_call_samples(samples):
    """--samples n: n completions of each of --batch-size prompts in one generate call, n times the rows of
    the KV cache; an estimate of one completion each (M8) would pass a card that n of them overflow."""
    args = evaluation.parse_args(["--model", "tiny-qwen2", "--samples", str(samples), "--temperature", "1",
                                  "--batch-size", "3"])
    model, _ = tiny_qwen2()
    line = evaluation.where_it_runs(args, model, model, prompt_len=600, problems=10)
    config = model.config
    terms = estimate_memory(config, sum(p.numel() for p in model.parameters()), rows=3 * samples,
                            prompt_len=600, completion_len=args.max_new_tokens, micro_batch=0, bf16=False,
                            reference=False, checkpointing=False, training=False)
    assert f"sampling (prefill, KV cache) {memory.size(terms['sampling'])}" in line


def test_a_prompt_longer_than_the_context_is_refused_in_one_line_before_any_model(tmp_path, monkeypatch):
    """Before, eval.py warned and then died in a traceback from the causal mask (1 TB for a 1 MB question);
    train.py refused the same file in one line. tiny-qwen2 has a context of 1,024 tokens, a token a byte."""
    data = tmp_path / "long.jsonl"
    data.write_text("".join(json.dumps({"problem": q, "answer": "1"}) + "\n" for q in ("1?", "7 " * 1500)))
    line = refused_before_any_model(monkeypatch, ["--model", "tiny-qwen2", "--dataset", str(data)])
    assert line.startswith(f"error: {data}:2: a prompt of ")
    assert "longer than the model's context of 1024" in line

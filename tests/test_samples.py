"""samples.jsonl and the group shown at each evaluation: the training groups in words, with the same rewards,
advantages and ACR as the step's metrics, and a bounded size."""

import dataclasses
import json

import pytest
import torch
import transformers

import train
from advantage import advantage_collapse_rate, avspo_advantages, grpo_advantages
from data.tasks import Problem
from infra.written import owned
from loop.metrics import SAMPLE_CHARS, SAMPLE_GROUPS, group_samples, show_group
from loop.run_folder import read_jsonl, resume_conflicts, start_logs, write_jsonl

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]
# even golds: every completion right (a collapsed group); odd golds: right by the completion's length (mixed)
HALF_COLLAPSED = ("def reward(completion, gold):\n"
                  "    return 1.0 if int(gold) % 2 == 0 else len(completion) % 2\n")


def test_a_record_holds_the_groups_rewards_both_advantages_and_its_end():
    """AVSPO treats the collapsed groups: their advantages differ from GRPO's zeros, and both are logged."""
    rewards = torch.tensor([[0.0, 1.0, 0.0, 1.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0],
                            [0.5, 0.5, 0.5, 0.5]])  # [B, G]
    advantages = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=2)
    problems = [Problem(f"What is {b} * 2?", str(2 * b)) for b in range(1, 4)]  # groups 1..3: process 1's
    texts = [f"answer {b}.{i}" for b in range(1, 4) for i in range(4)]
    replaced = torch.tensor([False, False, True, False])
    records = group_samples(5, problems, texts, 1, rewards, advantages, None, replaced)
    assert [r["group"] for r in records] == [1, 2, 3] and {r["step"] for r in records} == {5}
    assert [r["collapsed"] for r in records] == ["all-correct", "all-wrong", "all-equal"]
    assert [r["prompt"] for r in records] == [p.question for p in problems] and records[0]["gold"] == "2"
    assert records[1]["completions"] == [f"answer 2.{i}" for i in range(4)]
    grpo = grpo_advantages(rewards)
    for record, b in zip(records, (1, 2, 3)):
        assert record["rewards"] == rewards[b].tolist()
        assert record["advantages"] == pytest.approx(advantages[b].tolist(), abs=1e-4)
        assert record["grpo_advantages"] == pytest.approx(grpo[b].tolist(), abs=1e-4) == [0.0] * 4
    assert records[0]["advantages"][0] > 0.5 and records[1]["advantages"][0] < -0.5  # pushed up, pushed down
    assert [r.get("resampled", False) for r in records] == [False, True, False]
    assert "ref_rewards" not in records[0]  # AAPO's only
    aapo = group_samples(5, problems, texts, 1, rewards, advantages, rewards.flip(1), replaced)
    assert aapo[0]["ref_rewards"] == rewards[1].flip(0).tolist()


def test_a_record_stays_bounded_however_long_the_texts_and_large_the_batch():
    group_size, num_groups = 8, SAMPLE_GROUPS + 5
    rewards = torch.randint(0, 2, (num_groups, group_size)).float()
    problems = [Problem("Q" * 10_000, "7" * 10_000) for _ in range(num_groups)]
    texts = ["x\n" * 20_000] * (num_groups * group_size)
    records = group_samples(1, problems, texts, 0, rewards, grpo_advantages(rewards), None,
                            torch.zeros(num_groups, dtype=torch.bool))
    assert len(records) == SAMPLE_GROUPS
    for record in records:
        assert len(record["completions"]) == group_size
        assert all(len(t) <= SAMPLE_CHARS for t in [record["prompt"], record["gold"], *record["completions"]])
        assert record["completions"][0].endswith("…")
        assert len(json.dumps(record)) < (group_size + 2) * 2 * SAMPLE_CHARS  # "\n" is two characters in JSON


def test_the_terminal_shows_a_collapsed_group_one_line_per_completion(capsys):
    rewards = torch.tensor([[1.0, 0.0], [0.0, 0.0]])  # the second collapsed
    problems = [Problem("What is 1 * 2?", "2"), Problem("What is\n3 * 3?", "9")]
    texts = ["2", "two", "It is\n\n8, surely " + "and " * 50, "6"]
    state = torch.random.get_rng_state()
    samples = group_samples(1, problems, texts, 0, rewards, grpo_advantages(rewards), None,
                            torch.zeros(2, dtype=torch.bool))
    show_group("grpo", 10, 0.5, samples)
    assert torch.equal(torch.random.get_rng_state(), state)  # logging draws no random number
    lines = capsys.readouterr().out.splitlines()
    assert len(lines) == 2 + 2  # a title, a header, G completions
    assert "step 10" in lines[0] and "0.500" in lines[0] and "all-wrong" in lines[0]
    assert "What is 3 * 3? (gold 9)" in lines[0]
    assert lines[2].split()[:4] == ["0.00", "+0.000", "+0.000", "It"] and "8, surely and" in lines[2]
    assert all(len(line) <= 110 for line in lines[1:])


def test_samples_match_the_steps_metrics(tmp_path, monkeypatch, capsys):
    """Every step's groups (--log-samples every, one process: all B groups): the rewards, advantages and ACR
    that metrics.jsonl reports for the step. AVSPO, triggered on any collapse, moves the collapsed groups'
    advantages away from GRPO's zeros, and the records carry AVSPO's; DAPO's are the groups it trained, after
    resampling."""
    (tmp_path / "half_collapsed.py").write_text(HALF_COLLAPSED)
    monkeypatch.syspath_prepend(str(tmp_path))
    train.main(TINY + ["--algo", "avspo,dapo", "--acr-threshold", "0", "--fixed-threshold", "--steps", "3",
                       "--prompts-per-step", "4", "--reward", "half_collapsed:reward",
                       "--log-samples", "every", "--eval-every", "2", "--save-every", "0",
                       "--out", str(tmp_path / "run")])
    for algo in ("avspo", "dapo"):
        metrics = read_jsonl(tmp_path / "run" / algo / "metrics.jsonl")
        samples = read_jsonl(tmp_path / "run" / algo / "samples.jsonl")
        assert [r["step"] for r in samples] == [1, 1, 1, 1, 2, 2, 2, 2, 3, 3, 3, 3]
        for row in metrics:
            groups = [r for r in samples if r["step"] == row["step"]]
            assert [r["group"] for r in groups] == [0, 1, 2, 3]
            rewards = torch.tensor([r["rewards"] for r in groups])  # [B, G]
            advantages = torch.tensor([r["advantages"] for r in groups])  # [B, G]
            assert rewards.mean().item() == pytest.approx(row["reward_mean"])
            collapsed = [r["collapsed"] for r in groups]
            assert row["acr"] == advantage_collapse_rate(rewards) == sum(map(bool, collapsed)) / 4
            assert collapsed.count("all-correct") / 4 == row["all_correct_frac"]
            assert advantages.abs().mean().item() == pytest.approx(row["adv_abs_mean"], abs=1e-4)
            assert "".join("01"[bool(a.abs().max() > 0)] for a in advantages) == row["groups_signal"]
            assert "".join("01"[r.get("resampled", False)] for r in groups) == row["groups_replaced"]
            for r in groups if algo == "avspo" else []:  # a collapsed group: AVSPO's advantages, not zeros
                assert r["advantages"] != r["grpo_advantages"] == [0.0] * 4 or not r["collapsed"]
        assert any(row["acr" if algo == "avspo" else "resampled_groups"] > 0 for row in metrics)  # it acted
    assert capsys.readouterr().out.count("a training group of this step") == 4  # steps 2 and 3, twice


def test_by_default_only_evaluation_steps_are_logged_and_a_flag_quiets_the_terminal(tmp_path, capfd):
    """... and no library's progress bar: loading the model and saving a checkpoint print nothing."""
    transformers.logging.enable_progress_bar()  # as in a fresh process: start_run turns them off
    train.main(TINY + ["--steps", "3", "--eval-every", "2", "--no-show-group", "--out", str(tmp_path)])
    assert sorted({r["step"] for r in read_jsonl(tmp_path / "grpo" / "samples.jsonl")}) == [2, 3]
    out, err = capfd.readouterr()
    assert "a training group" not in out and (tmp_path / "grpo" / "checkpoint").exists()
    assert "Loading weights" not in err and "Writing model shards" not in err
    train.main(TINY + ["--steps", "1", "--log-samples", "none", "--save-every", "0", "--overwrite", "--out",
                       str(tmp_path)])
    assert read_jsonl(tmp_path / "grpo" / "samples.jsonl") == []  # and the replaced run's are gone


def test_a_resumed_run_keeps_the_samples_its_checkpoint_covers_and_may_log_otherwise(tmp_path):
    with owned(tmp_path, "run") as folder:
        write_jsonl(folder, "samples.jsonl", [{"step": s, "group": 0} for s in (10, 20, 30)])
        folder.write("config.json", json.dumps(dataclasses.asdict(train.Args())))
        start_logs(folder, {}, 20)
    assert [r["step"] for r in read_jsonl(tmp_path / "samples.jsonl")] == [10, 20]
    # what is logged and shown leaves the steps as they were: --resume may change it
    assert resume_conflicts(tmp_path, train.Args(log_samples="every", show_group=False)) is None

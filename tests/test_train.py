"""The training loop on the tiny random Qwen2 model: loss, masking, gradients, resume, end to end."""

import json

import pytest
import torch

import train
from advantage import avspo_advantages
from model import completion_logprobs, completion_mask_from_eos, load_model, sample

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-qwen2", torch.device("cpu"))
    return model.eval(), tokenizer


@pytest.fixture()
def rollout(tiny):
    torch.manual_seed(0)
    return sample(*tiny, ["What is 2 + 3?", "What is 12 * 7? Think step by step."], 4, 8)


def run_update(tiny, rollout, advantages, **overrides):
    """One update_policy call on a fresh copy of the tiny model; returns (stats, weights before, weights after)."""
    model, _ = load_model("tiny-qwen2", torch.device("cpu"))
    args = train.Args(micro_batch=3, **overrides)  # 3 does not divide 8 rows: exercises uneven micro-batches
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train.update_policy(model, optimizer, rollout, advantages, None, args, torch.autocast("cpu", enabled=False))
    return stats, before, [p.detach() for p in model.parameters()]


def test_ratio_is_one_and_gradient_is_reinforce():
    logp = torch.randn(3, 5, requires_grad=True)
    advantages, mask = torch.tensor([1.0, -0.5, 0.0]), torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0]])
    loss, _ = train.policy_loss(logp, logp.detach(), None, advantages, mask, train.Args(), int(mask.sum()))
    (grad,) = torch.autograd.grad(loss, logp)
    reinforce = -(advantages[:, None] * logp * mask).sum() / mask.sum()
    (expected,) = torch.autograd.grad(reinforce, logp)
    assert torch.exp(logp - logp.detach()).eq(1).all()
    # the value is -mean(A) over tokens (the log-probs cancel in the ratio), the gradient is REINFORCE's
    assert loss.item() == pytest.approx((-(advantages[:, None] * mask).sum() / mask.sum()).item())
    torch.testing.assert_close(grad, expected)


def test_kl_is_zero_against_itself_and_positive_otherwise():
    logp = torch.log_softmax(torch.randn(2, 4), dim=1)
    mask = torch.ones(2, 4)
    _, kl_same = train.policy_loss(logp, logp, logp, torch.zeros(2), mask, train.Args(beta=0.1), 8)
    _, kl_diff = train.policy_loss(logp, logp, logp + 0.3, torch.zeros(2), mask, train.Args(beta=0.1), 8)
    assert kl_same.item() == 0.0 and kl_diff.item() > 0


def test_eos_mask_by_position_when_pad_equals_eos():
    eos = 2
    ids = torch.tensor([[5, 7, eos, eos, eos], [5, 6, 7, 8, 9], [eos, eos, eos, eos, eos]])
    expected = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    assert completion_mask_from_eos(ids, eos).equal(expected)


def test_batched_logprobs_match_unpadded_rows(tiny, rollout):
    model, _ = tiny
    batched = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    for row in range(rollout.input_ids.shape[0]):
        keep = rollout.attention_mask[row].bool()
        keep[-rollout.completion_len :] = True  # the row alone, prompt padding removed
        alone = completion_logprobs(model, rollout.input_ids[row, keep][None], torch.ones(1, int(keep.sum())),
                                    rollout.completion_len)
        m = rollout.completion_mask[row].bool()
        torch.testing.assert_close(batched[row, m], alone[0, m], atol=1e-4, rtol=1e-4)


def test_zero_advantages_give_zero_gradient(tiny, rollout):
    stats, before, after = run_update(tiny, rollout, torch.zeros(8))
    assert stats["grad_norm"] == 0.0
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_avspo_collapsed_group_gives_nonzero_gradient(tiny, rollout):
    advantages = avspo_advantages(torch.zeros(2, 4), acr_threshold=0.0)  # two all-wrong groups
    stats, before, after = run_update(tiny, rollout, advantages.flatten())
    assert stats["grad_norm"] > 0
    assert any(not torch.equal(a, b) for a, b in zip(before, after))


def test_skipping_zero_advantage_rows_keeps_the_gradient(tiny, rollout):
    model, _ = load_model("tiny-qwen2", torch.device("cpu"))
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5])  # first group collapsed
    mask = rollout.completion_mask
    logp = completion_logprobs(model, rollout.input_ids, rollout.attention_mask, rollout.completion_len)
    loss, _ = train.policy_loss(logp, logp.detach(), None, advantages, mask, train.Args(), int(mask.sum()))
    expected = torch.autograd.grad(loss, list(model.parameters()))  # every row, no skipping, no trimming
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # weight change = -gradient
    stats = train.update_policy(model, sgd, rollout, advantages, None, train.Args(micro_batch=3, max_grad_norm=1e9),
                                torch.autocast("cpu", enabled=False))
    assert stats["rows_trained"] == 4
    for b, a, g in zip(before, model.parameters(), expected):
        torch.testing.assert_close(b - a.detach(), g, atol=1e-6, rtol=1e-4)


def test_pad_tokens_carry_no_loss(tiny, rollout):
    advantages = torch.linspace(-1, 1, 8)
    reference, _, _ = run_update(tiny, rollout, advantages)
    scrambled = rollout.input_ids.clone()
    pad_positions = rollout.attention_mask == 0  # left prompt padding and everything after each EOS
    scrambled[pad_positions] = torch.randint(3, 200, (int(pad_positions.sum()),))
    stats, _, _ = run_update(tiny, train.Rollout(scrambled, rollout.attention_mask, rollout.completion_mask,
                                                 rollout.texts, rollout.truncated), advantages)
    assert stats["loss"] == pytest.approx(reference["loss"], abs=1e-6)
    assert stats["grad_norm"] == pytest.approx(reference["grad_norm"], rel=1e-4)


def test_nan_loss_skips_update_and_keeps_weights(tiny, rollout):
    stats, before, after = run_update(tiny, rollout, torch.full((8,), float("nan")))
    assert stats["skipped"] == 1
    assert all(torch.equal(a, b) for a, b in zip(before, after))


def test_each_algorithm_runs_end_to_end(tmp_path):
    summaries = train.main(TINY + ["--algo", "grpo,avspo,aapo", "--steps", "2", "--out", str(tmp_path),
                                   "--eval-every", "1", "--beta", "0.05", "--grad-checkpointing"])
    assert [s["algo"] for s in summaries] == ["grpo", "avspo", "aapo"]
    for algo in ("grpo", "avspo", "aapo"):
        rows = [json.loads(line) for line in (tmp_path / algo / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in rows] == [1, 2]
        for key in ("reward_mean", "acr", "acr_effective", "all_correct_frac", "all_wrong_frac", "grad_norm",
                    "kl", "completion_len", "truncated_frac", "time_generate", "time_score", "time_train"):
            assert key in rows[0], key
        assert rows[0]["kl"] == pytest.approx(0.0, abs=1e-6)  # policy == reference before the first step
        evals = [json.loads(line) for line in (tmp_path / algo / "evals.jsonl").read_text().splitlines()]
        assert [e["step"] for e in evals] == [0, 1, 2]
        assert (tmp_path / algo / "checkpoint" / "model" / "config.json").exists()
    assert "virtual_samples" in json.loads((tmp_path / "avspo" / "metrics.jsonl").read_text().splitlines()[0])
    assert "margin_mean" in json.loads((tmp_path / "aapo" / "metrics.jsonl").read_text().splitlines()[0])
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize("algo", ["avspo", "aapo"])
def test_resume_reproduces_the_next_step(tmp_path, algo):
    common = TINY + ["--algo", algo, "--eval-every", "0", "--lr", "1e-2"]
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "straight")])
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "resumed")])
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "resumed"), "--resume"])
    volatile = ("time_", "_per_s")
    rows = {}
    for run in ("straight", "resumed"):
        lines = (tmp_path / run / algo / "metrics.jsonl").read_text().splitlines()
        rows[run] = [{k: v for k, v in json.loads(line).items() if not any(t in k for t in volatile)} for line in lines]
    assert [r["step"] for r in rows["resumed"]] == [1, 2, 3]
    assert len(rows["resumed"]) == len(rows["straight"])
    for resumed, straight in zip(rows["resumed"], rows["straight"]):
        assert resumed == pytest.approx(straight)


def test_bad_dataset_line_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "oops"\n')
    with pytest.raises(SystemExit):
        train.main(TINY + ["--dataset", str(bad), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert f"{bad}:3" in err and "not valid JSON" in err
    assert not (tmp_path / "run").exists()  # nothing was started, nothing lost


def test_unknown_model_is_one_line_error(tmp_path):
    with pytest.raises(SystemExit, match="unknown model"):
        train.main(["--model", "no-such-model", "--steps", "1", "--out", str(tmp_path / "run")])
    assert not (tmp_path / "run" / "grpo").exists()


def test_ctrl_c_saves_a_checkpoint_that_resumes(tmp_path, monkeypatch):
    common = TINY + ["--algo", "grpo", "--eval-every", "0", "--steps", "3", "--out", str(tmp_path)]
    real_update, calls = train.update_policy, []

    def interrupt_on_second_step(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise KeyboardInterrupt
        return real_update(*args, **kwargs)

    monkeypatch.setattr(train, "update_policy", interrupt_on_second_step)
    with pytest.raises(KeyboardInterrupt):
        train.main(common)
    state = torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=False)
    assert state["step"] == 1  # the interrupted step 2 is not counted
    monkeypatch.setattr(train, "update_policy", real_update)
    train.main(common + ["--resume"])
    steps = [json.loads(line)["step"] for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


@pytest.mark.parametrize("flag, value", [("--group-size", "1"), ("--micro-batch", "0"), ("--algo", "ppo")])
def test_bad_flags_are_rejected_before_anything_runs(flag, value, tmp_path):
    with pytest.raises(SystemExit):
        train.main(TINY + [flag, value, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())

"""The training loop on the tiny random Qwen2 model: loss, masking, gradients, resume, torchrun, end to
end."""

import json
import os
import re
import signal
import subprocess
import sys
from contextlib import nullcontext
from functools import partial
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

import model as model_module
import train
from advantage import avspo_advantages, grpo_advantages
from data.tasks import Problem, step_problems
from infra.flags import arg, dataclass_parser
from infra.hardware import working_copy
from infra.written import owned
from loop import run as run_module
from loop.metrics import collapse_warning, early_steps, group_map, step_metrics, summarise_run
from loop.run_folder import find_checkpoint, read_jsonl, start_logs, write_jsonl
from model import completion_logprobs, completion_mask_from_eos, load_model, sample

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]
ROOT = Path(__file__).resolve().parent.parent
LOSS = dict(clip_low=0.2, clip_high=0.2, beta=0.0)


@pytest.fixture(scope="module")
def tiny():
    model, tokenizer = load_model("tiny-qwen2", torch.device("cpu"))
    return model.eval(), tokenizer


@pytest.fixture()
def rollout(tiny):
    torch.manual_seed(0)
    return sample(*tiny, ["What is 2 + 3?", "What is 12 * 7? Think step by step."], 4, 8)


def run_update(tiny, rollout, advantages, fused=True, **overrides):
    """One update_policy call on a fresh copy of the tiny model; returns (stats, weights before, weights
    after)."""
    model, _ = load_model("tiny-qwen2", torch.device("cpu"))
    args = train.Args(**{"micro_batch": 3, **overrides})  # 3 does not divide 8 rows: uneven micro-batches
    # fused: as train.py
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=fused)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train.update_policy(model, model, optimizer, rollout, advantages, None, args)
    return stats, before, [p.detach() for p in model.parameters()]


def test_ratio_is_one_and_gradient_is_reinforce():
    logp = torch.randn(3, 5, requires_grad=True)
    advantages, mask = (torch.tensor([1.0, -0.5, 0.0]),
                        torch.tensor([[1, 1, 1, 0, 0], [1] * 5, [1, 1, 0, 0, 0]]))
    loss, _ = train.policy_loss(logp, logp.detach(), None, advantages, mask, **LOSS,
                                num_tokens=int(mask.sum()))
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
    kl = dict(clip_low=0.2, clip_high=0.2, beta=0.1, num_tokens=8)
    _, kl_same = train.policy_loss(logp, logp, logp, torch.zeros(2), mask, **kl)
    _, kl_diff = train.policy_loss(logp, logp, logp + 0.3, torch.zeros(2), mask, **kl)
    assert kl_same.item() == 0.0 and kl_diff.item() > 0


def test_kl_is_k3_whose_mean_over_the_policys_samples_is_kl_to_the_reference():
    """k3 = r - 1 - log r, r = pi_ref / pi (Schulman, 2020), per token: weighted by the policy's probabilities
    of sampling each token, it sums to KL(pi || pi_ref) exactly; with r = pi / pi_ref it would not."""
    torch.manual_seed(0)
    # pi, pi_ref [V]
    logp, ref_logp = torch.log_softmax(torch.randn(6), 0), torch.log_softmax(torch.randn(6), 0)
    loss_args = dict(clip_low=0.2, clip_high=0.2, beta=0.1, num_tokens=1)
    k3 = [train.policy_loss(logp[v].view(1, 1), logp[v].view(1, 1), ref_logp[v].view(1, 1), torch.zeros(1),
                            torch.ones(1, 1), **loss_args)[1] for v in range(6)]  # one sampled token each
    expected = (logp.exp() * (logp - ref_logp)).sum()  # KL(pi || pi_ref)
    assert sum(p * k for p, k in zip(logp.exp(), k3)).item() == pytest.approx(expected.item(), rel=1e-5)


def test_step_metrics_describe_the_whole_batch():
    """Groups all-correct, mixed (partial credit 0.5 is not correct), all-wrong (G=2); completions of
    1, 2, 3, 4, 1 and 1 tokens, two truncated."""
    rewards = torch.tensor([[1.0, 1.0], [0.5, 1.0], [0.0, 0.0]])  # [B, G]
    lengths = torch.tensor([1, 2, 3, 4, 1, 1])
    completion_mask = (torch.arange(4)[None, :] < lengths[:, None]).long()  # [N, C]
    rollout = train.Rollout(torch.zeros(6, 8, dtype=torch.long), torch.ones(6, 8), completion_mask, [""] * 6,
                            torch.tensor([False, True, False, True, False, False]))
    costs = {"generate": 2.0, "score": 0.5, "gen_tokens": 12}
    m = step_metrics(rewards, grpo_advantages(rewards), rollout, costs, torch.device("cpu"))
    assert (m["reward_mean"], m["accuracy"]) == (pytest.approx(3.5 / 6), 0.5)
    assert m["acr"] == m["acr_effective"] == pytest.approx(2 / 3)
    assert m["all_correct_frac"] == m["all_wrong_frac"] == pytest.approx(1 / 3)
    # per completion, not per group
    assert (m["completion_len"], m["truncated_frac"]) == (2.0, pytest.approx(1 / 3))
    assert (m["gen_tokens"], m["gen_tokens_per_s"], m["time_score"]) == (12, 6.0, 0.5)


def test_resampling_rounds_draw_other_prompts():
    """DAPO's rounds of a step draw other prompts than its first round (and than each other), the same every
    time."""
    problems = [Problem(f"What is {i} + 1?", str(i + 1), "add1") for i in range(50)]
    for step in (1, 2, 3):
        rounds = [[p.question for p in step_problems(problems, 4, 0, step, round)] for round in range(3)]
        assert len({tuple(r) for r in rounds}) == 3
        assert rounds[1] == [p.question for p in step_problems(problems, 4, 0, step, 1)]


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
    loss, _ = train.policy_loss(logp, logp.detach(), None, advantages, mask, **LOSS,
                                num_tokens=int(mask.sum()))
    expected = torch.autograd.grad(loss, list(model.parameters()))  # every row, no skipping, no trimming
    before = [p.detach().clone() for p in model.parameters()]
    sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # weight change = -gradient
    args = train.Args(micro_batch=3, max_grad_norm=1e9)
    stats = train.update_policy(model, model, sgd, rollout, advantages, None, args)
    assert stats["rows_trained"] == 4
    for b, a, g in zip(before, model.parameters(), expected):
        torch.testing.assert_close(b - a.detach(), g, atol=1e-6, rtol=1e-4)


def test_bf16_update_steps_the_float32_weights_and_the_working_copy_follows(rollout):
    """--precision bf16: forward and backward on the bf16 copy, the step on the float32 weights, which move as
    the float32 update moves them up to bf16 rounding; then the copy holds them, rounded."""
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 1.5, -0.5, -0.5, -0.5])
    deltas = {}
    for precision in ("fp32", "bf16"):
        model, _ = load_model("tiny-qwen2", torch.device("cpu"))
        net = working_copy(model, precision)
        before = [p.detach().clone() for p in model.parameters()]
        sgd = torch.optim.SGD(model.parameters(), lr=1.0)  # weight change = -gradient
        train.update_policy(model, net, sgd, rollout, advantages, None,
                            train.Args(micro_batch=3, max_grad_norm=1e9))
        deltas[precision] = torch.cat([(b - a.detach()).flatten()
                                       for b, a in zip(before, model.parameters())])
        assert all(p.dtype == torch.float32 for p in model.parameters())
        assert all(p.grad is None for p in net.parameters())
        for p, q in zip(net.parameters(), model.parameters()):
            assert torch.equal(p, q.to(p.dtype))
    exact, bf16 = deltas["fp32"], deltas["bf16"]
    assert (bf16 - exact).norm() < 0.05 * exact.norm()  # all three micro-batches, not the last one alone


def test_with_a_kl_penalty_no_row_is_skipped(tiny, rollout):
    """beta > 0: a row with advantage 0 still has the KL's gradient, so every row goes through the passes."""
    model, ref_model = (load_model("tiny-qwen2", torch.device("cpu"))[0] for _ in range(2))
    advantages = torch.tensor([0.0, 0.0, 0.0, 0.0, 1.5, -0.5, -0.5, -0.5])  # first group collapsed
    sgd = torch.optim.SGD(model.parameters(), lr=1e-3)
    reference = partial(nullcontext, ref_model.requires_grad_(False))  # as run.Run holds it
    stats = train.update_policy(model, model, sgd, rollout, advantages, reference,
                                train.Args(beta=0.1, micro_batch=3))
    assert stats["rows_trained"] == 8 and stats["kl"] is not None


def test_avspo_triggers_on_the_acr_of_groups_and_adapts_its_threshold_from_the_reward():
    """Groups, not completions, make the ACR: 3 of 4 groups collapsed is 0.75 > 0.5 (while 3 of 8 completions
    would not trigger). The first step starts the reward average; as the reward rises the threshold rises by
    one step (intervene less), and it acts from the next step on."""
    args, state = train.Args(algo="avspo"), train.algo_state(train.Args(algo="avspo"))
    _, log = train.compute_advantages(args, torch.tensor([[0.0, 0.0], [0.0, 0.0], [1.0, 0.0], [1.0, 0.0]]),
                                      state, None)
    assert state["threshold"].value == 0.5 and not log["avspo_triggered"]  # ACR 0.5 is not above 0.5
    _, log = train.compute_advantages(args, torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 0.0], [1.0, 0.0]]),
                                      state, None)
    assert log["avspo_triggered"] and log["acr_threshold"] == 0.5 and log["virtual_samples"] == 3 * 2  # K = 2
    assert state["threshold"].value == pytest.approx(0.55)  # the reward rose from 0.25 to 0.375


def test_find_checkpoint_takes_the_old_one_when_a_save_stopped_between_renames(tmp_path):
    assert find_checkpoint(tmp_path) is None
    for name in ("checkpoint.tmp", "checkpoint.old"):  # a save that stopped after moving the last one aside
        (tmp_path / name / "model").mkdir(parents=True)  # whole: torch.save's zip, complete safetensors
        torch.save({"step": 1}, tmp_path / name / "state.pt")
        save_file({"w": torch.zeros(2)}, tmp_path / name / "model" / "model.safetensors")
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint.old"
    (tmp_path / "checkpoint.tmp").rename(tmp_path / "checkpoint")
    assert find_checkpoint(tmp_path) == tmp_path / "checkpoint"


def rollout_cut_at(prompt_ids: torch.Tensor, lengths: list[int], width: int = 5) -> train.Rollout:
    """Prompts [N, P] (no padding) followed by `width` random completion tokens, row i's ending after
    lengths[i]."""
    n = len(prompt_ids)
    completion_mask = torch.tensor([[1] * k + [0] * (width - k) for k in lengths])  # [N, width]
    input_ids = torch.cat([prompt_ids, torch.randint(30, 200, (n, width))], dim=1)
    attention_mask = torch.cat([torch.ones_like(prompt_ids), completion_mask], dim=1)
    return train.Rollout(input_ids, attention_mask, completion_mask, [""] * n,
                         torch.zeros(n, dtype=torch.bool))


def test_micro_batches_hold_rows_of_similar_length(tiny, monkeypatch):
    """Completion lengths 1, 5, 1, 5 in micro-batches of 2: the short rows go together, so one micro-batch is
    1 token wide instead of both 5."""
    rollout = rollout_cut_at(torch.randint(3, 200, (4, 6)), [1, 5, 1, 5])
    widths, paths = [], train.fast_or_plain(True, torch.device("cpu"))

    def recording_logprobs(net, ids, attn, completion_len, *args, **kwargs):
        widths.append(completion_len)
        return paths.completion_logprobs(net, ids, attn, completion_len, *args, **kwargs)

    recording = paths._replace(completion_logprobs=recording_logprobs)
    monkeypatch.setattr(train, "fast_or_plain", lambda fast, device: recording)
    run_update(tiny, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), micro_batch=2)
    assert sorted(widths) == [1, 5]


def test_train_tokens_count_each_prompt_once_and_no_padding(tiny):
    """Two prompts (6 and 4 real tokens, the second left-padded) x G=2, completions of 1, 5 | 2, 3 tokens, in
    one micro-batch: trained tokens = 6 + 4 prompt tokens + 11 completion tokens, not the padded rectangle."""
    rollout = rollout_cut_at(torch.tensor([[10] * 6, [10] * 6, [0, 0, 20, 21, 22, 23],
                                           [0, 0, 20, 21, 22, 23]]), [1, 5, 2, 3])
    rollout.attention_mask[2:, :2] = 0  # the second prompt's left padding
    stats, _, _ = run_update(tiny, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), micro_batch=4, group_size=2)
    assert stats["train_tokens"] == 6 + 4 + (1 + 5 + 2 + 3)


def test_micro_batches_hold_one_prompts_rows(tiny, monkeypatch):
    """Two prompts x G=2, lengths 5, 1 | 1, 5, micro-batches of 2: by length alone the two 1-token rows (one
    of each prompt) would go together; each micro-batch holds one prompt's rows instead, so it runs one prompt
    pass."""
    rollout = rollout_cut_at(torch.tensor([[10] * 6, [10] * 6, [20] * 6, [20] * 6]), [5, 1, 1, 5])
    prompts_per_pass, paths = [], train.fast_or_plain(True, torch.device("cpu"))

    def recording_logprobs(net, ids, *args, **kwargs):
        prompts_per_pass.append(set(ids[:, 0].tolist()))
        return paths.completion_logprobs(net, ids, *args, **kwargs)

    recording = paths._replace(completion_logprobs=recording_logprobs)
    monkeypatch.setattr(train, "fast_or_plain", lambda fast, device: recording)
    run_update(tiny, rollout, torch.tensor([1.0, -1.0, 0.5, -0.5]), micro_batch=2, group_size=2)
    assert sorted(map(sorted, prompts_per_pass)) == [[10], [20]]


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
        # the final eval, per problem
        records = (tmp_path / algo / "eval_records.jsonl").read_text().splitlines()
        assert len(records) == 4 and {"question", "gold", "correct"} <= set(json.loads(records[0]))
    assert "virtual_samples" in json.loads((tmp_path / "avspo" / "metrics.jsonl").read_text().splitlines()[0])
    assert "margin_mean" in json.loads((tmp_path / "aapo" / "metrics.jsonl").read_text().splitlines()[0])
    assert (tmp_path / "curves.png").stat().st_size > 10_000


@pytest.mark.parametrize("algo", ["avspo", "aapo"])
def test_resume_reproduces_the_next_step(tmp_path, algo):
    # a linear schedule depends on --steps, which this test changes between the runs
    common = TINY + ["--algo", algo, "--eval-every", "0", "--lr", "1e-2", "--lr-decay", "0"]
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "straight")])
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "resumed")])
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "resumed"), "--resume"])
    volatile = ("time_", "_per_s", "peak_memory")  # the machine's measures
    rows = {}
    for run in ("straight", "resumed"):
        lines = (tmp_path / run / algo / "metrics.jsonl").read_text().splitlines()
        rows[run] = [{k: v for k, v in json.loads(line).items() if not any(t in k for t in volatile)}
                     for line in lines]
    assert [r["step"] for r in rows["resumed"]] == [1, 2, 3]
    assert len(rows["resumed"]) == len(rows["straight"])
    for resumed, straight in zip(rows["resumed"], rows["straight"]):
        assert resumed == pytest.approx(straight)


@pytest.mark.parametrize("last_step, kept_evals, kept_steps",
                         [(0, [], []), (1, [0], [1]), (2, [0, 2], [1, 2])])
def test_logs_keep_what_the_checkpoint_covers_and_a_fresh_run_keeps_nothing(tmp_path, last_step, kept_evals,
                                                                             kept_steps):
    """A fresh run in the folder of an earlier one must not inherit its step-0 evaluation: the summary's
    accuracy before training is the first record of evals.jsonl."""
    with owned(tmp_path, "run") as folder:
        write_jsonl(folder, "evals.jsonl", [{"step": s, "eval_accuracy": 0.5} for s in (0, 2, 4)])
        write_jsonl(folder, "metrics.jsonl", [{"step": s, "gen_tokens_total": 10 * s, "train_tokens_total": s}
                                              for s in (1, 2, 3, 4)])
        totals = start_logs(folder, {"seed": 1, "dataset": "arith-mix", "eval_dataset": ""}, last_step)
    assert [r["step"] for r in read_jsonl(tmp_path / "evals.jsonl")] == kept_evals
    assert [r["step"] for r in read_jsonl(tmp_path / "metrics.jsonl")] == kept_steps
    # where the resumed run goes on
    assert totals == {"gen_tokens": 10 * last_step, "train_tokens": last_step}


@pytest.mark.parametrize("decay, expected", [("0.5", [1.0, 1.0, 1.0, 0.5]), ("1", [1.0, 0.75, 0.5, 0.25]),
                                              ("0.25", [1.0] * 4), ("0", [1.0] * 4)])
def test_the_optimizer_steps_with_the_scheduled_lr(tmp_path, monkeypatch, decay, expected):
    real_update, seen = train.update_policy, []

    def update(model, net, optimizer, *args, **kwargs):
        seen.append(optimizer.param_groups[0]["lr"])
        return real_update(model, net, optimizer, *args, **kwargs)

    monkeypatch.setattr(train, "update_policy", update)
    train.main(TINY + ["--steps", "4", "--lr", "1e-3", "--lr-decay", decay, "--eval-every", "0",
                       "--save-every", "0", "--out", str(tmp_path)])
    assert seen == pytest.approx([1e-3 * e for e in expected])
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["lr"] for r in rows] == pytest.approx(seen)


def test_bad_dataset_line_is_named(tmp_path, capsys):
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1+1?", "answer": "#### 2"}\n\n{"question": "oops"\n')
    with pytest.raises(SystemExit):
        train.main(TINY + ["--dataset", str(bad), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert f"{bad}:3" in err and "not valid JSON" in err
    assert not (tmp_path / "run").exists()  # nothing was started, nothing lost


def test_unknown_model_is_one_line_error(tmp_path, capsys):
    with pytest.raises(SystemExit):  # with the flags: its tokenizer loads there, to check the prompt format
        train.main(["--model", "no-such-model", "--steps", "1", "--out", str(tmp_path / "run")])
    assert "unknown model 'no-such-model'" in capsys.readouterr().err.strip().splitlines()[-1]
    assert not (tmp_path / "run").exists()


def ctrl_c_during_update(presses: int):
    """An update_policy that, on the second step, gets `presses` Ctrl-Cs before it runs: one real SIGINT, or
    the installed handler called `presses` times (quick SIGINTs can merge into one before Python runs its
    handler)."""
    real_update, calls = train.update_policy, []

    def update(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2 and presses == 1:
            os.kill(os.getpid(), signal.SIGINT)
        elif len(calls) == 2:
            for _ in range(presses):
                signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return real_update(*args, **kwargs)
    return update


def test_ctrl_c_ends_the_step_saves_it_and_resumes(tmp_path, monkeypatch, capfd):
    common = TINY + ["--algo", "grpo", "--eval-every", "0", "--steps", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(train, "update_policy", ctrl_c_during_update(presses=1))
    # SIG_IGN, not Python's, in a job started in the background
    handler_before = signal.getsignal(signal.SIGINT)
    with pytest.raises(SystemExit) as exit_info:
        train.main(common)
    assert exit_info.value.code == 130  # the shell's code for Ctrl-C, and no traceback
    said = capfd.readouterr()
    assert said.out.strip().splitlines()[-1].startswith("[grpo] interrupted: step 2 saved")
    assert "--resume" in said.out and "stopping at the end of the step under way" in said.err
    state = torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=False)
    assert state["step"] == 2  # the step under way when Ctrl-C came was finished and counted
    assert signal.getsignal(signal.SIGINT) == handler_before  # the handler is put back
    monkeypatch.undo()
    train.main(common + ["--resume"])
    rows = [json.loads(line) for line in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    assert [r["lr"] for r in rows] == pytest.approx([2e-5, 2e-5 * 2 / 3, 2e-5 / 3])  # the resumed step's too


def test_resume_makes_up_the_evaluation_of_the_saved_step(tmp_path, monkeypatch):
    """Ctrl-C on an evaluation step saves it without evaluating (a kill between the checkpoint and the
    evaluation leaves the same files): the resumed run evaluates that step before it goes on."""
    common = TINY + ["--algo", "grpo", "--eval-every", "2", "--steps", "3", "--out", str(tmp_path)]
    monkeypatch.setattr(train, "update_policy", ctrl_c_during_update(presses=1))
    with pytest.raises(SystemExit):
        train.main(common)
    evals = tmp_path / "grpo" / "evals.jsonl"
    assert [e["step"] for e in read_jsonl(evals)] == [0]
    monkeypatch.undo()
    train.main(common + ["--resume"])
    assert [e["step"] for e in read_jsonl(evals)] == [0, 2, 3]


def test_ctrl_c_while_loading_starts_no_step(tmp_path, monkeypatch, capsys):
    """Python can drop a KeyboardInterrupt raised inside a weakref callback (seen while models load); the flag
    cannot be dropped, and the loop reads it before its first step."""
    real_load = run_module.load_model

    def load_then_ctrl_c(*args, **kwargs):
        signal.getsignal(signal.SIGINT)(signal.SIGINT, None)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(run_module, "load_model", load_then_ctrl_c)
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--algo", "grpo,avspo", "--steps", "3", "--out", str(tmp_path)])
    assert exit_info.value.code == 130
    assert "held-out accuracy before training" not in capsys.readouterr().out  # nor the first evaluation
    assert not (tmp_path / "grpo" / "metrics.jsonl").read_text() and not (tmp_path / "avspo").exists()


def test_ctrl_c_while_the_data_loads_is_one_line_and_130(tmp_path, monkeypatch, capfd):
    """The flags' checks read the data and the tokenizer: a Ctrl-C there asks to stop, as one while the model
    loads does, and the run stops before its first step."""
    real_load, calls = run_module.load_problems, []

    def load_then_ctrl_c(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:  # the flags' check (a second Ctrl-C would stop at once)
            os.kill(os.getpid(), signal.SIGINT)
        return real_load(*args, **kwargs)

    monkeypatch.setattr(run_module, "load_problems", load_then_ctrl_c)
    with pytest.raises(BaseException) as ended:  # a KeyboardInterrupt here would end pytest too
        train.main(TINY + ["--steps", "2", "--out", str(tmp_path)])
    assert ended.type is SystemExit and ended.value.code == 130
    err = capfd.readouterr().err
    assert "Traceback" not in err and err.strip().splitlines()[-1].startswith("Ctrl-C: stopping")
    assert not (tmp_path / "grpo" / "metrics.jsonl").read_text()


def test_a_model_error_of_several_lines_is_one_line(tmp_path, capsys):
    (tmp_path / "empty").mkdir()  # transformers' error for a folder without a tokenizer has five lines
    with pytest.raises(SystemExit):
        train.main(TINY + ["--model", str(tmp_path / "empty"), "--out", str(tmp_path / "run")])
    assert len(capsys.readouterr().err.strip().splitlines()) == 1


def test_the_seed_range_is_what_torch_manual_seed_takes_at_every_step(tmp_path, capsys):
    """train_step seeds torch with seed * 1_000_003 + step * 1_000 + rank, which torch takes in
    [-2**63, 2**64): the range refused is exactly the one outside it at some step, and both its ends train."""
    flags = TINY + ["--steps", "2", "--eval-every", "0", "--save-every", "0", "--eval-size", "1"]
    with pytest.raises(SystemExit):
        train.parse_args(flags + ["--seed", str(10**14), "--out", str(tmp_path)])
    refusal = re.search(r"--seed must be in \[(-\d+), (\d+)\]", capsys.readouterr().err)
    low, high = int(refusal[1]), int(refusal[2])
    assert (low, high) == (-((2**63 + 1_000) // 1_000_003), (2**64 - 1 - 2 * 1_000) // 1_000_003)
    for seed in (low, high):
        train.main(flags + ["--seed", str(seed), "--out", str(tmp_path / str(seed))])
    for seed in (low - 1, high + 1):
        with pytest.raises(SystemExit):
            train.parse_args(flags + ["--seed", str(seed), "--out", str(tmp_path)])


def test_held_out_prompts_count_for_the_context_and_the_memory_estimate(tmp_path, monkeypatch):
    """Every 10th line of a JSONL file is held out. Its prompt counts as the training prompts do: before, a
    10 MB held-out line passed unseen, and the evaluation before training then ran out of memory."""
    prompt_lens, real_estimate = [], run_module.estimate_memory
    monkeypatch.setattr(run_module, "estimate_memory",
                        lambda *a, **k: prompt_lens.append(k["prompt_len"]) or real_estimate(*a, **k))
    rows = [{"problem": f"{i} + 1?", "answer": str(i + 1)} for i in range(10)]
    data = tmp_path / "data.jsonl"
    for held_out in (600, 2_000):  # tiny-qwen2: one token a byte, a context of 1,024
        rows[9]["problem"] = "x" * held_out
        data.write_text("\n".join(json.dumps(row) for row in rows) + "\n")
        flags = TINY + ["--dataset", str(data), "--steps", "1", "--eval-every", "0", "--save-every", "0"]
        if held_out < 1_024:
            train.main(flags + ["--out", str(tmp_path / "fits")])
            assert prompt_lens[-1] > held_out
            continue
        with pytest.raises(SystemExit) as exit_info:
            train.main(flags + ["--out", str(tmp_path / "too_long")])
        assert str(exit_info.value.code).startswith(f"error: {data}:10: a prompt of ")
        assert "longer than the model's context of 1024" in str(exit_info.value.code)


def test_a_second_ctrl_c_stops_at_once_without_saving_half_a_step(tmp_path, monkeypatch):
    monkeypatch.setattr(train, "update_policy", ctrl_c_during_update(presses=2))
    with pytest.raises(SystemExit) as exit_info:
        train.main(TINY + ["--eval-every", "0", "--steps", "3", "--save-every", "1", "--out", str(tmp_path)])
    assert exit_info.value.code == 130
    state = torch.load(tmp_path / "grpo" / "checkpoint" / "state.pt", weights_only=False)
    assert state["step"] == 1  # step 2 was cut short: neither logged nor saved
    assert len((tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()) == 1


@pytest.mark.parametrize("flag, value", [("--group-size", "1"), ("--micro-batch", "0"), ("--algo", "ppo"),
                                         ("--lr-decay", "1.5"), ("--temperature", "0"),
                                         ("--temperature", "-1"), ("--lr", "nan"), ("--lr", "0"),
                                         ("--lr", "inf"), ("--top-p", "0"), ("--top-p", "1.5"),
                                         ("--beta", "-0.1"), ("--epsilon", "1"),
                                         ("--max-grad-norm", "0"), ("--acr-threshold", "2"),
                                         ("--virtual-delta", "0"), ("--virtual-delta", "1.5"),
                                         ("--delta-low", "-1"), ("--eval-size", "0"), ("--alpha", "nan"),
                                         ("--algo", "grpo,grpo"), ("--model", ""),
                                         ("--seed", "100000000000000")])
def test_bad_flags_are_rejected_before_anything_runs(flag, value, tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded too soon"))
    with pytest.raises(SystemExit):
        train.main(TINY + [flag, value, "--out", str(tmp_path)])
    assert not any(tmp_path.iterdir())
    error = capsys.readouterr().err.strip().splitlines()
    assert ": error: " in error[-1] and flag in error[-1]  # one line that names the flag
    assert not any("Traceback" in line for line in error)


def test_clipped_ratio_uses_each_bound():
    """With old != new log-probs the clip acts: above 1 + clip_high for A > 0, below 1 - clip_low for
    A < 0."""
    logp = torch.log(torch.tensor([[2.0], [0.5]]))  # ratios 2 and 0.5 against old log-probs of 0
    old, mask = torch.zeros(2, 1), torch.ones(2, 1)
    loss, _ = train.policy_loss(logp, old, None, torch.tensor([1.0, 0.0]), mask, clip_low=0.2, clip_high=0.3,
                                beta=0.0, num_tokens=1)
    assert loss.item() == pytest.approx(-1.3)  # min(2 * 1, 1.3 * 1): the upper bound is clip_high
    loss, _ = train.policy_loss(logp, old, None, torch.tensor([0.0, -1.0]), mask, clip_low=0.2, clip_high=0.3,
                                beta=0.0, num_tokens=1)
    assert loss.item() == pytest.approx(0.8)  # -min(0.5 * -1, 0.8 * -1): the lower bound is 1 - clip_low


def test_import_train_does_not_load_matplotlib():
    code = "import sys, train; print('matplotlib' in sys.modules)"
    # a hang guard, not a speed limit: 54 s pinned to a busy core here
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.stdout.strip() == "False", proc.stderr[-1000:]


def torchrun(*args: str, processes: int = 2) -> subprocess.CompletedProcess:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}  # one thread per process on a 2-core machine
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}",
           *args]
    return subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)


def test_two_processes_give_the_single_process_gradient(tmp_path):
    """Rows split over 2 gloo processes (both training, or one with no row to train): same weight change.
    Under LoRA the same adapter change, and every frozen weight unchanged, without a .grad."""
    single, split = tmp_path / "single.pt", tmp_path / "split.pt"
    proc = subprocess.run([sys.executable, "tests/distributed_update.py", str(single)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    proc = torchrun("tests/distributed_update.py", str(split))
    assert proc.returncode == 0, proc.stderr[-3000:]
    for case, one in torch.load(single).items():
        two = torch.load(split)[case]
        assert sum(d.abs().sum() for d in one["delta"].values()) > 0  # the check compares a real update
        assert one["delta"].keys() == two["delta"].keys()
        for name, a in one["delta"].items():
            torch.testing.assert_close(two["delta"][name], a, atol=1e-6, rtol=1e-4, msg=f"{case}: {name}")
        frozen = one["frozen"].keys()  # the frozen parameters' names: none under full fine-tuning
        assert bool(frozen) == case.startswith("LoRA") and frozen == two["frozen"].keys()
        assert not any([*one["frozen"].values(), *two["frozen"].values()]), f"{case}: a frozen .grad"
        assert all(not one["delta"][name].any() for name in frozen), case  # exactly unchanged
        for kind in ("lora_A", "lora_B") if frozen else ():  # A has a gradient too (B nonzero)
            assert all(d.any() for name, d in one["delta"].items() if kind in name), (case, kind)
        # not train_tokens: split, rows share other micro-batches
        for key in ("loss", "grad_norm", "rows_trained"):
            assert two["stats"][key] == pytest.approx(one["stats"][key], rel=1e-4, abs=1e-7), (case, key)


def test_torchrun_writes_the_same_logs_and_one_checkpoint_and_resumes(tmp_path):
    common = TINY + ["--algo", "avspo", "--eval-every", "0", "--prompts-per-step", "2",
                     "--lr-decay", "0"]  # a constant lr: --resume may then extend --steps
    assert train.main(common + ["--steps", "2", "--out", str(tmp_path / "one")])
    proc = torchrun("train.py", *common, "--steps", "2", "--out", str(tmp_path / "two"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    # AAPO's and DAPO's gathers across processes
    others = torchrun("train.py", *TINY, "--algo", "aapo,dapo", "--eval-every", "0",
                      "--prompts-per-step", "2", "--steps", "1", "--out", str(tmp_path / "others"))
    assert others.returncode == 0, others.stderr[-3000:]
    for algo, key in (("aapo", "ref_reward_mean"), ("dapo", "resampled_groups")):
        assert key in json.loads((tmp_path / "others" / algo / "metrics.jsonl").read_text().splitlines()[0])
    rows = {run: [json.loads(line)
                  for line in (tmp_path / run / "avspo" / "metrics.jsonl").read_text().splitlines()]
            for run in ("one", "two")}
    assert [r["step"] for r in rows["two"]] == [1, 2]  # written once, by process 0
    assert [sorted(r) for r in rows["two"]] == [sorted(r) for r in rows["one"]]
    assert all(r["rows_trained"] <= 8 and r["completion_len"] > 0 for r in rows["two"])
    assert sorted(p.name for p in (tmp_path / "two" / "avspo").iterdir()
                  if "checkpoint" in p.name) == ["checkpoint"]
    proc = torchrun("train.py", *common, "--steps", "3", "--out", str(tmp_path / "two"), "--resume")
    assert proc.returncode == 0, proc.stderr[-3000:]
    steps = [json.loads(line)["step"]
             for line in (tmp_path / "two" / "avspo" / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3]


def test_replace_groups_keeps_every_row_its_own_log_probs(tiny):
    """Groups from a rollout with other prompt and completion widths: each row's log-probs are unchanged."""
    model, tokenizer = tiny
    torch.manual_seed(1)
    base = sample(model, tokenizer, ["What is 2 + 3?", "What is 12 * 7? Think step by step."], 4, 8)
    new = sample(model, tokenizer, ["Name a prime number between 10 and 20, please."], 4, 5)
    merged = train.replace_groups(base, [0], new, 4, tokenizer.pad_token_id)

    def logprobs(r):
        return completion_logprobs(model, r.input_ids, r.attention_mask, r.completion_len) * r.completion_mask

    m, b, n = logprobs(merged), logprobs(base), logprobs(new)
    torch.testing.assert_close(m[:4, : new.completion_len], n, atol=1e-5, rtol=1e-4)  # the new group
    torch.testing.assert_close(m[4:, : base.completion_len], b[4:], atol=1e-5, rtol=1e-4)  # the kept group
    assert merged.texts == new.texts + base.texts[4:] and merged.completion_mask.sum() == (
        new.completion_mask.sum() + base.completion_mask[4:].sum())


@pytest.mark.parametrize("algo, rounds, expected_resampled", [("grpo", 2, 0), ("dapo", 2, 2), ("dapo", 1, 1)])
def test_dynamic_sampling_replaces_collapsed_groups_only(tiny, algo, rounds, expected_resampled):
    """Prompt 'ok-*' gets mixed rewards, 'dead-*' all zeros: DAPO redraws only dead groups, for `rounds`
    rounds."""
    model, tokenizer = tiny
    draws = {0: ["ok-0", "dead-0"], 1: ["dead-1", "dead-1b"], 2: ["x", "ok-2"]}  # round -> the B prompts

    def sample_and_score(network, problems):
        rollout = sample(network, tokenizer, [p.question for p in problems], 2, 4)
        rewards = torch.tensor([[1.0, 0.0] if p.question.startswith("ok") else [0.0, 0.0] for p in problems])
        return rollout, rewards

    args = train.Args(algo=algo, resample_rounds=rounds, group_size=2, prompts_per_step=2)
    rollout, problems, rewards, first, replaced, resampled = train.sample_batch(
        args, sample_and_score, model, lambda r: [Problem(q, "0") for q in draws[r]], slice(0, 2),
        tokenizer.pad_token_id)
    assert resampled == expected_resampled
    assert first.tolist() == [[1.0, 0.0], [0.0, 0.0]]  # the first round, as sampled
    assert replaced.tolist() == [False, expected_resampled > 0]
    assert rewards[0].tolist() == [1.0, 0.0]  # the mixed group is kept in every case
    assert rewards[1].tolist() == ([1.0, 0.0] if expected_resampled == 2 else [0.0, 0.0])
    assert rollout.input_ids.shape[0] == 4
    assert [p.question for p in problems] == ["ok-0", {0: "dead-0", 1: "dead-1b", 2: "ok-2"}[expected_resampled]]


def test_a_users_reward_function_is_used_for_training_and_eval(tmp_path, monkeypatch):
    """--reward module:function: every completion is scored by the user's function (here: always 1)."""
    (tmp_path / "train_test_rewards.py").write_text("def always_right(completion, gold):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    train.main(TINY + ["--steps", "1", "--eval-every", "0", "--dataset", "arith-mix",
                       "--prompts-per-step", "5", "--reward", "train_test_rewards:always_right",
                       "--out", str(tmp_path / "run")])
    row = json.loads((tmp_path / "run" / "grpo" / "metrics.jsonl").read_text())
    assert row["reward_mean"] == 1.0 and row["acr"] == 1.0 and row["all_correct_frac"] == 1.0
    evals = [json.loads(line)
             for line in (tmp_path / "run" / "grpo" / "evals.jsonl").read_text().splitlines()]
    assert [e["eval_accuracy"] for e in evals] == [1.0, 1.0]
    assert set(evals[0]["eval_accuracy_by_level"]) <= {"add1", "mul1", "add2", "mul2", "mul3"}


def test_a_bad_reward_spec_is_rejected_before_anything_runs(tmp_path, capsys):
    with pytest.raises(SystemExit):
        train.main(TINY + ["--reward", "no_such_module:f", "--out", str(tmp_path / "run")])
    assert "no_such_module" in capsys.readouterr().err and not (tmp_path / "run").exists()


def test_help_lists_every_flag(capsys):
    with pytest.raises(SystemExit) as exit_info:
        train.parse_args(["--help"])
    out = capsys.readouterr().out
    # a field defaulting to True: a switch pair
    assert exit_info.value.code == 0 and "--fast, --no-fast" in out
    for f in train.dataclasses.fields(train.Args):
        assert "--" + f.name.replace("_", "-") in out


def test_a_percent_sign_in_help_text_is_kept():
    @train.dataclasses.dataclass
    class Config:
        rate: float = arg(0.5, "50% of it")

    assert "50% of it" in dataclass_parser(Config, "").format_help()  # argparse would read % as a format


def test_fused_adamw_updates_the_weights_as_the_default_adamw(tiny, rollout):
    """train.py's fused AdamW (the speed-up) moves every weight as torch's default implementation does."""
    advantages = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 2.0, -2.0, 0.0])
    _, before, fused = run_update(tiny, rollout, advantages)
    _, _, default = run_update(tiny, rollout, advantages, fused=None)
    assert any(not torch.equal(a, b) for a, b in zip(before, fused))
    for a, b in zip(fused, default):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("reward, end",
                         [("", "too hard for this model, or G = 4"), ("always_right", "too easy")])
def test_a_collapsed_start_prints_one_line_naming_its_end(tmp_path, monkeypatch, capsys, reward, end):
    """The tiny random model gets every arithmetic answer wrong: early ACR 1.0 at the all-wrong end; a reward
    of 1 for everything collapses every group at the all-correct end. Either way, one line, once, after
    step 1 of 5 (the first 20% of the steps), and the early ACR goes into summary.json."""
    (tmp_path / "early_acr_rewards.py").write_text("def always_right(completion, gold):\n    return 1.0\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    flags = ["--reward", f"early_acr_rewards:{reward}"] if reward else []
    train.main(TINY + flags + ["--steps", "5", "--eval-every", "0", "--save-every", "0",
                               "--out", str(tmp_path / "out")])
    warnings = [line for line in capsys.readouterr().out.split("\n") if "early ACR" in line]
    assert len(warnings) == 1 and end in warnings[0] and "--algo avspo or dapo" in warnings[0]
    assert "over the first 1 steps" in warnings[0]
    summary = json.loads((tmp_path / "out" / "grpo" / "summary.json").read_text())
    assert (summary["early_steps"], summary["early_acr"]) == (1, 1.0)
    assert summary["early_all_wrong_frac" if not reward else "early_all_correct_frac"] == 1.0
    assert summary["steps_without_signal"] == 5  # every group collapsed in every step


def test_summary_counts_the_steps_that_trained_no_row(tmp_path):
    step = {"time_generate": 1.0, "time_score": 0.0, "time_train": 1.0, "acr": 0.5, "acr_effective": 0.5,
            "reward_mean": 0.5, "all_wrong_frac": 0.5, "all_correct_frac": 0.0}
    with owned(tmp_path, "run") as folder:
        write_jsonl(folder, "metrics.jsonl", [{**step, "rows_trained": n} for n in (8, 0, 3, 0, 0)])
        write_jsonl(folder, "evals.jsonl", [{"eval_accuracy": 0.25}, {"eval_accuracy": 0.5}])
        assert summarise_run(folder, "grpo", 1.0)["steps_without_signal"] == 3


def test_a_step_that_trains_no_row_still_moves_the_weights_by_adams_momentum(tiny, rollout):
    """What the README says of a collapsed batch: every advantage 0 (beta 0), no row is trained, yet
    optimizer.step() runs on zero gradients and AdamW's first moment from earlier steps moves the weights (as
    in TRL's and verl's trainers)."""
    model, _ = load_model("tiny-qwen2", torch.device("cpu"))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.0, fused=True)
    args = train.Args(micro_batch=3, group_size=4)
    signal = torch.tensor([1.0, -1.0, 0.5, -0.5, 0.0, 0.0, 1.0, -1.0])
    train.update_policy(model, model, optimizer, rollout, signal, None, args)
    before = [p.detach().clone() for p in model.parameters()]
    stats = train.update_policy(model, model, optimizer, rollout, torch.zeros(8), None, args)
    assert stats["rows_trained"] == 0 and stats["grad_norm"] == 0.0
    assert any(not torch.equal(a, p) for a, p in zip(before, model.parameters()))


def test_collapse_warning_stays_quiet_below_three_groups_in_four(tmp_path):
    records = [{"acr": acr, "all_wrong_frac": acr, "all_correct_frac": 0.0} for acr in (1.0, 0.5, 0.5, 1.0)]
    with owned(tmp_path, "run") as folder:
        write_jsonl(folder, "metrics.jsonl", records)  # mean ACR 0.75: warned
        assert "early ACR 0.75" in collapse_warning(tmp_path, 8)
        write_jsonl(folder, "metrics.jsonl", records[1:])  # mean 0.67
        assert collapse_warning(tmp_path, 8) is None
    assert [early_steps(n) for n in (1, 5, 40, 100, 1000)] == [1, 1, 8, 20, 100]


def test_group_map_marks_what_each_group_was_and_what_the_method_gave_it():
    first = torch.tensor([[1.0, 1.0], [0.0, 0.0], [1.0, 0.0], [0.5, 0.5]])  # [B, G]
    # the all-correct one got signal
    advantages = torch.tensor([[0.3, 0.3], [0.0, 0.0], [0.7, -0.7], [0.0, 0.0]])
    groups = group_map(first, advantages, torch.tensor([False, True, False, False]))
    assert groups == {"groups_sampled": "CWM=", "groups_signal": "1010", "groups_replaced": "0100"}


TRL_STYLE = """
import os

def half_right(prompts, completions, solution, **kwargs):  # TRL's reward-function shape
    with open(os.environ["CALLS"], "a") as calls:  # it runs in a process of its own (verifier.RewardWorker)
        calls.write(f"{len(completions)}\\n")
    assert all(p[0]["role"] == "user" and c[0]["role"] == "assistant" for p, c in zip(prompts, completions))
    return [float(i % 2) for i in range(len(completions))]

def wrong_shape(text):
    return 1.0
"""


def test_a_trl_style_reward_trains_and_a_wrong_shape_is_one_line(tmp_path, monkeypatch, capsys):
    """--reward module:function with TRL's f(prompts, completions, **kwargs): called once per batch of B*G
    completions (2 steps, each its own call, then the evaluations), and every group comes out mixed."""
    (tmp_path / "trl_style_rewards.py").write_text(TRL_STYLE)
    monkeypatch.syspath_prepend(str(tmp_path))
    monkeypatch.setenv("CALLS", str(tmp_path / "calls"))
    train.main(TINY + ["--steps", "2", "--eval-every", "0", "--prompts-per-step", "2", "--save-every", "0",
                       "--reward", "trl_style_rewards:half_right", "--out", str(tmp_path / "run")])
    rows = read_jsonl(tmp_path / "run" / "grpo" / "metrics.jsonl")
    assert [r["reward_mean"] for r in rows] == [0.5, 0.5] and all(r["acr"] == 0.0 for r in rows)
    calls = [int(n) for n in (tmp_path / "calls").read_text().split()]
    assert calls[:1] == [4] and calls[1:3] == [8, 8]  # eval (4), steps
    with pytest.raises(SystemExit):
        train.main(TINY + ["--reward", "trl_style_rewards:wrong_shape", "--out", str(tmp_path / "bad")])
    error = capsys.readouterr().err.strip().splitlines()[-1]
    assert "neither f(completion, gold)" in error and "TRL's f(prompts, completions" in error
    assert not (tmp_path / "bad").exists()


def test_a_run_works_out_its_stop_set_once(tmp_path, monkeypatch):
    """Once per run, not at every sample call of training, resampling or evaluation."""
    calls, real = [], model_module.stop_token_ids
    monkeypatch.setattr(run_module, "stop_token_ids", lambda *a: calls.append(1) or real(*a))
    monkeypatch.setattr(model_module, "stop_token_ids", lambda *a: pytest.fail("worked out per sample call"))
    train.main(TINY + ["--algo", "dapo,aapo", "--steps", "2", "--eval-every", "1", "--out", str(tmp_path)])
    assert len(calls) == 2  # one run of each algorithm

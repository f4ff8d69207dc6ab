"""LoRA through peft (lora.py, issue 56): a run starts at the base policy, its reference is the base with the
adapters off at every step, only the adapters train, checkpoints hold the adapters and resume exactly,
eval.py and merge.py read them, and every path (fast, bf16, checkpointing, each method) runs under it."""

import json
import sys
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer

import eval as evaluation
import merge
import packing
import run as run_module
import train
from hardware import working_copy
from lora import ADAPTER_CONFIG, ADAPTERS, has_adapters
from model import completion_logprobs, load_model, sample
from run import Paths
from run_folder import read_jsonl
from written import RECORD

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]
PARITY = "def parity(completion, gold): return float(len(completion) % 2)\n"  # rewards that vary: a gradient
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOLATILE = ("time", "_per_s")  # keys of metrics.jsonl that are timings


@pytest.fixture()
def parity(tmp_path, monkeypatch):
    """A reward that varies on a random model's completions, importable as user_parity:parity."""
    (tmp_path / "user_parity.py").write_text(PARITY)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("user_parity", None)
    return ["--reward", "user_parity:parity"]


def args_of(argv: list[str]) -> train.Args:
    return train.parse_args(argv)


def start(argv: list[str], tmp_path: Path, with_reference: bool = False) -> run_module.Run:
    args = args_of(argv)
    return run_module.start_run(args, tmp_path / "none", torch.device("cpu"), False, train.algo_state(args),
                                with_reference)


def rows(network, tokenizer):
    """A rollout of `network` on two prompts (4 rows each): its ids, attention mask and length C."""
    torch.manual_seed(0)
    rollout = sample(network, tokenizer, ["What is 2 + 3?", "What is 12 * 7?"], 4, 8)
    return rollout.input_ids, rollout.attention_mask, rollout.completion_mask.shape[1]


def timeless(records: list[dict]) -> list[dict]:
    return [{k: v for k, v in r.items() if not any(t in k for t in VOLATILE)} for r in records]


# ------------------------------------------------------------------------------ the start and the reference


@pytest.mark.parametrize("model", ["tiny-qwen2", "smollm2-135m"])
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_a_lora_run_starts_at_exactly_the_base_policy(tmp_path, model, precision):
    """B = 0 at the start: the LoRA policy's log-probs are full fine-tuning's, bit for bit, in fp32 and in
    bf16 (the frozen weights cast as the full working copy casts them), by the plain and the packed pass."""
    common = TINY[2:] + ["--model", model, "--precision", precision]
    full, lora = start(common, tmp_path), start(common + ["--lora-rank", "4"], tmp_path)
    assert has_adapters(lora.policy) and not has_adapters(full.policy)
    assert lora.policy.model.embed_tokens.weight.dtype == full.policy.model.embed_tokens.weight.dtype
    ids, attn, c = rows(full.policy, full.tokenizer)
    for logprobs in (completion_logprobs, packing.completion_logprobs):
        with torch.no_grad():
            got, want = logprobs(lora.policy, ids, attn, c), logprobs(full.policy, ids, attn, c)
        if model == "tiny-qwen2" or logprobs is packing.completion_logprobs:
            assert torch.equal(got, want), logprobs
        else:  # the plain pass's [49152, 576] output layer: torch's CPU kernel sums in another order once its
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)  # weight is frozen (1.5e-5, 3e-5 here)


def test_lora_sits_on_every_linear_layer_but_the_output_layer_in_float32(tmp_path):
    run = start(TINY + ["--lora-rank", "4", "--precision", "bf16"], tmp_path)
    trained = {name: p for name, p in run.master.named_parameters() if p.requires_grad}
    layers = run.master.config.num_hidden_layers
    assert len(trained) == 2 * len(LINEAR) * layers  # A and B of each of the 7 linear layers of every block
    assert all(".lora_A." in n or ".lora_B." in n for n in trained)
    assert not any("lm_head" in n for n in trained)
    assert {p.dtype for p in trained.values()} == {torch.float32}
    frozen = {p.dtype for p in run.master.parameters() if not p.requires_grad}
    assert frozen == {torch.bfloat16}  # no float32 copy of a frozen weight
    assert run.policy is run.master and run.optimizer.param_groups[0]["params"] == list(trained.values())


def record_logprobs(monkeypatch) -> list[tuple]:
    """Every log-prob pass of update_policy, as (grad enabled, adapters on, ids, attention, C, result)."""
    calls = []

    def recorded(model, input_ids, attention_mask, completion_len, temperature=1.0):
        out = completion_logprobs(model, input_ids, attention_mask, completion_len, temperature)
        adapters_on = all(not m.disable_adapters for m in model.modules() if isinstance(m, BaseTunerLayer))
        calls.append((torch.is_grad_enabled(), adapters_on, input_ids, attention_mask, completion_len,
                      out.detach()))
        return out

    plain = run_module.fast_or_plain(False, torch.device("cpu"))
    monkeypatch.setattr(train, "fast_or_plain",
                        lambda fast, device: Paths(plain.sample_completions, recorded))
    return calls


def train_steps(run: run_module.Run, args: train.Args, steps: int, calls: list) -> list[list[tuple]]:
    """`steps` steps of train_step on one process; the log-prob passes of each."""
    per_step = []
    for step in range(1, steps + 1):
        calls.clear()
        train.train_step(args, run, step, 0, slice(0, args.prompts_per_step), torch.device("cpu"))
        per_step.append(list(calls))
    return per_step


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_the_reference_is_the_untrained_model_at_every_step(tmp_path, monkeypatch, parity, precision):
    """--beta > 0 under LoRA: each step's reference log-probs are those of the model as loaded (a fresh copy,
    in the run's precision), while the policy's move away from them."""
    argv = TINY + parity + ["--lora-rank", "4", "--beta", "0.1", "--lr", "1e-2", "--precision", precision]
    args, run = args_of(argv), start(argv, tmp_path, with_reference=True)
    untrained = working_copy(load_model("tiny-qwen2", torch.device("cpu"))[0], precision)
    per_step = train_steps(run, args, 3, record_logprobs(monkeypatch))
    for step, calls in enumerate(per_step, 1):
        reference = [c for c in calls if not c[0]]  # one update per batch: no-grad passes are the reference's
        assert reference, step
        for _, _, ids, attn, c, out in reference:
            with torch.no_grad():
                assert torch.equal(out, completion_logprobs(untrained, ids, attn, c)), step
    _, _, ids, attn, c, _ = per_step[-1][0]
    with torch.no_grad():  # the test bites: by now the policy is not the reference
        assert not torch.allclose(completion_logprobs(run.policy, ids, attn, c),
                                  completion_logprobs(untrained, ids, attn, c))
        with run.reference() as reference:
            assert torch.equal(completion_logprobs(reference, ids, attn, c),
                               completion_logprobs(untrained, ids, attn, c))
    assert all(p.requires_grad for n, p in run.policy.named_parameters() if "lora_" in n)  # adapters back on


def test_the_aapo_reference_samples_with_the_adapters_off(tmp_path, monkeypatch, parity):
    """AAPO's r_ref: completions of the reference (the policy with its adapters off), not of the policy."""
    argv = TINY + parity + ["--lora-rank", "4", "--algo", "aapo"]
    args, run = args_of(argv), start(argv, tmp_path, with_reference=True)
    layers = [m for m in run.policy.modules() if isinstance(m, BaseTunerLayer)]
    seen = []

    def score(network, problems):
        seen.append([layer.disable_adapters for layer in layers])
        return None, torch.zeros(1, 4)

    monkeypatch.setattr(train, "gather_groups", lambda rewards: rewards)
    train.reference_rewards(args, score, run.reference, run.train_problems[:1])
    assert seen == [[True] * len(layers)]  # off while it samples
    assert not any(m.disable_adapters for m in layers)  # and on again after


def test_every_method_runs_under_lora_with_checkpointing_and_a_kl(tmp_path, parity):
    """GRPO, AVSPO, AAPO (its r_ref sampled with the adapters off) and DAPO, with --beta and
    --grad-checkpointing: each trains its adapters, and its checkpoint holds them alone."""
    algos, out = ["grpo", "avspo", "aapo", "dapo"], tmp_path / "run"
    train.main(TINY + parity + ["--algo", ",".join(algos), "--lora-rank", "2", "--steps", "2", "--beta",
                                "0.05", "--grad-checkpointing", "--eval-every", "0", "--lr", "1e-2",
                                "--out", str(out)])
    for algo in algos:
        records = read_jsonl(out / algo / "metrics.jsonl")
        assert [r["step"] for r in records] == [1, 2] and records[-1]["kl"] > 0, algo  # off the reference
        assert ADAPTERS in run_files(out / algo) and "model.safetensors" not in run_files(out / algo)
    assert "ref_reward_mean" in read_jsonl(out / "aapo" / "metrics.jsonl")[0]


# ------------------------------------------------------------------------------ what trains


def test_only_the_adapters_receive_gradients_and_optimizer_state(tmp_path, monkeypatch, parity):
    argv = TINY + parity + ["--lora-rank", "4", "--lr", "1e-2", "--beta", "0.1"]
    args, run = args_of(argv), start(argv, tmp_path, with_reference=True)
    frozen = {n: p.detach().clone() for n, p in run.master.named_parameters() if not p.requires_grad}
    adapters = {n: p.detach().clone() for n, p in run.master.named_parameters() if p.requires_grad}
    train_steps(run, args, 2, record_logprobs(monkeypatch))
    now = dict(run.master.named_parameters())
    assert all(torch.equal(now[n], before) and now[n].grad is None for n, before in frozen.items())
    assert {id(p) for p in run.optimizer.state} == {id(now[n]) for n in adapters}
    assert all(not torch.equal(now[n], before) for n, before in adapters.items() if ".lora_B." in n)


# ------------------------------------------------------------------------------ checkpoints


def run_files(path: Path) -> dict:
    return {p.name: p.stat().st_size for p in (path / "checkpoint" / "model").iterdir()}


def test_resume_under_lora_is_exact_and_a_checkpoint_holds_the_adapters_alone(tmp_path, parity):
    common = TINY + parity + ["--lora-rank", "4", "--eval-every", "0", "--lr", "1e-2", "--lr-decay", "0",
                              "--beta", "0.05"]
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "straight")])
    train.main(common + ["--steps", "2", "--out", str(tmp_path / "resumed")])
    train.main(common + ["--steps", "3", "--out", str(tmp_path / "resumed"), "--resume"])
    straight, resumed = (read_jsonl(tmp_path / r / "grpo" / "metrics.jsonl") for r in ("straight", "resumed"))
    assert [r["step"] for r in resumed] == [1, 2, 3] and timeless(resumed) == timeless(straight)
    assert any(r["grad_norm"] > 0 for r in straight)  # the adapters trained
    saved = [load_model(str(tmp_path / r / "grpo" / "checkpoint"), torch.device("cpu"))[0]
             for r in ("straight", "resumed")]
    for (name, a), (_, b) in zip(*(s.named_parameters() for s in saved)):
        assert torch.equal(a, b), name
    files = run_files(tmp_path / "straight" / "grpo")
    assert {ADAPTERS, ADAPTER_CONFIG} <= set(files) and "model.safetensors" not in files
    base = json.loads((tmp_path / "straight" / "grpo" / "checkpoint" / "model" / ADAPTER_CONFIG).read_text())
    assert base["base_model_name_or_path"] == "tiny-qwen2" and base["r"] == 4 and base["lora_alpha"] == 32


def test_resume_with_another_rank_is_refused_in_one_line(tmp_path):
    common = TINY + ["--steps", "1", "--eval-every", "0", "--out", str(tmp_path)]
    train.main(common + ["--lora-rank", "4"])
    with pytest.raises(SystemExit) as exit_info:
        train.main(common + ["--lora-rank", "8", "--resume"])
    assert "--lora-rank 4 -> 8" in str(exit_info.value.code) and "\n" not in str(exit_info.value.code)


def test_eval_on_the_lora_checkpoint_equals_the_in_run_evaluation(tmp_path, parity):
    """The last evaluation of a LoRA run, and eval.py on its checkpoint (base plus adapters, in the same
    precision): the same greedy completions, problem by problem; the base's differ."""
    out = tmp_path / "run"
    train.main(TINY + parity + ["--lora-rank", "4", "--lr", "5e-2", "--steps", "3", "--eval-every", "0",
                                "--out", str(out), "--eval-size", "8"])
    in_run = read_jsonl(out / "grpo" / "eval_records.jsonl")
    completions = {}
    for name in (str(out / "grpo" / "checkpoint"), "tiny-qwen2"):
        folder = tmp_path / f"eval-{len(completions)}"
        evaluation.main(["--model", name, "--max-new-tokens", "8", "--limit", "8", "--out", str(folder),
                         "--reward", "user_parity:parity"])
        completions[name] = [r["completion"] for r in read_jsonl(next(folder.glob("samples-*.jsonl")))]
    assert completions[str(out / "grpo" / "checkpoint")] == [r["completion"] for r in in_run]
    assert completions["tiny-qwen2"] != [r["completion"] for r in in_run]  # the adapters changed them


# ------------------------------------------------------------------------------ merge.py


def test_merge_writes_one_model_with_the_adapted_log_probs(tmp_path, parity):
    """merge.py: one transformers model, no adapter left, with the log-probs of base plus adapters (up to the
    order of additions); a second merge replaces the first and nothing else; a checkpoint without adapters
    is one line."""
    out = tmp_path / "run"
    train.main(TINY + parity + ["--lora-rank", "4", "--lr", "5e-2", "--steps", "2", "--eval-every", "0",
                                "--out", str(out)])
    checkpoint = out / "grpo" / "checkpoint"
    merge.main([str(checkpoint), str(tmp_path / "merged")])
    merged_model = load_model(str(tmp_path / "merged"), torch.device("cpu"))[0]
    adapted, base = (load_model(name, torch.device("cpu")) for name in (str(checkpoint), "tiny-qwen2"))
    adapted, (base, tokenizer) = adapted[0], base
    assert not has_adapters(merged_model) and has_adapters(adapted)
    assert not any("lora" in k for k in merged_model.state_dict())
    ids, attn, c = rows(base, tokenizer)
    with torch.no_grad():
        want = completion_logprobs(adapted, ids, attn, c)
        got = completion_logprobs(merged_model, ids, attn, c)
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
        assert not torch.allclose(completion_logprobs(base, ids, attn, c), want, atol=1e-4)
    (tmp_path / "merged" / "notes.txt").write_text("the user's")
    merge.main([str(checkpoint), str(tmp_path / "merged")])  # again: the old merge replaced, nothing else
    assert sorted(p.name for p in (tmp_path / "merged").iterdir()) == [RECORD, "model", "notes.txt"]
    with pytest.raises(SystemExit) as exit_info:
        merge.main([str(tmp_path / "run" / "grpo"), str(tmp_path / "other")])
    assert "holds no LoRA adapters" in str(exit_info.value.code)


def test_ppo_epochs_take_the_old_log_probs_with_the_adapters_on_and_the_reference_with_them_off(
        tmp_path, monkeypatch, parity):
    """--updates-per-batch 2 and --beta under LoRA: of the passes without gradient, the old policy's come with
    every adapter on and the reference's with every adapter off; the passes with gradient, adapters on."""
    argv = TINY + parity + ["--lora-rank", "4", "--beta", "0.1", "--updates-per-batch", "2"]
    args, run = args_of(argv), start(argv, tmp_path, with_reference=True)
    passes = [call[:2] for call in train_steps(run, args, 1, record_logprobs(monkeypatch))[0]]
    micro = sum(grad for grad, _ in passes) // 2  # micro-batches: each trains once per update
    assert micro and passes == [(False, True)] * micro + [(False, False)] * micro + [(True, True)] * 2 * micro


def test_a_run_starts_from_a_lora_checkpoint_as_one_model_and_loads_back_from_its_own(tmp_path, parity):
    """--model <a LoRA run's checkpoint>: a new run starts from the policy it holds (its adapters merged in),
    trained in full or with fresh adapters; eval.py reads such a run's checkpoint back as the run saw it."""
    first = tmp_path / "first"
    train.main(TINY + parity + ["--lora-rank", "4", "--lr", "5e-2", "--steps", "2", "--eval-every", "0",
                                "--out", str(first)])
    checkpoint = str(first / "grpo" / "checkpoint")
    adapted = load_model(checkpoint, torch.device("cpu"))[0]
    common = TINY[2:] + parity + ["--model", checkpoint, "--precision", "fp32"]
    for rank in ("0", "4"):
        run = start(common + ["--lora-rank", rank], tmp_path, with_reference=True)
        ids, attn, c = rows(run.policy, run.tokenizer)
        with torch.no_grad(), run.reference() as reference:
            want = completion_logprobs(adapted, ids, attn, c)
            torch.testing.assert_close(completion_logprobs(run.policy, ids, attn, c), want, atol=1e-5, rtol=0)
            torch.testing.assert_close(completion_logprobs(reference, ids, attn, c), want, atol=1e-5, rtol=0)
        trained = [n for n, p in run.master.named_parameters() if p.requires_grad]
        assert all("lora_" in n for n in trained) == (rank == "4") and trained, rank
    second = tmp_path / "second"  # trained on top of the first, then read back by eval.py: its first eval
    train.main(TINY + parity + ["--model", checkpoint, "--lora-rank", "4", "--eval-every", "0", "--lr",
                                "5e-2", "--steps", "2", "--eval-size", "8", "--out", str(second)])
    in_run = [r["completion"] for r in read_jsonl(second / "grpo" / "eval_records.jsonl")]
    evaluation.main(["--model", str(second / "grpo" / "checkpoint"), "--max-new-tokens", "8", "--limit", "8",
                     "--out", str(tmp_path / "eval"), "--reward", "user_parity:parity"])
    assert [r["completion"] for r in read_jsonl(next((tmp_path / "eval").glob("samples-*.jsonl")))] == in_run

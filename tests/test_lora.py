"""LoRA through peft (infra/lora.py, issue 56): a run starts at the base policy, its reference is the base
with the adapters off at every step, only the adapters train, checkpoints hold the adapters and resume
exactly, eval.py and merge.py read them, and every path (fast, bf16, checkpointing, each method) runs under
it. A checkpoint knows its base by content, and every loader refuses another base or damaged adapters in one
line; merge.py survives a kill at any moment and a full disk (issue 61)."""

import json
import os
import resource
import shutil
import signal
import sys
from pathlib import Path

import pytest
import torch
from peft.tuners.tuners_utils import BaseTunerLayer
from safetensors import safe_open
from safetensors.torch import load_file, save_file

import eval as evaluation
import merge
import train
from fast import packing
from infra import lora, model_files
from infra.hardware import working_copy
from infra.lora import (ADAPTER_CONFIG, ADAPTERS, BASE_SHA256, base_identity, digest, has_adapters,
                        save_adapters)
from infra.model_files import SMOLLM2_SHA256, save_folder, tiny_qwen2
from loop import run as run_module
from loop.run import Paths
from loop.run_folder import read_jsonl
from model import completion_logprobs, load_model, sample
from cuda_stand_in import HOST, CudaDeviceRules
from test_faults import in_a_small_process, killed_at
from test_model_files import write_tiny_gguf
from infra.written import RECORD, sha256

TINY = ["--model", "tiny-qwen2", "--max-new-tokens", "8", "--group-size", "4", "--eval-size", "4"]
PARITY = "def parity(completion, gold): return float(len(completion) % 2)\n"  # rewards that vary: a gradient
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
VOLATILE = ("time", "_per_s", "peak_memory")  # keys of metrics.jsonl that measure the machine


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


def test_the_adapters_come_back_on_when_the_reference_raises():
    """A reference that raises (an out-of-memory in AAPO's sampling, Ctrl-C) leaves the policy's adapters on:
    `adapters_off` without try/finally would leave the run training the base (L3)."""
    model, _ = tiny_qwen2()
    lora.add_adapters(model, 2, 32, "tiny-qwen2", 0)
    layers = [m for m in model.modules() if isinstance(m, BaseTunerLayer)]
    with pytest.raises(KeyboardInterrupt):
        with lora.adapters_off(model):
            assert all(layer.disable_adapters for layer in layers)
            raise KeyboardInterrupt
    assert layers and not any(layer.disable_adapters for layer in layers)


def test_a_lora_checkpoint_loads_its_base_on_the_device_asked(tmp_path):
    """A LoRA checkpoint asked on the host, with CUDA available (the stand-in): its base goes where the
    adapters go, the run's device, not the device `pick_device` would choose (L2: eval.py --device cpu put
    the base on the GPU)."""
    model, tokenizer = tiny_qwen2()
    lora.add_adapters(model, 2, 32, "tiny-qwen2", 0)
    save_adapters(model, tmp_path / "adapters")
    tokenizer.save_pretrained(tmp_path / "adapters")  # as a checkpoint holds it
    with CudaDeviceRules() as rules:
        loaded, _ = load_model(str(tmp_path / "adapters"), HOST)
        on_device = [name for name, p in loaded.named_parameters() if rules.on_device(p)]
    assert has_adapters(loaded) and not on_device, on_device[:3]


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


# -------------------------------------------------------------------------- the base's identity (issue 61)


def lora_run(base: str, out: Path, *flags: str) -> Path:
    """A one-step --lora-rank 2 run on `base` into `out`; its checkpoint."""
    train.main(TINY[2:] + ["--model", base, "--lora-rank", "2", "--steps", "1", "--eval-every", "0",
                           "--lr-decay", "0", "--out", str(out), *flags])
    return out / "grpo" / "checkpoint"


def loaders(checkpoint: Path, tmp_path: Path, capsys) -> dict:
    """Every script's way to load the adapters of `checkpoint`: what each exits with (its one line; train.py
    --model refuses at parse time, so argparse's line)."""
    ways = {"merge.py": lambda: merge.main([str(checkpoint), str(tmp_path / "merged")]),
            "eval.py": lambda: evaluation.main(["--model", str(checkpoint), "--limit", "1",
                                                "--max-new-tokens", "2"]),
            "train.py --model": lambda: train.main(TINY[2:] + ["--model", str(checkpoint), "--steps", "1",
                                                               "--out", str(tmp_path / "next")]),
            "--resume": lambda: lora_run(base_of_run(checkpoint), checkpoint.parent.parent, "--steps", "2",
                                         "--resume")}
    lines = {}
    for name, way in ways.items():
        capsys.readouterr()
        with pytest.raises(SystemExit) as exit_info:
            way()
        code = exit_info.value.code
        lines[name] = code if isinstance(code, str) else "error: " + capsys.readouterr().err.strip().split(
            ": error: ", 1)[1]  # argparse's "<prog>: error: ..."
    assert not (tmp_path / "merged").exists() and not (tmp_path / "next").exists()  # refusals write nothing
    return lines


def base_of_run(checkpoint: Path) -> str:
    return json.loads((checkpoint.parent / "config.json").read_text())["model"]


def test_adapters_on_another_base_of_the_same_shapes_are_refused_in_one_line_by_every_loader(tmp_path,
                                                                                             capsys):
    """A base folder replaced in place by another model of the same shapes: merge.py, eval.py, train.py
    --model and --resume each refuse in one line naming the base and both identities; the base put back,
    the same checkpoint loads."""
    base = tmp_path / "base"
    save_folder(*tiny_qwen2(0), base)
    checkpoint = lora_run(str(base), tmp_path / "run")
    with safe_open(str(checkpoint / "model" / ADAPTERS), "pt") as f:
        trained_on = f.metadata()[BASE_SHA256]
    assert trained_on == base_identity(str(base))
    original = (base / "model.safetensors").read_bytes()
    tiny_qwen2(1)[0].save_pretrained(base)  # another model, same shapes, same name
    now = base_identity(str(base))
    assert now != trained_on
    for name, line in loaders(checkpoint, tmp_path, capsys).items():
        assert line.startswith("error: ") and "\n" not in line, (name, line)
        assert f"trained on {base} of sha256 {trained_on[:16]}" in line and now[:16] in line, (name, line)
    (base / "model.safetensors").write_bytes(original)
    assert has_adapters(load_model(str(checkpoint), torch.device("cpu"))[0])


@pytest.fixture(scope="module")
def tiny_lora_run(tmp_path_factory) -> Path:
    return lora_run("tiny-qwen2", tmp_path_factory.mktemp("lora") / "run").parent.parent


@pytest.mark.parametrize("damage", ["adapters cut to 100 bytes", "config of rank 4 over rank-2 weights"])
def test_damaged_adapters_are_one_line_in_every_loader(tiny_lora_run, tmp_path, capsys, damage):
    run = tmp_path / "run"
    shutil.copytree(tiny_lora_run, run)
    checkpoint = run / "grpo" / "checkpoint"
    if damage.startswith("adapters"):
        adapters = checkpoint / "model" / ADAPTERS
        adapters.write_bytes(adapters.read_bytes()[:100])
        says = f"{adapters} is damaged (Error while deserializing header"
    else:  # said before any adapter is allocated: the config's rank may be any number
        config = json.loads((checkpoint / "model" / ADAPTER_CONFIG).read_text())
        (checkpoint / "model" / ADAPTER_CONFIG).write_text(json.dumps(config | {"r": 4}))
        says = f"{checkpoint / 'model'} is damaged: its {ADAPTER_CONFIG} says rank 4, its {ADAPTERS} holds "
    for name, line in loaders(checkpoint, tmp_path, capsys).items():
        assert line.startswith("error: ") and "\n" not in line, (name, line)
        if name != "--resume":  # --resume: the checkpoint changed since its run wrote it (infra/written.py)
            assert says in line, (name, line)


def test_adapters_saved_before_they_recorded_their_base_load_unchecked_and_record_it_when_saved(
        tiny_lora_run, tmp_path, capfd):
    """A checkpoint of adapters with no recorded base (before issue 61): loaded onto the base its config
    names, with a warning; saved again (a resumed run's next checkpoint), it records that base."""
    folder = tmp_path / "model"
    shutil.copytree(tiny_lora_run / "grpo" / "checkpoint" / "model", folder)
    save_file(load_file(str(folder / ADAPTERS)), str(folder / ADAPTERS))  # the weights, no metadata
    adapted = load_model(str(folder), torch.device("cpu"))[0]
    assert has_adapters(adapted)
    assert f"warning: {folder / ADAPTERS} records no identity of its base" in capfd.readouterr().err
    save_adapters(adapted, tmp_path / "saved")
    with safe_open(str(tmp_path / "saved" / ADAPTERS), "pt") as f:
        assert f.metadata()[BASE_SHA256] == base_identity("tiny-qwen2")
    wider, tokenizer = tiny_qwen2()  # unchecked, onto a base of other widths: one line, not torch's traceback
    wider.config.intermediate_size = 48
    save_folder(type(wider)(wider.config), tokenizer, tmp_path / "wider")
    config = json.loads((folder / ADAPTER_CONFIG).read_text())
    config["base_model_name_or_path"] = str(tmp_path / "wider")
    (folder / ADAPTER_CONFIG).write_text(json.dumps(config))
    with pytest.raises(ValueError, match=f"{folder / ADAPTERS} does not fit {tmp_path / 'wider'}: size mism"):
        load_model(str(folder), torch.device("cpu"))


def test_a_base_s_identity_is_its_content_as_the_model_cache_keys_it(tmp_path, tiny_lora_run, monkeypatch):
    """A GGUF file: the sha256 the cache keys it by (two files of one name, two identities); smollm2-135m:
    its pinned sha256, no download; tiny-qwen2: its weights, with the random generator left as it was; a
    folder, a train.py checkpoint and a hub id: their safetensors' (a hub id's where the hub's cache holds
    them); a LoRA checkpoint: its adapters with its base."""
    folder = save_folder(*tiny_qwen2(), tmp_path / "full" / "model")  # as a train.py checkpoint holds it
    assert base_identity(str(folder)) == base_identity(str(folder.parent)) != digest([])
    monkeypatch.setattr(lora, "snapshot_download", lambda name, **kwargs: str(folder))
    assert base_identity("someone/tiny") == base_identity(str(folder))
    gguf = write_tiny_gguf(tmp_path / "base.gguf")
    first = base_identity(str(gguf))
    assert first == sha256(gguf)
    write_tiny_gguf(gguf, seed=1)
    assert base_identity(str(gguf)) == sha256(gguf) != first
    assert base_identity("smollm2-135m") == SMOLLM2_SHA256
    torch.rand(1)  # a state that no seeding gives back
    state = torch.get_rng_state()
    assert base_identity("tiny-qwen2") == base_identity("tiny-qwen2")
    assert torch.equal(torch.get_rng_state(), state)
    checkpoint = tmp_path / "checkpoint"
    shutil.copytree(tiny_lora_run / "grpo" / "checkpoint", checkpoint)
    before = base_identity(str(checkpoint))
    weights = load_file(str(checkpoint / "model" / ADAPTERS))
    save_file({k: w + 1 for k, w in weights.items()}, str(checkpoint / "model" / ADAPTERS))
    assert base_identity(str(checkpoint)) != before


@pytest.mark.parametrize("rank", ["33", "100000", str(2**66)])
def test_a_rank_no_adapted_layer_can_use_is_refused_at_parse_time(rank, monkeypatch, capsys):
    """tiny-qwen2's widest adapted layers are 32 by 32 or more (its k_proj and v_proj, [16, 32], use 16 of
    any rank): rank 32 is its most; above it, one line before any model loads. The check builds the model's
    shapes alone, and leaves the random generator as it was."""
    monkeypatch.setattr(run_module, "load_model", lambda *a, **k: pytest.fail("a model loaded"))
    torch.rand(1)
    state = torch.get_rng_state()
    assert train.parse_args(TINY + ["--lora-rank", "32"]).lora_rank == 32
    assert torch.equal(torch.get_rng_state(), state)
    with pytest.raises(SystemExit):
        train.parse_args(TINY + ["--lora-rank", rank])
    line = capsys.readouterr().err.strip().splitlines()[-1]
    assert f"--lora-rank {rank} is above 32, the most rank any adapted layer can use" in line
    assert "choose at most 32" in line


# ---------------------------------------------------------------------------- merge.py: kills, a full disk


def merged_of(run: Path) -> tuple:
    """A LoRA run's model, its adapters merged in, and its tokenizer."""
    model, tokenizer = load_model(str(run / "grpo" / "checkpoint"), torch.device("cpu"))
    return merge.merged(model), tokenizer


@pytest.fixture(scope="module")
def merged_model(tiny_lora_run):
    return merged_of(tiny_lora_run)


def test_a_merge_killed_at_every_moment_leaves_a_folder_the_next_merge_finishes(tmp_path, tiny_lora_run):
    """merge.py killed (os._exit, forked from a small process) before or after each os call that changes
    <out>, over an earlier merge: the next merge ends with <out> holding its record and model alone, no
    temporary, no model.new (which once stopped every later merge: "model.new is a folder: remove it ...")."""
    in_a_small_process(merge_killed_at_every_moment, tmp_path, tiny_lora_run)


def merge_killed_at_every_moment(tmp_path: Path, run: Path) -> None:
    model, tokenizer = merged_of(run)
    want = {k: v.clone() for k, v in model.state_dict().items()}
    for n in range(10**4):
        out = tmp_path / str(n)
        merge.write_merged(out, model, tokenizer)
        if (pid := os.fork()) == 0:
            killed_at(n)
            merge.write_merged(out, model, tokenizer)
            os._exit(3)  # the merge ended: n is past its last moment
        ended = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        merge.write_merged(out, model, tokenizer)
        assert sorted(p.name for p in out.iterdir()) == [RECORD, "model"], f"killed at {n}"
        got = load_file(str(out / "model" / "model.safetensors"))
        assert all(torch.equal(got[k], want[k]) for k in got), f"killed at {n}"
        if ended == 3:
            break
    assert n > 20  # every moment of a merge was reached


def under_a_full_disk(write, limit: int = 50_000) -> str:
    """`write()` in a forked process whose files cannot grow past `limit` bytes (RLIMIT_FSIZE; EFBIG, as a
    full disk's ENOSPC, once past it): the line it exits with, or how it failed otherwise."""
    read, send = os.pipe()
    if (pid := os.fork()) == 0:
        os.close(read)
        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # the write fails, the process goes on
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, resource.RLIM_INFINITY))
        try:
            write()
            said = "wrote it all"
        except SystemExit as e:
            said = str(e.code)
        except BaseException as e:
            said = f"{type(e).__name__} raised: {e}"
        os.write(send, said.encode())
        os._exit(0)
    os.close(send)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    return said


def test_a_full_disk_in_merge_and_in_the_first_use_conversion_is_one_line(tmp_path, merged_model,
                                                                          monkeypatch):
    """The merged weights past the disk's room: safetensors' SafetensorError (no OSError) was a traceback in
    merge.py and in the model cache's conversion. Now one line each; the earlier merge stays, no temporary."""
    model, tokenizer = merged_model
    out = tmp_path / "merged"
    merge.write_merged(out, model, tokenizer)
    earlier = sha256(out / "model" / "model.safetensors")
    line = under_a_full_disk(lambda: merge.write_merged(out, model, tokenizer))
    assert line.startswith(f"error: the merge could not be written in {out} (") and "\n" not in line, line
    assert "File too large" in line
    assert sorted(p.name for p in out.iterdir()) == [RECORD, "model"]
    assert sha256(out / "model" / "model.safetensors") == earlier
    monkeypatch.setattr(model_files, "CACHE_DIR", tmp_path / "cache")
    line = under_a_full_disk(lambda: model_files.cached("0" * 64, lambda folder: save_folder(model, tokenizer,
                                                                                              folder)))
    assert line.startswith("FileNotFoundError raised: the model cache (GROUP_RL_CACHE): "), line
    assert "File too large" in line and "\n" not in line
    assert sorted(p.name for p in (tmp_path / "cache" / "models").iterdir()) == [RECORD]

"""Our training step on one CUDA GPU at Qwen2.5-0.5B and 1.5B sizes: first a smoke check, then the table.

  python benchmarks/gpu_bench.py --smoke         # one GPU: checks, then the table, within --budget-s (400 s)
  python benchmarks/gpu_bench.py --smoke --tiny --device cpu  # the same code on tiny shapes, seconds on a CPU
  python benchmarks/gpu_bench.py --memory-table  # docs/performance.md's table (infra/memory.py), no GPU

--smoke first (within --smoke-s seconds) runs on the device what no CPU test can show:
  - the fast paths against the plain ones (tests/test_fast_paths.py's checks, here on the device): greedy
    `decoding.decode` token for token against HF `generate`, and `packing.completion_logprobs` with its
    gradients against `model.completion_logprobs`, in fp32 and bf16; their verdict, with the timing rows
    below, decides whether `decoding.FAST_ON` may name "cuda";
  - the SDPA kernel each attention gets (`kernel_checks`), bf16 at head dims 64 and 128: the update's, plain
    and packed, and generation's, HF generate and decoding.decode (cuDNN's is off: hardware.cuda_settings);
  - one `train.train_step` of each method (grpo, avspo, aapo, dapo, and grpo with --beta), on tiny-qwen2 and
    on a random Qwen2.5-0.5B shape, in fp32 and bf16, with and without gradient checkpointing; the rewards are
    `rewards.parity_reward`'s, which split the groups even on random weights, so every method's backward runs
    (a check with no row trained fails);
  - one `train.train_step` of each method with every flag that makes other tensors meet (`OPENED`: the KL's
    reference, PPO's old log-probs, top-p, checkpointing) and torchrun's collectives through a one-process
    nccl group (`one_process_group`): what tests/cuda_stand_in.py's CPU stand-in for CUDA cannot run;
  - LoRA (train.py --lora-rank, infra/lora.py): the fast paths against the plain ones with adapters (B drawn
    nonzero, `with_adapters`), in bf16, and one `train.train_step` of each method at rank 2, bf16 frozen
    weights and float32 adapters, with checkpointing, the reference the policy with its adapters off; each
    step must move the adapters and leave every frozen weight as it was.
Then the table: each (size, checkpointing) config is a train.py step with B prompts x G completions, after a
first row at the README's 24 GB recipe (`RECIPE`: 1.5B, LoRA rank 32, 1,024-token prompts), whose memory by
phase (max_memory_allocated after sampling and after the steps) confirms or refutes the estimate's larger
phase.
Models are Qwen2ForCausalLM with the real Qwen2.5-0.5B / 1.5B dimensions and random weights (no download),
bf16 working weights with float32 master weights as train.py uses on CUDA. Caveats:
  - The byte tokenizer of model_files.byte_tokenizer() writes the prompts (ids < 259), the vocabulary is
    Qwen's 151,936, so the embedding and LM head cost what they cost in the real models.
  - Random weights never emit EOS, so every completion runs to --max-new-tokens.
  - Random weights never answer correctly, and update_policy skips zero-advantage rows, so the rewards
    fed to the advantage step are a fixed mixed pattern: every row is trained, as in a useful batch.
Rows take the path train.py takes there (`run.fast_or_plain`: plain on CUDA), plus one row of the fast
paths forced on at the first size, to time them. "est GiB" is infra/memory.py's estimate for the config, next
to the measured peak, both with the CUDA context and the allocator's reserve (hardware.peak_memory_bytes);
"SDPA" names the attention kernels the update's forward ran (from the profiler).
MFU = model FLOPs / time / the bf16 matmul rate measured on this card first (not the datasheet peak).
Model FLOPs: 2 per parameter per token forward, x3 with backward (recomputation under gradient
checkpointing is not counted, as usual for MFU), plus the LM head on the positions that get logits;
attention's own FLOPs are left out (a few % at these lengths). Each distinct prompt counts once, as
decoding.decode prefills it and the update streams it (train.py's `train_tokens`), not once per completion.
Results go to stdout (markdown) and to --out (JSON, rewritten after every part, and a .md beside it; default
$OUT/gpu_bench.json where $OUT is set). Checks that would start after --smoke-s and parts after --budget-s
are skipped and listed by name, not failed: a slow machine runs fewer of them (status 1: a check failed;
status 2: none failed, but some were skipped, which the last line says: "0 FAILED" alone is no verdict).
A CUDA error stops the smoke: the checks after it, and the table's configs, are listed as not run.
"""
import argparse
import contextlib
import copy
import dataclasses
import gc
import json
import math
import os
import platform
import re
import sys
import time
from collections import Counter
from functools import partial
from pathlib import Path
from unittest import mock

import torch
import transformers

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from benchmarks.timing import markdown_table, sync  # noqa: E402
from data.tasks import load_problems, step_problems  # noqa: E402
from eval import score_groups  # noqa: E402
from fast import packing  # noqa: E402
from fast.decoding import decode  # noqa: E402
from infra.flags import FlagParser, at_least, in_range  # noqa: E402
from infra.hardware import DEVICES, peak_memory_bytes, pick_device, working_copy  # noqa: E402
from infra.lora import adapters_off, add_adapters  # noqa: E402
from infra.memory import FITS, GIB, STATIC, adapter_count, estimate_memory  # noqa: E402
from infra.model_files import byte_tokenizer  # noqa: E402
from loop import run  # noqa: E402
from loop.run import fast_or_plain  # noqa: E402
from model import (checkpoint_activations, completion_logprobs, load_model, sample,  # noqa: E402
                   sample_with_generate)
from verifier import load_reward  # noqa: E402

VOCAB = 151_936  # Qwen2.5's vocabulary
SIZES = {  # the config.json of Qwen/Qwen2.5-0.5B and -1.5B; both tie the embedding and the LM head
    "0.5B": dict(hidden_size=896, intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                 num_key_value_heads=2),
    "1.5B": dict(hidden_size=1536, intermediate_size=8960, num_hidden_layers=28, num_attention_heads=12,
                 num_key_value_heads=2),
    "tiny": dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
}


def matmul_tflops(device: torch.device, n: int, iters: int) -> float:
    """Measured dense bf16 matmul rate (TFLOP/s) of an n x n x n product: the MFU denominator."""
    a, b = (torch.randn(n, n, device=device, dtype=torch.bfloat16) for _ in range(2))
    for _ in range(3):
        a @ b
    sync(device)
    start = time.perf_counter()
    for _ in range(iters):
        a @ b
    sync(device)
    return 2 * n**3 * iters / (time.perf_counter() - start) / 1e12


def build_model(size: str, device: torch.device, tokenizer):
    """Random-weight Qwen2ForCausalLM with the given dimensions, built directly on the device in fp32."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(vocab_size=VOCAB, tie_word_embeddings=True, max_position_embeddings=32768,
                         rope_theta=1_000_000.0, rms_norm_eps=1e-6, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **SIZES[size])
    torch.manual_seed(0)
    with torch.device(device):
        return Qwen2ForCausalLM(config).eval()


def with_adapters(model, name: str = "tiny-qwen2") -> None:
    """Rank-2 LoRA adapters on `model` (infra/lora.py), each B drawn small: at B = 0, as a run starts, they
    change nothing and A has no gradient, so a check of their log-probs or gradients would hold them to
    nothing."""
    add_adapters(model, 2, 32, name, 0)
    with torch.no_grad():
        for param_name, p in model.named_parameters():
            if "lora_B" in param_name:
                p.normal_(0, 0.01)


PARITY = "benchmarks.rewards:parity_reward"  # a coin flip per completion: groups split, rows train


def mixed_rewards(prompts: int, group_size: int) -> torch.Tensor:
    """[B, G] rewards with both values in every group (so no group collapses and every row trains)."""
    return (torch.arange(group_size) % 2).float().repeat(prompts, 1)


def run_step(model, net, tokenizer, optimizer, args: train.Args, problems, step: int) -> dict:
    """One train.py step (sample, verify, advantages, update) with each phase timed and its tokens counted."""
    device = model.device
    batch = step_problems(problems, args.prompts_per_step, args.seed, step)
    sync(device)
    t0 = time.perf_counter()
    rollout = sample(net, tokenizer, [p.question for p in batch], args.group_size, args.max_new_tokens,
                     args.temperature, args.top_p, fast_or_plain(args.fast, device).sample_completions)
    sync(device)
    t1 = time.perf_counter()
    sampled = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None  # the peak so far
    score_groups([p.question for p in batch], rollout.texts, [p.answer for p in batch],
                 load_reward())  # timed as in train.py; the rewards are replaced below
    t2 = time.perf_counter()
    rewards = mixed_rewards(len(batch), args.group_size)
    advantages, _ = train.compute_advantages(args, rewards, train.algo_state(args), ref_rewards=None)
    stats = train.update_policy(model, net, optimizer, rollout, advantages.flatten().to(device), None, args)
    sync(device)
    t3 = time.perf_counter()
    rows, total_len = rollout.input_ids.shape
    prompt_len = total_len - rollout.completion_len
    return {"generate_s": t1 - t0, "score_s": t2 - t1, "train_s": t3 - t2,
            "rows": rows, "prompt_len": prompt_len,
            # each prompt once
            "prompt_tokens": int(rollout.attention_mask[:: args.group_size, :prompt_len].sum()),
            "completion_len": rollout.completion_len,
            "gen_tokens": int(rollout.completion_mask.sum()), "train_tokens": stats["train_tokens"],
            "rows_trained": stats.get("rows_trained", rows), "sdpa": sdpa_kernels(net, rollout, args),
            "allocated_after_sampling": sampled}


def attention_kernels(fn) -> str:
    """The SDPA kernels fn runs, forward and backward (profiler op names): flash, efficient
    (memory-efficient), cudnn, math (scores materialised), flash_cpu; "none" where no SDPA ran."""
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        fn()
    names = {e.key for e in prof.key_averages() if "scaled_dot_product" in e.key or "_attention_" in e.key}
    kinds = {"flash_attention_for_cpu": "flash_cpu", "flash": "flash", "efficient": "efficient",
             "cudnn": "cudnn", "math": "math"}
    found = {kind for name in names for key, kind in kinds.items() if key in name and not (
        kind == "flash" and "for_cpu" in name)}
    return ",".join(sorted(found)) or "none"


def sdpa_kernels(net, rollout, args: train.Args) -> str:
    """The attention kernels one micro-batch of the update's forward runs (`attention_kernels`)."""
    rows = slice(0, args.micro_batch)
    logprobs = fast_or_plain(args.fast, net.device).completion_logprobs
    with torch.no_grad():
        return attention_kernels(lambda: logprobs(net, rollout.input_ids[rows], rollout.attention_mask[rows],
                                                  rollout.completion_len))


def model_flops(model, s: dict) -> tuple[float, float]:
    """(generation, training) model FLOPs of one step from its token counts (see the module docstring)."""
    config = model.config
    # all but embedding
    body = sum(p.numel() for p in model.parameters()) - config.vocab_size * config.hidden_size
    head = 2 * config.hidden_size * config.vocab_size  # FLOPs per position that gets logits
    rows, completion = s["rows"], s["completion_len"]
    # prefill + decode
    generate = 2 * body * (s["prompt_tokens"] + rows * completion) + head * rows * completion
    forward = 2 * body * s["train_tokens"] + head * s["rows_trained"] * completion  # logits at all C (no EOS)
    return generate, 3 * forward


def fast_paths_on(device: torch.device):
    """The fast paths on `device` too, as `decoding.FAST_ON` would have them once verified there."""
    return mock.patch.object(run, "FAST_ON", (*run.FAST_ON, device.type))


@dataclasses.dataclass(frozen=True)
class Config:
    """One row of the table: a size, with or without checkpointing, on train.py's paths or the fast ones;
    LoRA's rank, a micro-batch other than --micro-batch, prompts lengthened to about `prompt_tokens`."""
    size: str
    checkpointing: bool
    forced_fast: bool = False
    lora_rank: int = 0
    micro_batch: int = 0
    prompt_tokens: int = 0

    @property
    def name(self) -> str:
        lora = f" LoRA r{self.lora_rank}" if self.lora_rank else ""
        prompts = f" {self.prompt_tokens}-token prompts" if self.prompt_tokens else ""
        fast = " fast paths" if self.forced_fast else ""
        return f"{self.size} grad_checkpointing={self.checkpointing}{fast}{lora}{prompts}"


# The README's 24 GB recipe (Qwen2.5-Math-1.5B, LoRA rank 32, B = G = 8, 512 new tokens, train.py's
# micro-batch 8, checkpointing) at 1,024-token prompts, where infra/memory.py says sampling is the larger
# phase (HF generate prefills all 64 rows): its row shows max_memory_allocated after the first sampling and
# after the steps, beside the estimate of each phase (docs/performance.md says what confirms it). --tiny: the
# same shape of row on the tiny model.
RECIPE = {"1.5B": Config("1.5B", True, lora_rank=32, micro_batch=8, prompt_tokens=1024),
          "tiny": Config("tiny", True, lora_rank=2, micro_batch=2, prompt_tokens=64)}
FILLER = "Read the problem carefully, then answer it. "


def lengthened(problems: list, tokens: int) -> list:
    """The problems, each question led by filler to `tokens` bytes (the byte tokenizer's tokens)."""
    return [dataclasses.replace(p, question=(FILLER * (tokens // len(FILLER) + 1))[: tokens - len(p.question)]
                                + p.question) for p in problems]


def bench_config(config: Config, device: torch.device, opts, problems, peak_tflops: float,
                 deadline: float) -> dict:
    """Warm-up + timed steps of one config; medians of the timed ones. The paths are train.py's
    (`run.fast_or_plain`), or the fast ones if `config.forced_fast`."""
    size, checkpointing, forced_fast = config.size, config.checkpointing, config.forced_fast
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "left"  # as model.load_model sets it: generation appends on the right
    model = build_model(size, device, tokenizer)
    if config.lora_rank:
        add_adapters(model, config.lora_rank, 32, size, 0)
    net = working_copy(model, "bf16")  # under LoRA: the model itself, its frozen weights cast in place
    if checkpointing:
        checkpoint_activations(net)
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0, fused=True)
    micro_batch = config.micro_batch or opts.micro_batch
    args = train.Args(algo="grpo", prompts_per_step=opts.prompts, group_size=opts.group_size,
                      max_new_tokens=opts.max_new_tokens, micro_batch=micro_batch, lr=1e-5, beta=0.0,
                      grad_checkpointing=checkpointing, precision="bf16", fast=opts.fast,
                      lora_rank=config.lora_rank)
    if config.prompt_tokens:
        problems = lengthened(problems, config.prompt_tokens)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps, paths = [], fast_paths_on(device) if forced_fast else contextlib.nullcontext()
    for step in range(1, opts.warmup + opts.steps + 1):
        with paths:
            s = run_step(model, net, tokenizer, optimizer, args, problems, step)
        if step == 1:  # the first sampling: no update before it
            allocated_after_sampling = s["allocated_after_sampling"]
        print(f"  {size} ckpt={checkpointing} step {step}: generate {s['generate_s']:.2f}s "
              f"train {s['train_s']:.2f}s", flush=True)
        if step > opts.warmup:
            steps.append(s)
        if time.perf_counter() > deadline and steps:
            print("  over the time budget: stopping this config early", flush=True)
            break
    s = {k: sorted(r[k] for r in steps)[len(steps) // 2] for k in steps[0]}  # medians (upper for even counts)
    step_s = s["generate_s"] + s["score_s"] + s["train_s"]
    gen_flops, train_flops = model_flops(model, s)
    params = sum(p.numel() for p in model.parameters() if not (config.lora_rank and p.requires_grad))
    estimate = estimate_memory(model.config, params, rows=s["rows"], prompt_len=s["prompt_len"],
                               completion_len=opts.max_new_tokens, micro_batch=min(micro_batch, s["rows"]),
                               bf16=True, reference=False, checkpointing=checkpointing,
                               cuda=device.type == "cuda",
                               lora_params=sum(p.numel() for p in trained) if config.lora_rank else 0)
    static = sum(estimate[k] for k in STATIC) - estimate["cuda"]  # what tensors hold: no context
    result = {
        "config": config.name, "size": size, "grad_checkpointing": checkpointing,
        "lora_rank": config.lora_rank,
        # max_memory_allocated after the first sampling, and after the steps, against the estimate's phases
        "allocated_sampling_gib": None if allocated_after_sampling is None else allocated_after_sampling / GIB,
        "est_sampling_gib": (static + estimate["sampling"]) / GIB,
        "allocated_step_gib": torch.cuda.max_memory_allocated(device) / GIB if device.type == "cuda" else None,
        "est_update_gib": (static + estimate["activations"] + estimate["logits"]) / GIB,
        "path": "fast" if forced_fast or opts.fast and device.type in run.FAST_ON else "plain",
        "params_m": params / 1e6, "estimate_gib": estimate["total"] / GIB,
        "timed_steps": len(steps), **s, "step_s": step_s,
        "gen_tokens_per_s": s["gen_tokens"] / s["generate_s"],
        "train_tokens_per_s": s["train_tokens"] / s["train_s"],
        "peak_gib": peak_memory_bytes(device) / 2**30,  # CUDA: since the reset above; CPU: max RSS, all configs
        "mfu_generate": gen_flops / s["generate_s"] / (peak_tflops * 1e12),
        "mfu_train": train_flops / s["train_s"] / (peak_tflops * 1e12),
        "mfu_step": (gen_flops + train_flops) / step_s / (peak_tflops * 1e12),
    }
    return result


COLUMNS = [("size", "size", "{}"), ("grad_checkpointing", "grad ckpt", "{}"), ("path", "path", "{}"),
           ("lora_rank", "LoRA", "{}"), ("prompt_len", "prompt", "{}"),
           ("params_m", "params M", "{:.0f}"), ("generate_s", "generate s", "{:.2f}"),
           ("score_s", "reward s", "{:.3f}"),
           ("train_s", "logprob+backward s", "{:.2f}"), ("step_s", "step s", "{:.2f}"),
           ("gen_tokens_per_s", "gen tok/s", "{:.0f}"), ("train_tokens_per_s", "train tok/s", "{:.0f}"),
           ("peak_gib", "peak GiB", "{:.1f}"), ("estimate_gib", "est GiB", "{:.1f}"),
           ("mfu_generate", "MFU gen", "{:.1%}"), ("mfu_train", "MFU train", "{:.1%}"),
           ("mfu_step", "MFU step", "{:.1%}"), ("sdpa", "SDPA", "{}")]


# Each phase's memory (CUDA: max_memory_allocated, what tensors held, no context) against infra/memory.py's
# (CUDA only: "-" elsewhere)
PHASES = [("config", "config", "{}"), ("allocated_sampling_gib", "allocated after sampling GiB", "{:.1f}"),
          ("est_sampling_gib", "est static + sampling GiB", "{:.1f}"),
          ("allocated_step_gib", "allocated after the steps GiB", "{:.1f}"),
          ("est_update_gib", "est static + update GiB", "{:.1f}")]


def markdown(results: list[dict]) -> str:
    """The table, then each config's memory by phase."""
    return "\n\n".join(markdown_table([title for _, title, _ in columns],
                                       [["-" if r[key] is None else form.format(r[key])
                                         for key, _, form in columns] for r in results])
                        for columns in (COLUMNS, PHASES))


# ------------------------------------------------------------------------------ --smoke: before the table

QUESTIONS = ["2+3?", "What is 17 * 4?", "hi", "a"]  # different lengths: left padding is exercised
SMOKE_METHODS = [("grpo", 0.0), ("avspo", 0.0), ("aapo", 0.0), ("dapo", 0.0), ("grpo", 0.04)]
# Every flag that makes other tensors meet, with --grad-checkpointing (tests/test_device.py's OPENED)
OPENED = dict(beta=0.04, updates_per_batch=2, top_p=0.9)


# A CUDA error can leave the context unusable, and the checks share a model and an optimizer: every later
# check would fail from it, one error reading as many. The smoke stops at the first.
CUDA_ERROR = re.compile(r"CUDA error|CUBLAS_STATUS|cuDNN error")


class Checks:
    """The smoke's results, one check at a time: {"check", "ok", "seconds", "detail": what the check returned,
    or its error's first line}. Not run (ok None, which is no failure): a check past the deadline (a slow
    machine runs fewer checks, not failing ones), and every check after a CUDA error."""

    def __init__(self, deadline: float):
        self.deadline, self.results, self.cuda_error = deadline, [], None

    def run(self, label: str, build) -> None:
        """The (name, check) pairs `build()` returns, one by one; where it raises (a model that did not
        build), one failed check named `label`; after a CUDA error, nothing is built: `label`, not run."""
        try:
            checks = [(label, None)] if self.cuda_error else build()
        except Exception as e:
            checks = [(label, partial(raised, e))]
        for name, fn in checks:
            self.results.append(self.one(name, fn))

    def one(self, name: str, fn) -> dict:
        if self.cuda_error or time.perf_counter() > self.deadline:
            why = (f"after the CUDA error of {self.cuda_error}" if self.cuda_error
                   else "over the smoke time budget")
            print(f"  skip {name}: {why}", flush=True)
            return {"check": name, "ok": None, "detail": f"skipped: {why}"}
        start = time.perf_counter()
        try:
            ok, detail = fn()
        except Exception as e:  # a CUDA-only failure is what this looks for: record it
            ok, detail = False, f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            if CUDA_ERROR.search(str(e)):
                self.cuda_error = name
        result = {"check": name, "ok": ok, "seconds": round(time.perf_counter() - start, 2), "detail": detail}
        print(f"  {'ok  ' if ok else 'FAIL'} {name} ({result['seconds']} s) {detail}", flush=True)
        return result


def fast_equals_plain(device: torch.device) -> list[tuple[str, object]]:
    """tests/test_fast_paths.py's equivalences on `device`, on tiny-qwen2: (name, check) pairs."""
    model, tokenizer = load_model("tiny-qwen2", device)

    def greedy():
        fast, plain = (sample(model, tokenizer, QUESTIONS, 3, 24, temperature=0, sample_completions=fn)
                       for fn in (decode, sample_with_generate))
        same = torch.equal(fast.input_ids, plain.input_ids)
        return same, "greedy decode == generate, token for token" if same else "greedy tokens differ"

    def logprobs(precision: str, lora: bool = False):
        torch.manual_seed(0)
        rollout = sample(model, tokenizer, QUESTIONS, 4, 12, sample_completions=sample_with_generate)
        args = (rollout.input_ids, rollout.attention_mask, rollout.completion_len)
        net = copy.deepcopy(model)
        if lora:
            with_adapters(net)
        net = working_copy(net, precision).train()  # under LoRA the frozen weights, in place
        mask = rollout.completion_mask.bool()
        results = []
        for fn in (completion_logprobs, packing.completion_logprobs):
            net.zero_grad(set_to_none=True)
            logp = fn(net, *args, temperature=0.7)
            (logp * mask).sum().backward()
            trained = [p for p in net.parameters() if p.requires_grad]  # under LoRA the adapters
            results.append((logp.detach().float(), [p.grad.float() for p in trained]))
        (plain, plain_grads), (fast, fast_grads) = results
        logp_err = (plain - fast)[mask].abs().max().item()
        grad_err = max(((a - b).abs().max() / (a.abs().max() + 1e-6)).item() for a, b in zip(plain_grads,
                                                                                             fast_grads))
        tolerance = (1e-4, 1e-3) if precision == "fp32" else (0.05, 0.05)  # bf16: both round, differently
        return (logp_err < tolerance[0] and grad_err < tolerance[1],
                f"max |log-prob diff| {logp_err:.2g}, max relative gradient diff {grad_err:.2g}")

    return [("fast paths: greedy decode vs generate (fp32)", greedy),
            ("fast paths: packed vs plain log-probs and gradients (fp32)", lambda: logprobs("fp32")),
            ("fast paths: packed vs plain log-probs and gradients (bf16)", lambda: logprobs("bf16")),
            ("fast paths: packed vs plain log-probs and adapter gradients, LoRA (bf16)",
             lambda: logprobs("bf16", lora=True))]


@contextlib.contextmanager
def one_process_group(device: torch.device):
    """torchrun's collectives (loop/processes.py) in this one process: nccl on CUDA, which takes only tensors
    on the GPU, gloo on the CPU."""
    import torch.distributed as dist
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                            world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def one_step_each(size: str, precision: str, checkpointing: bool, device: torch.device, problems, reward,
                  opened: bool = False, lora_rank: int = 0):
    """(name, check) pairs: one train.train_step per method on a fresh Run, train.py's paths; rewards from
    `reward` (`PARITY`'s), so that every method's update has rows to train (the check fails where none did).
    `opened`: each method with `OPENED`'s flags, inside `one_process_group`. `lora_rank`: adapters of that
    rank, set up as run.start_run does; a step must also change them and no frozen weight."""
    if size == "tiny-qwen2":
        master, tokenizer = load_model("tiny-qwen2", device)
    else:
        tokenizer = byte_tokenizer()
        tokenizer.padding_side = "left"
        master = build_model(size, device, tokenizer)
    if lora_rank:
        add_adapters(master, lora_rank, 32, size, 0)
    policy = working_copy(master, precision)  # under LoRA: master itself, its frozen weights cast in place
    if lora_rank:
        reference = partial(adapters_off, policy)
    else:
        reference = partial(contextlib.nullcontext, copy.deepcopy(policy).requires_grad_(False))
    if checkpointing:
        checkpoint_activations(policy)
    trained = [p for p in master.parameters() if p.requires_grad]
    frozen = [p for p in master.parameters() if not p.requires_grad]
    optimizer = torch.optim.AdamW(trained, lr=1e-5, weight_decay=0.0, fused=True)

    def step(algo: str, beta: float):
        args = train.Args(algo=algo, prompts_per_step=4, group_size=4, max_new_tokens=16, micro_batch=4,
                          lr=1e-5, precision=precision, grad_checkpointing=checkpointing, lora_rank=lora_rank,
                          reward=PARITY, **{"beta": beta, **(OPENED if opened else {})})
        state = run.Run(master, policy, reference, tokenizer, optimizer, train.algo_state(args), reward,
                        problems, [], 0, Counter())
        before = [p.detach().clone() for p in trained], [p.double().sum().item() for p in frozen]
        with one_process_group(device) if opened else contextlib.nullcontext():
            record, _ = train.train_step(args, state, 1, 0, slice(0, args.prompts_per_step), device)
        ok = record["skipped"] == 0 and math.isfinite(record["grad_norm"]) and record["rows_trained"] > 0
        detail = f"rows trained {record['rows_trained']}, grad norm {record['grad_norm']:.3g}"
        if lora_rank:  # the adapters moved; every frozen weight (a checksum each) did not, nor got a .grad
            moved = sum(not torch.equal(a, p) for a, p in zip(before[0], trained))
            still = [p.double().sum().item() for p in frozen] == before[1]
            ok = ok and moved > 0 and still and all(p.grad is None for p in frozen)
            detail += f", adapters moved {moved} of {len(trained)}, frozen weights unchanged: {still}"
        return ok, detail

    lora = f" LoRA r{lora_rank}" if lora_rank else ""
    label = f"{size} {precision}{' ckpt' if checkpointing else ''}{lora}"
    if opened:
        collectives = "nccl" if device.type == "cuda" else "gloo"
        return [(f"train_step {algo}, every flag opened ({collectives}): {label}",
                 lambda a=algo: step(a, 0.0)) for algo in train.ALGOS]
    return [(f"train_step {algo}{f' beta {beta}' if beta else ''}: {label}",
             lambda a=algo, b=beta: step(a, b)) for algo, beta in SMOKE_METHODS]


HEAD_DIMS = {64: dict(hidden_size=896, num_attention_heads=14),  # Qwen2.5-0.5B's attention
             128: dict(hidden_size=1024, num_attention_heads=8)}  # Qwen2.5-7B's head dim


def kernel_checks(head_dim: int, device: torch.device) -> list[tuple[str, object]]:
    """(name, check) pairs naming the SDPA kernel (`attention_kernels`) of each attention a run on `device`
    can take, in bf16 at `head_dim`, with left-padded prompts and rows that end early: the update's forward
    and backward, plain (HF's SDPA) and packed (`packing.segment_attention`, its SDPA branch forced on off
    CUDA), and generation, HF generate and `decoding.decode`. A check fails where the scores were
    materialised (the math kernel) or no SDPA ran."""
    from transformers import Qwen2Config, Qwen2ForCausalLM
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "left"
    config = Qwen2Config(vocab_size=tokenizer.vocab_size + 3, intermediate_size=512, num_hidden_layers=2,
                         num_key_value_heads=2, tie_word_embeddings=True, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id, **HEAD_DIMS[head_dim])
    torch.manual_seed(0)
    with torch.device(device):
        net = working_copy(Qwen2ForCausalLM(config), "bf16").train()
    rollout = sample(net, tokenizer, QUESTIONS, 2, 12, sample_completions=sample_with_generate)
    rows = (rollout.input_ids, rollout.attention_mask.clone(), rollout.completion_len)
    rows[1][::3, -4:] = 0  # a third of the rows ended early: padding on both sides, as in training

    def update(logprobs):
        net.zero_grad()
        logprobs(net, *rows).sum().backward()

    def generation(sample_completions):
        with torch.no_grad():
            sample(net, tokenizer, QUESTIONS, 2, 8, sample_completions=sample_completions)

    def named(fn, *args):
        def check():
            with mock.patch.object(packing, "attention_by_sdpa", lambda device: True):
                kernels = attention_kernels(lambda: fn(*args))
            return kernels != "none" and "math" not in kernels, f"SDPA kernel: {kernels}"
        return check

    label = f"bf16, head dim {head_dim}"
    return [(f"kernels: update, plain ({label})", named(update, completion_logprobs)),
            (f"kernels: update, packed ({label})", named(update, packing.completion_logprobs)),
            (f"kernels: generation, HF generate ({label})", named(generation, sample_with_generate)),
            (f"kernels: generation, decoding.decode ({label})", named(generation, decode))]


def smoke(device: torch.device, opts, problems, deadline: float) -> Checks:
    """The checks of the module docstring, each time-boxed by `deadline` and failing alone, but for a CUDA
    error, after which none runs (`CUDA_ERROR`)."""
    checks = Checks(deadline)
    checks.run("fast paths", partial(fast_equals_plain, device))
    reward = load_reward(PARITY)  # in its own process, as a user's reward: one for all (~2 s to start)
    for head_dim in HEAD_DIMS:
        checks.run(f"kernels: build (head dim {head_dim})", partial(kernel_checks, head_dim, device))
    sizes = ("tiny-qwen2",) if opts.tiny else ("tiny-qwen2", "0.5B")
    for size in sizes:
        for precision in ("fp32", "bf16"):
            for checkpointing in (False, True):
                label = f"build {size} {precision}{' ckpt' if checkpointing else ''}"
                checks.run(label, partial(one_step_each, size, precision, checkpointing, device, problems,
                                          reward))
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
    for size in sizes:
        checks.run(f"build {size} bf16 ckpt LoRA r2",
                   partial(one_step_each, size, "bf16", True, device, problems, reward, lora_rank=2))

    def opened() -> list[tuple[str, object]]:  # on the CPU, one method: the code runs
        return [(name, fn) for name, fn in one_step_each("tiny-qwen2", "bf16", True, device, problems, reward,
                                                         opened=True)
                if not opts.tiny or name.startswith("train_step aapo,")]

    checks.run("build tiny-qwen2 bf16 ckpt, every flag opened", opened)
    return checks


def raised(error: Exception):
    raise error


def smoke_summary(checks: list[dict]) -> str:
    """One line: how many checks passed, failed and were skipped; the failed named, the skipped by why."""
    failed = [c["check"] for c in checks if c["ok"] is False]
    skipped = [c for c in checks if c["ok"] is None]
    passed = sum(c["ok"] is True for c in checks)
    line = f"smoke: {passed} ok, {len(failed)} FAILED, {len(skipped)} skipped"
    if failed:
        line += f"; FAILED: {', '.join(failed)}"
    for why in dict.fromkeys(c["detail"] for c in skipped):  # "skipped: over the smoke time budget", ...
        line += f"; {why} (not run): {', '.join(c['check'] for c in skipped if c['detail'] == why)}"
    return line


# ------------------------------------------------------------------------------ --memory-table

CARDS_GIB = (24, 48, 80)  # a "24 GB" card holds 24 GiB


def memory_table(prompts: int, group_size: int, new_tokens: int, prompt_len: int) -> str:
    """docs/performance.md's table: infra/memory.py's estimate at the Qwen2.5 sizes (parameters counted on the
    meta device, nothing allocated), bf16, with and without checkpointing: full fine-tuning (float32 master
    weights) at micro-batch 4, 8 and 16, LoRA at rank 32 and 1 (adapters on every linear layer but the
    output layer, `memory.adapter_count`) at micro-batch 8; the static terms include memory.CUDA_ALLOWANCE."""
    rows, notes = [], []
    for size in ("0.5B", "1.5B"):
        model = build_model(size, torch.device("meta"), byte_tokenizer())
        params = sum(p.numel() for p in model.parameters())
        shapes = dict(rows=prompts * group_size, prompt_len=prompt_len, completion_len=new_tokens, bf16=True)
        for rank, micro_batch in [(0, 4), (0, 8), (0, 16), (32, 8), (1, 8)]:
            for checkpointing in (False, True):
                t = estimate_memory(model.config, params, **shapes, micro_batch=micro_batch, reference=False,
                                    checkpointing=checkpointing, cuda=True,
                                    lora_params=adapter_count(model.config, rank))
                fits = ["yes" if t["total"] <= FITS * card * GIB else "no" for card in CARDS_GIB]
                parts = (sum(t[k] for k in STATIC), t["activations"], t["logits"], t["sampling"], t["total"])
                gib = [f"{x / GIB:.1f}" for x in parts]
                rows.append([size, f"{params / 1e6:.0f}", str(rank or "no"), str(micro_batch),
                             "yes" if checkpointing else "no", *gib, *fits])
        notes.append(f"{size}: a reference (AAPO, --beta > 0) adds {2 * params / GIB:.1f} GiB (none under "
                     f"LoRA); adapters of {adapter_count(model.config, 32) / 1e6:.1f}M parameters at rank 32, "
                     f"{adapter_count(model.config, 1) / 1e6:.2f}M at rank 1.")
    return markdown_table(["size", "params M", "LoRA rank", "micro-batch", "grad ckpt", "static GiB",
                           "activations GiB", "logits GiB", "sampling GiB", "total GiB",
                           *(f"{c} GB" for c in CARDS_GIB)], rows) + "\n\n" + "\n\n".join(notes)


def write(report: dict, out: Path) -> None:
    """The JSON report, and the markdown beside it (.md): rewritten after every part, so a run cut short
    keeps what it measured."""
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2))
    w = report["workload"]
    lines = [f"## {report['device']}, bf16 + fp32 master weights, B={w['prompts']} x G={w['group_size']}, "
             f"{w['max_new_tokens']} new tokens, micro-batch {w['micro_batch']}, median of {w['steps']} "
             f"steps after {w['warmup']} warm-up; matmul peak {report['matmul_bf16_tflops']:.0f} TFLOP/s",
             "", f"torch {report['torch']}, transformers {report['transformers']}; PYTORCH_CUDA_ALLOC_CONF "
             f"{report['allocator']}; cuDNN attention {'on' if report['cudnn_attention'] else 'off'}", ""]
    if report["smoke"]:
        lines += ["### smoke checks", "", markdown_table(["check", "ok", "s", "detail"], [
            [c["check"], {True: "ok", False: "FAIL", None: "skipped"}[c["ok"]], str(c.get("seconds", "")),
             c["detail"]] for c in report["smoke"]]), ""]
    lines += [markdown(report["results"])]
    lines += [f"- skipped {s['config']}: {s['reason']}" for s in report["skipped"]]
    out.with_suffix(".md").write_text("\n".join(lines) + "\n")


SECONDS = in_range(0, math.inf, low_open=True)


def main(argv: list[str] | None = None) -> int:
    default_out = Path(os.environ.get("OUT") or ".") / "gpu_bench.json"  # $OUT: the device machine's
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=default_out, help="JSON results file (and .md beside it)")
    parser.add_argument("--device", default="auto", choices=DEVICES, help="as train.py's --device")
    parser.add_argument("--smoke", action="store_true", help="the device checks first, then the table")
    parser.add_argument("--smoke-s", type=SECONDS, default=100, help="time box of the smoke checks")
    parser.add_argument("--memory-table", action="store_true",
                        help="print infra/memory.py's estimate at the Qwen2.5 sizes and stop "
                             "(no device needed)")
    parser.add_argument("--sizes", default="0.5B,1.5B", help="comma list of " + ", ".join(SIZES))
    parser.add_argument("--prompts", type=at_least(1), default=8, help="prompts per step (B)")
    parser.add_argument("--group-size", type=at_least(2), default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=at_least(1), default=512,
                        help="completion length (always reached)")
    parser.add_argument("--micro-batch", type=at_least(1), default=16,
                        help="completions per forward/backward pass")
    parser.add_argument("--steps", type=at_least(1), default=1,
                        help="timed steps per config (median reported)")
    parser.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps before them")
    parser.add_argument("--matmul-size", type=at_least(1), default=8192,
                        help="n of the n^3 bf16 matmul rate test")
    parser.add_argument("--budget-s", type=SECONDS, default=400,
                        help="skip configs that would start after this (smoke included)")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                        help="train.py's --fast (plain on CUDA until verified: then one more row, the fast "
                             "paths forced on); --no-fast: HF generate and the plain forward")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 1 step, 8 tokens")
    opts = parser.parse_args(argv)
    if opts.memory_table:
        print(memory_table(opts.prompts, opts.group_size, opts.max_new_tokens, prompt_len=256))
        return 0
    if opts.tiny:
        opts.sizes, opts.prompts, opts.group_size, opts.max_new_tokens = "tiny", 1, 4, 8
        opts.micro_batch, opts.steps, opts.warmup, opts.matmul_size = 2, 1, 0, 256
    sizes = opts.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    try:
        device = pick_device(opts.device)
    except ValueError as e:
        parser.error(str(e))
    if device.type != "cuda" and not opts.tiny:
        print("no CUDA device: this benchmark is meant for a GPU (use --tiny for a CPU smoke test)")
        return 1
    start = time.perf_counter()
    deadline = start + opts.budget_s
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else platform.processor() or "CPU"
    peak = matmul_tflops(device, opts.matmul_size, iters=50 if device.type == "cuda" else 3)
    print(f"{name}: measured bf16 matmul {peak:.1f} TFLOP/s ({opts.matmul_size}^3)", flush=True)
    report = {"device": name, "torch": torch.__version__, "transformers": transformers.__version__,
              "matmul_bf16_tflops": peak, "allocator": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"),
              "cudnn_attention": torch.backends.cuda.cudnn_sdp_enabled(),
              "workload": {k: getattr(opts, k) for k in ("prompts", "group_size", "max_new_tokens",
                                                         "micro_batch", "steps", "warmup", "fast")},
              "smoke": [], "results": [], "skipped": []}
    problems, cuda_error = load_problems("arith-mul1", "train"), None
    if opts.smoke:
        print("smoke checks:", flush=True)
        checks = smoke(device, opts, problems, min(deadline, time.perf_counter() + opts.smoke_s))
        report["smoke"], cuda_error = checks.results, checks.cuda_error
        write(report, opts.out)
    configs = [RECIPE[size] for size in sizes if size in RECIPE]  # first: what the README's recipe needs
    configs += [Config(size, checkpointing) for size in sizes for checkpointing in (False, True)]
    if opts.fast and device.type not in run.FAST_ON:  # time the fast paths where train.py runs the plain
        configs.append(Config(sizes[0], False, forced_fast=True))
    last_duration = 0.0
    for row in configs:
        config = row.name
        if cuda_error:  # the table would measure a broken context
            print(f"skipped {config}: after the CUDA error of {cuda_error}", flush=True)
            report["skipped"].append({"config": config, "reason": f"after the CUDA error of {cuda_error}"})
            continue
        now = time.perf_counter()
        if now + last_duration > deadline:
            print(f"skipped {config}: over the {opts.budget_s:.0f} s budget", flush=True)
            report["skipped"].append({"config": config, "reason": "time budget"})
            continue
        print(f"{config}:", flush=True)
        try:
            report["results"].append(
                bench_config(row, device, opts, problems, peak, deadline))
        except torch.cuda.OutOfMemoryError as e:
            print(f"  out of memory: {e}".splitlines()[0], flush=True)
            report["skipped"].append({"config": config, "reason": "out of memory"})
        except Exception as e:  # one config's failure must not cost the others: name it, go on
            print(f"  failed: {type(e).__name__}: {e}".splitlines()[0], flush=True)
            report["skipped"].append({"config": config, "reason": f"{type(e).__name__}: {e}".splitlines()[0]})
        gc.collect()  # after the except block, so that a traceback no longer holds the model
        if device.type == "cuda":
            torch.cuda.empty_cache()
        last_duration = time.perf_counter() - now
        report["total_s"] = time.perf_counter() - start
        write(report, opts.out)
    report["total_s"] = time.perf_counter() - start
    write(report, opts.out)
    print()
    print(opts.out.with_suffix(".md").read_text())
    if report["smoke"]:
        print(smoke_summary(report["smoke"]))
    skipped = sum(c["ok"] is None for c in report["smoke"])
    print(f"{opts.out} written; took {report['total_s']:.0f} s" + (
        f"; {skipped} of {len(report['smoke'])} smoke checks were skipped, not passed" if skipped else ""))
    return 1 if any(c["ok"] is False for c in report["smoke"]) else 2 if skipped else 0


if __name__ == "__main__":
    sys.exit(main())

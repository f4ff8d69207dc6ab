"""Our training step on one CUDA GPU at Qwen2.5-0.5B and 1.5B sizes: time split, peak memory, tokens/s, MFU.

  python benchmarks/gpu_bench.py --out gpu_bench.json              # one GPU, about 3 minutes on an H200
  python benchmarks/gpu_bench.py --tiny --out /tmp/gpu_bench.json  # CPU smoke test of the same code, seconds

Models are Qwen2ForCausalLM with the real Qwen2.5-0.5B / 1.5B dimensions and random weights (no download),
bf16 working weights with float32 master weights as train.py uses on CUDA, with and without gradient
checkpointing. Each step is train.py's: model.sample, eval.score_groups, train.compute_advantages,
train.update_policy. Caveats:
  - The byte tokenizer of model_files.byte_tokenizer() writes the prompts (ids < 259), the vocabulary is
    Qwen's 151,936, so the embedding and LM head cost what they cost in the real models.
  - Random weights never emit EOS, so every completion runs to --max-new-tokens.
  - Random weights never answer correctly, and update_policy skips zero-advantage rows, so the rewards
    fed to the advantage step are a fixed mixed pattern: every row is trained, as in a useful batch.
MFU = model FLOPs / time / the bf16 matmul rate measured on this card first (not the datasheet peak).
Model FLOPs: 2 per parameter per token forward, x3 with backward (recomputation under gradient
checkpointing is not counted, as usual for MFU), plus the LM head on the positions that get logits;
attention's own FLOPs are left out (a few % at these lengths). Each distinct prompt counts once, as
decoding.decode prefills it and the update streams it (train.py's `train_tokens`), not once per completion.
Results go to stdout (markdown) and to --out (JSON, rewritten after every config); configs that would
start after --budget-s are skipped and listed.
"""

import argparse
import gc
import json
import platform
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from benchmarks.timing import markdown_table, peak_memory_bytes, sync  # noqa: E402
from common import fast_or_plain  # noqa: E402
from data.tasks import load_problems, step_problems  # noqa: E402
from model import sample, working_copy  # noqa: E402
from model_files import byte_tokenizer  # noqa: E402
from eval import score_groups  # noqa: E402
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
                     args.temperature, args.top_p, fast_or_plain(args.fast).sample_completions)
    sync(device)
    t1 = time.perf_counter()
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
            "rows_trained": stats.get("rows_trained", rows)}


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


def bench_config(size: str, checkpointing: bool, device: torch.device, opts, problems, peak_tflops: float,
                 deadline: float) -> dict:
    """Warm-up + timed steps of one (size, checkpointing) config; medians of the timed ones."""
    tokenizer = byte_tokenizer()
    tokenizer.padding_side = "left"  # as model.load_model sets it: generation appends on the right
    model = build_model(size, device, tokenizer)
    net = working_copy(model, "bf16")
    if checkpointing:
        net.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.0, fused=True)
    args = train.Args(algo="grpo", prompts_per_step=opts.prompts, group_size=opts.group_size,
                      max_new_tokens=opts.max_new_tokens, micro_batch=opts.micro_batch, lr=1e-5, beta=0.0,
                      grad_checkpointing=checkpointing, precision="bf16", fast=opts.fast)
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    steps = []
    for step in range(1, opts.warmup + opts.steps + 1):
        s = run_step(model, net, tokenizer, optimizer, args, problems, step)
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
    result = {
        "size": size, "grad_checkpointing": checkpointing,
        "params_m": sum(p.numel() for p in model.parameters()) / 1e6,
        "timed_steps": len(steps), **s, "step_s": step_s,
        "gen_tokens_per_s": s["gen_tokens"] / s["generate_s"],
        "train_tokens_per_s": s["train_tokens"] / s["train_s"],
        "peak_gib": peak_memory_bytes() / 2**30,  # CUDA: since the reset above; CPU: max RSS, all configs
        "mfu_generate": gen_flops / s["generate_s"] / (peak_tflops * 1e12),
        "mfu_train": train_flops / s["train_s"] / (peak_tflops * 1e12),
        "mfu_step": (gen_flops + train_flops) / step_s / (peak_tflops * 1e12),
    }
    return result


COLUMNS = [("size", "size", "{}"), ("grad_checkpointing", "grad ckpt", "{}"),
           ("params_m", "params M", "{:.0f}"), ("generate_s", "generate s", "{:.2f}"),
           ("score_s", "reward s", "{:.3f}"),
           ("train_s", "logprob+backward s", "{:.2f}"), ("step_s", "step s", "{:.2f}"),
           ("gen_tokens_per_s", "gen tok/s", "{:.0f}"), ("train_tokens_per_s", "train tok/s", "{:.0f}"),
           ("peak_gib", "peak GiB", "{:.1f}"), ("mfu_generate", "MFU gen", "{:.1%}"),
           ("mfu_train", "MFU train", "{:.1%}"), ("mfu_step", "MFU step", "{:.1%}")]


def markdown(results: list[dict]) -> str:
    return markdown_table([title for _, title, _ in COLUMNS],
                          [[form.format(r[key]) for key, _, form in COLUMNS] for r in results])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("gpu_bench.json"), help="JSON results file")
    parser.add_argument("--sizes", default="0.5B,1.5B", help="comma list of " + ", ".join(SIZES))
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step (B)")
    parser.add_argument("--group-size", type=int, default=8, help="completions per prompt (G)")
    parser.add_argument("--max-new-tokens", type=int, default=256, help="completion length (always reached)")
    parser.add_argument("--micro-batch", type=int, default=16, help="completions per forward/backward pass")
    parser.add_argument("--steps", type=int, default=2, help="timed steps per config (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--matmul-size", type=int, default=8192, help="n of the n^3 bf16 matmul rate test")
    parser.add_argument("--budget-s", type=float, default=420,
                        help="skip configs that would start after this")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                        help="the fast paths (train.py --fast); --no-fast: HF generate and the plain forward")
    parser.add_argument("--tiny", action="store_true", help="CPU smoke test: tiny model, 1 step, 8 tokens")
    opts = parser.parse_args(argv)
    if opts.tiny:
        opts.sizes, opts.prompts, opts.group_size, opts.max_new_tokens = "tiny", 1, 4, 8
        opts.micro_batch, opts.steps, opts.warmup, opts.matmul_size = 2, 1, 0, 256
    sizes = opts.sizes.split(",")
    if unknown := [s for s in sizes if s not in SIZES]:
        parser.error(f"--sizes: unknown {unknown}; choose from {', '.join(SIZES)}")
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.type != "cuda" and not opts.tiny:
        print("no CUDA device: this benchmark is meant for a GPU (use --tiny for a CPU smoke test)")
        return 1
    start = time.perf_counter()
    deadline = start + opts.budget_s
    name = torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "CPU"
    peak = matmul_tflops(device, opts.matmul_size, iters=50 if device.type == "cuda" else 3)
    print(f"{name}: measured bf16 matmul {peak:.1f} TFLOP/s ({opts.matmul_size}^3)", flush=True)
    report = {"device": name, "torch": torch.__version__, "matmul_bf16_tflops": peak,
              "workload": {k: getattr(opts, k) for k in ("prompts", "group_size", "max_new_tokens",
                                                         "micro_batch", "steps", "warmup", "fast")},
              "results": [], "skipped": []}
    problems = load_problems("arith-mul1", "train")
    last_duration = 0.0
    for size in sizes:
        for checkpointing in (False, True):
            config = f"{size} grad_checkpointing={checkpointing}"
            now = time.perf_counter()
            if now + last_duration > deadline:
                print(f"skipped {config}: over the {opts.budget_s:.0f} s budget", flush=True)
                report["skipped"].append({"config": config, "reason": "time budget"})
                continue
            print(f"{config}:", flush=True)
            try:
                report["results"].append(
                    bench_config(size, checkpointing, device, opts, problems, peak, deadline))
            except torch.cuda.OutOfMemoryError as e:
                print(f"  out of memory: {e}".splitlines()[0], flush=True)
                report["skipped"].append({"config": config, "reason": "out of memory"})
            gc.collect()  # after the except block, so that a traceback no longer holds the model
            if device.type == "cuda":
                torch.cuda.empty_cache()
            last_duration = time.perf_counter() - now
            report["total_s"] = time.perf_counter() - start
            opts.out.write_text(json.dumps(report, indent=2))
    w = report["workload"]
    print(f"\n## {name}, bf16 + fp32 master weights, B={w['prompts']} x G={w['group_size']}, "
          f"{w['max_new_tokens']} new tokens, micro-batch {w['micro_batch']}, "
          f"median of {w['steps']} steps after {w['warmup']} warm-up; matmul peak {peak:.0f} TFLOP/s\n")
    print(markdown(report["results"]))
    for s in report["skipped"]:
        print(f"- skipped {s['config']}: {s['reason']}")
    report["total_s"] = time.perf_counter() - start
    opts.out.write_text(json.dumps(report, indent=2))
    print(f"\n{opts.out} written; took {report['total_s']:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())

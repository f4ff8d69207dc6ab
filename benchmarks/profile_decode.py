"""Time one rollout (B=2 prompts x G=8, 64 new tokens): HF `generate`, model.decode with plain `F.linear`
products, and model.decode with oneDNN-packed ones (its default), in fp32 and in bf16.

    python benchmarks/profile_decode.py [--model smollm2-135m] [--reps 3] [--profile]

Paths alternate within one process, so CPU contention from other work hits them alike; the median
ms per decoding step is the number to compare (completion lengths vary with the random draws).
"""

import argparse
import statistics
import sys
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decoding  # noqa: E402
from benchmarks.bench import unpacked_linear  # noqa: E402
from model import cpu_features, load_model, sample, working_copy  # noqa: E402

QUESTIONS = ["What is 37 * 8?", "Compute 12 * 9."]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--profile", action="store_true", help="also print the top ops of one decode rollout")
    args = parser.parse_args()
    model, tokenizer = load_model(args.model, torch.device("cpu"))
    model.eval()
    bf16 = {"avx512_bf16", "amx_bf16"} & cpu_features()
    autocast = torch.autocast("cpu", dtype=torch.bfloat16)
    packed, plain = decoding.packed_linear, unpacked_linear
    paths = {"generate fp32": (model, True, nullcontext(), packed),
             "decode fp32 F.linear": (model, False, nullcontext(), plain),
             "decode fp32 packed": (model, False, nullcontext(), packed)}
    if bf16:
        copy = working_copy(model, "bf16")
        paths |= {"generate bf16 autocast": (model, True, autocast, packed),
                  "decode bf16 copy F.linear": (copy, False, nullcontext(), plain),
                  "decode bf16 copy packed": (copy, False, nullcontext(), packed)}
    times = {name: [] for name in paths}
    for rep in range(args.reps + 1):  # the first round warms up
        for name, (net, use_generate, ctx, linear) in paths.items():
            decoding.packed_linear = linear
            torch.manual_seed(rep)
            start = time.perf_counter()
            with ctx:
                rollout = sample(net, tokenizer, QUESTIONS, 8, 64, fast=not use_generate)
            seconds = time.perf_counter() - start
            print(f"  {name}: {seconds:.2f} s, {rollout.completion_len} steps", flush=True)
            if rep:
                times[name].append((seconds, rollout.completion_len, rollout.completion_mask.sum().item()))
    decoding.packed_linear = packed
    print(f"CPU features: {sorted(cpu_features())}, torch threads {torch.get_num_threads()}")
    for name, runs in times.items():
        per_step = statistics.median(s / c for s, c, _ in runs) * 1e3
        print(f"{name:24} {per_step:6.1f} ms/step  median rollout {statistics.median(s for s, _, _ in runs):5.2f} s"
              f"  steps {[c for _, c, _ in runs]}  tokens {[int(t) for _, _, t in runs]}")
    if args.profile:
        net = copy if bf16 else model
        with torch.profiler.profile() as prof:
            sample(net, tokenizer, QUESTIONS, 8, 64)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

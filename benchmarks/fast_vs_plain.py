"""What the fast paths buy over the plain definitions in model.py, in one process: a rollout (B=2 prompts x
G=8, 64 new tokens) and the log-probs' forward and backward of its rows, with each pair of functions
`run.fast_or_plain` names, in fp32 and (where the CPU has native bf16) on the bf16 working copy.

    python benchmarks/fast_vs_plain.py [--model smollm2-135m] [--reps 3] [--profile]

fast and plain alternate within each round, so the machine's drift hits both alike; the first round warms
up. Decoding is compared per decoding step (completion lengths vary with the random draws), the update per
trained token. --profile prints the top ops of one fast rollout (torch.profiler).
"""

import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from infra.flags import FlagParser, at_least  # noqa: E402
from infra.hardware import cpu_features, working_copy  # noqa: E402
from loop.run import fast_or_plain  # noqa: E402
from model import load_model, sample, trim_padding  # noqa: E402

QUESTIONS = ["What is 37 * 8?", "Compute 12 * 9."]


def timed_round(net, tokenizer, fast: bool, seed: int) -> tuple[float, float]:
    """(seconds per decoding step, seconds per trained token) of one rollout and one update pass over it."""
    torch.manual_seed(seed)
    start = time.perf_counter()
    paths = fast_or_plain(fast, net.device)
    rollout = sample(net, tokenizer, QUESTIONS, 8, 64, sample_completions=paths.sample_completions)
    decode_s = (time.perf_counter() - start) / rollout.completion_len
    ids, attn, mask = trim_padding(rollout.input_ids, rollout.attention_mask, rollout.completion_mask)
    start = time.perf_counter()
    for rows in torch.arange(len(ids)).split(8):  # train.py's micro-batches of 8 rows (one prompt each)
        logp = paths.completion_logprobs(net, ids[rows], attn[rows], mask.shape[1])
        (logp * mask[rows]).sum().backward()
    net.zero_grad(set_to_none=True)
    return decode_s, (time.perf_counter() - start) / int(mask.sum())


def main(argv: list[str] | None = None) -> None:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--reps", type=at_least(1), default=3, help="timed rounds (after one warm-up round)")
    parser.add_argument("--profile", action="store_true", help="also print the top ops of one fast rollout")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, torch.device("cpu"))
    nets = {"fp32": model}
    if {"avx512_bf16", "amx_bf16"} & cpu_features():  # emulated bf16 would take minutes
        nets["bf16"] = working_copy(model, "bf16")
    print(f"{args.model}, CPU features {sorted(cpu_features())}, torch threads {torch.get_num_threads()}")
    for precision, net in nets.items():
        times = {True: [], False: []}
        for rep in range(args.reps + 1):
            for fast in (True, False):
                result = timed_round(net, tokenizer, fast, seed=rep)
                if rep:
                    times[fast].append(result)
        (fast_decode, fast_update), (plain_decode, plain_update) = (
            [statistics.median(t[k] for t in times[fast]) for k in (0, 1)] for fast in (True, False))
        print(f"{precision}: decoding step {fast_decode * 1e3:.1f} ms fast, {plain_decode * 1e3:.1f} ms "
              f"plain ({fast_decode / plain_decode:.2f}x); log-probs forward + backward "
              f"{fast_update * 1e3:.2f} ms a trained token fast, {plain_update * 1e3:.2f} ms plain "
              f"({fast_update / plain_update:.2f}x)")
    if args.profile:
        with torch.profiler.profile() as prof:
            sample(nets.get("bf16", model), tokenizer, QUESTIONS, 8, 64,
                   sample_completions=fast_or_plain(True, model.device).sample_completions)
        print(prof.key_averages().table(sort_by="self_cpu_time_total", row_limit=15))


if __name__ == "__main__":
    main()

"""Would torch.compile bring decoding and the update near bench.py's kernel floor, and would it pay for itself?
Times, on this machine, eager against compiled, each against the kernel floor of its matrix products:

  1. one decoding step (`model.decode_step`, train.py's sampler) of 16 rows at a fixed cache length;
  2. the forward and backward of one packed micro-batch (`model.packed_states`, the update's), 8 rows of one
     prompt sampled from the model.

    python benchmarks/compile_check.py [--model smollm2-135m] [--precision auto] [--reps 5]

The inductor cache starts empty (a fresh temporary folder unless TORCHINDUCTOR_CACHE_DIR is set), so the first
compile is what a fresh machine pays; each function is then compiled again from the warm cache, as a second run
on the same machine would. Decoding compiles on plain `F.linear` weights: dynamo cannot trace the oneDNN-packed
ones train.py decodes with (`model.packed_linear`), so both eager variants are shown. Shapes stay fixed here,
which flatters the compiler: in training the decoding batch, the cache and the packed stream change shape at
every step. Eager and compiled calls alternate, so the machine's drift hits both alike; the compiled outputs are
checked against eager ones.
"""

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Callable
from unittest import mock

COLD_CACHE = tempfile.TemporaryDirectory(prefix="compile_check_")  # removed at exit
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", COLD_CACHE.name)  # read when torch is imported: set before it

import torch  # noqa: E402
from transformers import DynamicCache  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
import decoding  # noqa: E402
from benchmarks.bench import kernel_seconds, linear_shapes, unpacked_linear  # noqa: E402
from decoding import DecodeCache, decode_step, decode_weights  # noqa: E402
from model import load_model, resolve_precision, sample, trim_padding, working_copy  # noqa: E402
from packing import TokenLogProbs, pack_rows, packed_states  # noqa: E402

QUESTION = "What is 37 * 8?"


def median_seconds(fns: list[Callable], reps: int) -> list[float]:
    """Median seconds of each fn over `reps` rounds, the fns called in turn within each round."""
    times = [[] for _ in fns]
    for _ in range(reps):
        for fn, ts in zip(fns, times):
            start = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - start)
    return [statistics.median(ts) for ts in times]


def compile_seconds(fn: Callable, call: Callable[[Callable], object], backend: str) -> tuple[Callable, float, float]:
    """torch.compile(fn), and the seconds of its first call with the inductor cache as it was (cold), then again
    after dynamo forgets the compiled code (the cache is warm now)."""
    compiled = torch.compile(fn, backend=backend)
    start = time.perf_counter()
    call(compiled)
    cold = time.perf_counter() - start
    torch._dynamo.reset()
    compiled = torch.compile(fn, backend=backend)
    start = time.perf_counter()
    call(compiled)
    return compiled, cold, time.perf_counter() - start


def tolerance(dtype: torch.dtype) -> float:
    """How far compiled and eager outputs may part: inductor computes bf16 elementwise chains in float32, and bf16
    rounding alone moves SmolLM2's next-token distribution by up to 0.033 (total variation) from fp32's."""
    return 0.1 if dtype == torch.bfloat16 else 0.01


def report(title: str, floor: float, rows: list[tuple[str, float]]) -> None:
    print(f"{title}: kernel floor {floor * 1e3:.2f} ms")
    for name, seconds in rows:
        print(f"  {name:34} {seconds * 1e3:9.2f} ms = {seconds / floor:.2f}x the floor")


def check_decoding(net, tokenizer, shapes, rows: int, column: int, reps: int, backend: str,
                   dtype: torch.dtype) -> None:
    ids = tokenizer(QUESTION * column, return_tensors="pt").input_ids[:, :column]  # [1, column]: real text
    prefill = DynamicCache(config=net.config)
    with torch.no_grad():
        net(input_ids=ids, cache=prefill, use_cache=True)
    cache = DecodeCache.from_prefill(prefill, rows, 1)  # every row's cache holds that text; column `column` is free
    tokens, positions = ids[0, :rows], torch.full((rows,), column)
    mask = torch.ones(rows, column + 1, dtype=torch.bool)
    packed = decode_weights(net, rows)  # oneDNN-packed, as train.py decodes
    with mock.patch.object(decoding, "packed_linear", unpacked_linear):
        plain = decode_weights(net, rows)  # what dynamo can trace

    def step(fn: Callable, weights) -> Callable[[], torch.Tensor]:
        return lambda: fn(net, weights, tokens, positions, cache, column, mask)

    with torch.no_grad():
        compiled, cold, warm = compile_seconds(decode_step, lambda fn: step(fn, plain)(), backend)
        eager_logits, compiled_logits = step(decode_step, plain)(), step(compiled, plain)()
        times = median_seconds([step(decode_step, packed), step(decode_step, plain), step(compiled, plain)], reps)
    report(f"decoding step, {rows} rows, {column} cached positions", kernel_seconds(shapes, rows, dtype),
           list(zip(["eager, packed weights (train.py)", "eager, F.linear", "compiled, F.linear"], times)))
    # the same sampling distribution: total variation distance of softmax(logits), worst row
    distance = 0.5 * (compiled_logits.float().softmax(-1) - eager_logits.float().softmax(-1)).abs().sum(-1).max()
    print(f"  compile: {cold:.1f} s cold, {warm:.1f} s from the warm cache; next-token distributions differ by "
          f"{distance:.2g} (total variation, worst row)")
    assert distance < tolerance(dtype), "the compiled decoding step computes another distribution"


def check_update(net, tokenizer, body, head, reps: int, backend: str, dtype: torch.dtype) -> None:
    torch.manual_seed(0)
    rollout = sample(net, tokenizer, [QUESTION], 8, 64)
    input_ids, attention_mask, completion_mask = trim_padding(rollout.input_ids, rollout.attention_mask,
                                                              rollout.completion_mask)
    stream = pack_rows(input_ids, attention_mask, completion_mask.shape[1])
    no_output = stream.query_slots.numel()  # the output slot of a dummy token
    tokens, targets = int((stream.output_slots != no_output).sum()), stream.num_targets  # real ones
    net.train()

    def forward_backward(states: Callable) -> torch.Tensor:
        logits = net.lm_head(states(net, stream).index_select(0, stream.predictors))
        logp = TokenLogProbs.apply(logits, stream.targets, 1.0)
        logp.sum().backward()
        net.zero_grad(set_to_none=True)
        return logp.detach()

    compiled, cold, warm = compile_seconds(packed_states, forward_backward, backend)
    eager_logp, compiled_logp = forward_backward(packed_states), forward_backward(compiled)
    times = median_seconds([lambda: forward_backward(packed_states), lambda: forward_backward(compiled)], reps)
    net.eval()
    floor = 3 * (kernel_seconds(body, tokens, dtype) + kernel_seconds((head,), targets, dtype))  # 6 x params x tokens
    report(f"update: forward + backward of 8 rows, {tokens} tokens packed, {targets} with logits", floor,
           list(zip(["eager (train.py)", "compiled"], times)))
    difference = (compiled_logp.exp() - eager_logp.exp()).abs().max()  # probabilities of the sampled tokens
    print(f"  compile: {cold:.1f} s cold, {warm:.1f} s from the warm cache; token probabilities differ by up to "
          f"{difference:.2g}")
    assert difference < tolerance(dtype), "the compiled forward computes other log-probs"


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--precision", default="auto", choices=["auto", "fp32", "bf16"])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--column", type=int, default=60, help="cached positions in the decoding step")
    parser.add_argument("--backend", default="inductor", help="torch.compile backend ('eager': a quick smoke test)")
    args = parser.parse_args(argv)
    model, tokenizer = load_model(args.model, torch.device("cpu"))
    precision = resolve_precision(args.precision, torch.device("cpu"))
    net = working_copy(model, precision).eval()
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    body, head = linear_shapes(args.model)
    print(f"{args.model}, {precision}, torch {torch.__version__}, backend {args.backend}, "
          f"{torch.get_num_threads()} threads")
    check_decoding(net, tokenizer, body + (head,), 16, args.column, args.reps, args.backend, dtype)
    check_update(net, tokenizer, body, head, args.reps, args.backend, dtype)


if __name__ == "__main__":
    main()

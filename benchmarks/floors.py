"""The floors benchmarks/bench.py holds each GRPO step against: the work any implementation must do for the
step's batch, timed at this machine's limits (`phase_floors` says how)."""

import functools
import statistics

import torch

from benchmarks.timing import best_seconds, fmt
from fast.decoding import packed_linear
from model import load_model


def batch_shape(lengths: list[int], prompt_lengths: list[int], rewards: list[float],
                group_size: int) -> dict:
    """What one step's floors need from its batch of B x G completions (rows b*G .. b*G+G-1 share prompt b):
    the completion lengths, the real tokens of its B distinct prompts, and what a minimal update must train:
    the rows of groups whose rewards differ (with beta 0 every other row has advantage 0 and no gradient)."""
    groups = [range(b * group_size, (b + 1) * group_size) for b in range(len(prompt_lengths))]
    mixed = [b for b, rows in enumerate(groups) if len({rewards[i] for i in rows}) > 1]
    return {"lengths": lengths, "prompt_tokens": sum(prompt_lengths),
            "trained_prompt_tokens": sum(prompt_lengths[b] for b in mixed),
            "trained_completion_tokens": sum(lengths[i] for b in mixed for i in groups[b]),
            "trained_rows": len(mixed) * group_size}


def linear_shapes(model: str) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
    """(out, in) of every matmul weight of one forward pass but the output layer's, and the output layer's."""
    net = load_model(model, torch.device("cpu"))[0]
    head = net.get_output_embeddings()
    body = tuple(tuple(m.weight.shape) for m in net.modules()
                 if isinstance(m, torch.nn.Linear) and m is not head)
    return body, tuple(head.weight.shape)


def machine_rates(dtypes: list[torch.dtype]) -> dict:
    """The physical limits measured here: peak matmul FLOP/s per dtype, from a large square GEMM by the faster
    of torch's default kernel and `decoding.packed_linear`'s oneDNN one (the kernel floor may use either, so
    the peak must not be the slower one: on some CPUs that is torch's default; docs/performance.md), and read
    bytes/s."""
    rates = {}
    for dtype in dtypes:
        a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        packed = packed_linear(b.t().contiguous(), None, 2048)  # a @ b as x @ W.T
        seconds = min(best_seconds(lambda: a @ b, reps=5), best_seconds(lambda: packed(a), reps=5))
        rates[dtype] = 2 * 2048**3 / seconds
    big = torch.ones(2**27)  # 512 MiB, far beyond any cache
    rates["read_bytes_s"] = big.numel() * 4 / best_seconds(lambda: big.sum(), reps=5)
    return rates


@functools.cache
def kernel_seconds(shapes: tuple[tuple[int, int], ...], rows: int, dtype: torch.dtype) -> float:
    """Seconds for x[rows, in] @ W.T over every weight in `shapes`, each a distinct tensor (read from memory,
    as in a decoding step): the model's own products at this CPU's best kernel speed, nothing else. Best of
    plain `F.linear` and `decoding.packed_linear` (oneDNN-packed weights, what decoding uses)."""
    weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
    inputs = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
    packed = [packed_linear(w, None, rows) for w in weights]
    plain = best_seconds(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], reps=5)
    return min(plain, best_seconds(lambda: [p(inputs[w.shape[1]]) for p, w in zip(packed, weights)], reps=5))


def param_count(shapes: tuple[tuple[int, int], ...]) -> int:
    return sum(o * i for o, i in shapes)


def update_tokens(shape: dict) -> tuple[int, int]:
    """(tokens through the body, tokens through the output layer) of a minimal update of one step's batch."""
    completion = shape["trained_completion_tokens"]
    return shape["trained_prompt_tokens"] + completion, completion


def step_floors(shape: dict, body: tuple, head: tuple, dtype: torch.dtype, rates: dict,
                update_rates: tuple) -> dict:
    """One step's floors in seconds, from its batch shape (`batch_shape`); see `phase_floors`."""
    body_params, head_params = param_count(body), param_count((head,))
    lengths, weight_bytes = shape["lengths"], (body_params + head_params) * torch.finfo(dtype).bits // 8
    live = [sum(n > t for n in lengths) for t in range(1, max(lengths))]  # rows that run decoding pass t
    body_tokens, head_tokens = update_tokens(shape)
    gen_flops = 2 * (body_params * (shape["prompt_tokens"] + sum(lengths)) + head_params * sum(lengths))
    prefill = kernel_seconds(body, shape["prompt_tokens"], dtype) + kernel_seconds((head,), 1, dtype)
    passes = sum(kernel_seconds(body + (head,), n, dtype) for n in live)
    return {"gen_kernel": prefill + passes,
            "gen_physical": max(weight_bytes * (1 + len(live)) / rates["read_bytes_s"],
                                gen_flops / rates[dtype]),
            "update_kernel": 6 * (body_params * body_tokens / update_rates[0]
                                  + head_params * head_tokens / update_rates[1]),
            "update_physical": 6 * (body_params * body_tokens + head_params * head_tokens) / rates[dtype]}


def phase_floors(r: dict, args) -> dict:
    """One GRPO config's (`args`: a train.Args) two floors per phase, for each timed step's own batch,
    measured on this machine right after its steps (in the same process: a shared machine's bandwidth and GEMM
    rate drift over minutes, so a phase and its floor are timed together). The floors count the work any
    implementation must do:

    generation: the prefill (each distinct prompt's real tokens once), then one pass per token up to the
                longest row, each pass with the rows still decoding (a row that has ended costs nothing).
                physical = max(weight bytes x passes / read bandwidth, its FLOPs / peak FLOP/s);
                kernel = those products timed on the model's own weight shapes with each pass's rows.
    update:     forward + backward (6 x params x tokens) over the rows an update must train (groups with
                differing rewards) and their real tokens: prompts once, completions without padding, the
                output layer on completion positions only. physical at the peak rate (a large square GEMM);
                kernel at the rate the model's own products reach with an update's tokens per micro-batch
                (median step).
    Floors and ratios are medians over the timed steps, each step's time against its own batch's floor.
    """
    body, head = linear_shapes(args.model)
    dtype = torch.float32 if args.precision == "fp32" else torch.bfloat16
    rates = machine_rates([dtype])
    steps = r["per_step"]
    trained = [s for s in steps if s["trained_rows"]]  # a step whose groups all collapsed needs no update
    update_rates = (1.0, 1.0)
    if trained:
        micro = [[t / -(-s["trained_rows"] // args.micro_batch) for t in update_tokens(s)] for s in trained]
        rows = [max(1, round(statistics.median(m[k] for m in micro))) for k in (0, 1)]  # per micro-batch
        update_rates = tuple(2 * param_count(shapes) * n / kernel_seconds(shapes, n, dtype)
                             for shapes, n in ((body, rows[0]), ((head,), rows[1])))
    floors = [step_floors(s, body, head, dtype, rates, update_rates) for s in steps]
    result = {"peak_flop_s": rates[dtype], "read_bytes_s": rates["read_bytes_s"],
              "params": param_count(body + (head,))}
    for key, phase in (("gen_kernel", "generate"), ("gen_physical", "generate"),
                       ("update_kernel", "train"), ("update_physical", "train")):
        pairs = [(s[f"{phase}_s"], f[key]) for s, f in zip(steps, floors) if f[key] > 0]
        result[key] = statistics.median(f for _, f in pairs) if pairs else None
        result[f"{key}_ratio"] = statistics.median(t / f for t, f in pairs) if pairs else None
    return result


def floor_rows(results: dict) -> tuple[list[list[str]], list[str]]:
    """The floor table: each GRPO config's generate and update times against the floors measured with it."""
    rows, params = [], None
    for (impl, _, precision, _), r in results.items():
        if "floors" not in r:
            continue
        f, params = r["floors"], r["floors"]["params"]
        row = [impl, precision]
        for phase, floors in (("generate_s", ("gen_kernel", "gen_physical")),
                              ("train_s", ("update_kernel", "update_physical"))):
            row.append(fmt(r[phase]))
            for key in floors:
                row += [fmt(f[key]), "–" if f[f"{key}_ratio"] is None else fmt(f[f"{key}_ratio"]) + "x"]
        rows.append(row + [fmt(f["peak_flop_s"] / 1e9, 0), fmt(f["read_bytes_s"] / 1e9, 1)])
    notes = [f"matmul params {params / 1e6:.1f}M; peak: a 2048 x 2048 GEMM in the config's dtype; "
             "read: a 512 MiB sum",
             "floors count the work any implementation must do for each step's batch: generation = prefill "
             "of each distinct prompt, then one pass per token up to the longest row with the rows still "
             "decoding; update = forward + backward of the rows in groups with differing rewards, real "
             "tokens only (prompts once, no padding), the output layer on completion positions only",
             "physical floor: generation max(weight bytes x passes / bandwidth, FLOPs / peak), update FLOPs "
             "/ peak; kernel floor: the same products at the speed the model's own weight shapes reach with "
             "the phase's rows",
             "floors and ratios: medians over the timed steps, each step's time against its own batch's "
             "floors"]
    return rows, notes


FLOOR_COLUMNS = ["impl", "precision", "generate s", "gen kernel floor s", "gen / kernel",
                 "gen physical floor s", "gen / physical", "update s", "update kernel floor s",
                 "update / kernel", "update physical floor s", "update / physical", "peak GFLOP/s",
                 "read GB/s"]

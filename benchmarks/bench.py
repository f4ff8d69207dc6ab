"""Speed and memory of one training step: ours vs TRL's GRPOTrainer, GRPO vs AVSPO vs AAPO, and the verifier.

    python benchmarks/bench.py           # reference config: SmolLM2-135M, fp32, B=2 prompts x G=8, 64 new tokens
    python benchmarks/bench.py --precision both  # also bf16 (TRL: bf16 autocast)
    python benchmarks/bench.py --quick   # tiny random Qwen2, 2 steps, 200 verifier cases per check: seconds
    python benchmarks/bench.py --rounds 3  # every config 3 times, interleaved: ratios robust to the machine's drift

Every training config runs in a fresh process, so its peak memory is its own: max RSS on CPU,
torch.cuda.max_memory_allocated on GPU. Step times are medians over --steps steps after --warmup
steps; the held-out evaluation and checkpoint that train.train does around the steps are not timed.
TRL is optional (pip install trl==1.16.0); without it, or with --skip-trl, its rows are left out.

How each number is measured:
  1. ours: train.train on the config; generate / reward / train (log-probs + backward + optimizer
     step) are the per-step times it logs in metrics.jsonl.
  2. TRL: GRPOTrainer on the same model, prompts, sampling and loss ("dapo", beta 0, one update per
     batch); a callback times each optimizer step, the reward function times itself, and
     _generate_and_score_completions is wrapped to time generation (TRL has no per-phase timer).
  3. AVSPO and AAPO: their own train.train runs. AVSPO's only extra work is its advantage step, timed
     directly (train.compute_advantages, many calls) against GRPO's step time; AAPO also samples a
     second group from the frozen reference model, so its whole step is compared with GRPO's.
  4. Verifier: verifier.verify (and math-verify, if installed) per call on the shared GSM8K and
     MATH-500 cases of benchmarks/verifier_bench.py.
"""

import argparse
import dataclasses
import functools
import importlib.util
import json
import multiprocessing
import resource
import statistics
import sys
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import Callable

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from data.tasks import load_problems  # noqa: E402
from decoding import packed_linear  # noqa: E402
from model import cpu_features, load_model, pick_device  # noqa: E402
from verifier import verify  # noqa: E402

DATA_DIR = ROOT.parent / "shared" / "data"
AVSPO_GOAL, AAPO_GOAL = 0.1, 1.6  # AVSPO advantage step < 0.1% of a GRPO step; AAPO step <= 1.6x GRPO's


def reference_args(model: str, steps: int, precision: str, algo: str = "grpo",
                   micro_batch: int = train.Args.micro_batch) -> train.Args:
    """The reference config: G=8, 2 prompts, 64 new tokens, lr 1e-5 constant (as TRL's below), beta 0, one update,
    no eval, no saving."""
    return train.Args(algo=algo, model=model, dataset="arith-mul1", steps=steps, prompts_per_step=2, group_size=8,
                      max_new_tokens=64, temperature=1.0, lr=1e-5, lr_decay=0.0, beta=0.0,
                      updates_per_batch=1, micro_batch=micro_batch, precision=precision, eval_every=0, eval_size=1,
                      save_every=0)


# ------------------------------------------------------------------------------ one config per process


def run_isolated(fn: Callable, *args):
    """fn(*args) in a fresh (spawned) Python process, so that its peak memory is measured alone."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(fn, *args).result()


def peak_memory_mb() -> float:
    """Peak memory of this process so far: CUDA allocations on GPU, resident set size on CPU."""
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**20
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def median_of(rows: list[dict], key: str) -> float:
    return statistics.median(r[key] for r in rows)


def batch_shape(lengths: list[int], prompt_lengths: list[int], rewards: list[float], group_size: int) -> dict:
    """What one step's floors need from its batch of B x G completions (rows b*G .. b*G+G-1 share prompt b):
    the completion lengths, the real tokens of its B distinct prompts, and what a minimal update must train:
    the rows of groups whose rewards differ (with beta 0 every other row has advantage 0 and no gradient)."""
    groups = [range(b * group_size, (b + 1) * group_size) for b in range(len(prompt_lengths))]
    mixed = [b for b, rows in enumerate(groups) if len({rewards[i] for i in rows}) > 1]
    return {"lengths": lengths, "prompt_tokens": sum(prompt_lengths),
            "trained_prompt_tokens": sum(prompt_lengths[b] for b in mixed),
            "trained_completion_tokens": sum(lengths[i] for b in mixed for i in groups[b]),
            "trained_rows": len(mixed) * group_size}


def bench_ours(args: train.Args, warmup: int) -> dict:
    """train.train for warmup + steps steps; medians of the per-step times it logs, after the warm-up."""
    args = dataclasses.replace(args, steps=warmup + args.steps)
    shapes, generate_and_score = [], train.generate_and_score

    def recording_generate_and_score(*a, **kw):  # one call per GRPO step (AAPO's reference samples call it too)
        rollout, rewards = generate_and_score(*a, **kw)
        prompt_mask = rollout.attention_mask[:: args.group_size, : rollout.input_ids.shape[1] - rollout.completion_len]
        shapes.append(batch_shape(rollout.completion_mask.sum(1).tolist(), prompt_mask.sum(1).tolist(),
                                  rewards.flatten().tolist(), args.group_size))
        return rollout, rewards

    if args.algo == "grpo":  # the only config with floors; this spawned process runs nothing else
        train.generate_and_score = recording_generate_and_score
    with tempfile.TemporaryDirectory() as tmp:
        run_dir = Path(tmp) / args.algo
        train.train(args, run_dir)
        rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()][warmup:]
    for r in rows:
        r["time_step"] = r["time_generate"] + r["time_score"] + r["time_train"]
    return {"generate_s": median_of(rows, "time_generate"), "reward_s": median_of(rows, "time_score"),
            "train_s": median_of(rows, "time_train"), "step_s": median_of(rows, "time_step"),
            "gen_tok_s": median_of(rows, "gen_tokens_per_s"), "train_tok_s": median_of(rows, "train_tokens_per_s"),
            "completion_len": median_of(rows, "completion_len"), "peak_mb": peak_memory_mb(),
            "rows_trained": median_of(rows, "rows_trained") if "rows_trained" in rows[0] else None,
            "per_step": [{"generate_s": r["time_generate"], "train_s": r["time_train"], **shape}
                         for r, shape in zip(rows, shapes[warmup:])]}


def bench_trl(args: train.Args, warmup: int) -> dict:
    """TRL's GRPOTrainer on the same config; per-step times from a callback, medians after the warm-up."""
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    device = pick_device()
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)
    model, tokenizer = load_model(args.model, device)
    problems = load_problems(args.dataset, "train", args.seed)
    dataset = Dataset.from_list([{"prompt": [{"role": "user", "content": p.question}], "answer": p.answer}
                                 for p in problems])
    steps: list[dict] = []  # one record per optimizer step, filled in by the three timers below

    class StepTimer(TrainerCallback):
        def on_step_begin(self, *_, **__):
            sync()
            steps.append({"reward_s": 0.0, "gen_tokens": 0, "start": time.perf_counter()})

        def on_step_end(self, *_, **__):
            sync()
            steps[-1]["step_s"] = time.perf_counter() - steps[-1]["start"]

    def correctness(prompts, completions, answer, completion_ids, **_) -> list[float]:
        start = time.perf_counter()
        rewards = [float(verify(c[0]["content"], a)) for c, a in zip(completions, answer)]
        steps[-1]["reward_s"] += time.perf_counter() - start
        steps[-1]["gen_tokens"] += sum(len(ids) for ids in completion_ids)
        texts = [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
                 for p in prompts[:: args.group_size]]
        prompt_lengths = [len(ids) for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
        steps[-1]["shape"] = batch_shape([len(ids) for ids in completion_ids], prompt_lengths, rewards,
                                         args.group_size)
        return rewards

    completions = args.prompts_per_step * args.group_size
    with tempfile.TemporaryDirectory() as tmp:
        config = GRPOConfig(
            output_dir=tmp, max_steps=warmup + args.steps, seed=args.seed,
            # 2 prompts x 8 completions per optimizer step, forward/backward in micro-batches like ours
            num_generations=args.group_size, per_device_train_batch_size=min(args.micro_batch, completions),
            gradient_accumulation_steps=max(1, completions // args.micro_batch),
            max_completion_length=args.max_new_tokens, temperature=args.temperature, top_p=args.top_p, top_k=0,
            learning_rate=args.lr, lr_scheduler_type="constant", weight_decay=0.0, max_grad_norm=args.max_grad_norm,
            beta=args.beta, num_iterations=args.updates_per_batch, epsilon=args.epsilon,
            epsilon_high=args.epsilon_high, loss_type="dapo", scale_rewards="group", disable_dropout=True,
            bf16=args.precision == "bf16", use_cpu=device.type == "cpu",
            eval_strategy="no", save_strategy="no", report_to="none", logging_steps=10**9,
        )
        trainer = GRPOTrainer(model=model, reward_funcs=correctness, args=config, train_dataset=dataset,
                              processing_class=tokenizer, callbacks=[StepTimer()])
        generate_and_score = trainer._generate_and_score_completions  # private, but the one place it samples

        def timed_generate_and_score(*a, **kw):
            start = time.perf_counter()
            out = generate_and_score(*a, **kw)
            sync()
            steps[-1]["gen_score_s"] = steps[-1].get("gen_score_s", 0.0) + time.perf_counter() - start
            return out

        trainer._generate_and_score_completions = timed_generate_and_score
        trainer.train()
    rows = steps[warmup:]
    for r in rows:
        r["generate_s"] = r["gen_score_s"] - r["reward_s"]
        r["train_s"] = r["step_s"] - r["gen_score_s"]
        r["gen_tok_s"] = r["gen_tokens"] / r["generate_s"]
    return {"generate_s": median_of(rows, "generate_s"), "reward_s": median_of(rows, "reward_s"),
            "train_s": median_of(rows, "train_s"), "step_s": median_of(rows, "step_s"),
            "gen_tok_s": median_of(rows, "gen_tok_s"), "train_tok_s": None,
            "completion_len": median_of(rows, "gen_tokens") / completions, "peak_mb": peak_memory_mb(),
            "rows_trained": completions,  # TRL runs forward/backward on every row, zero advantage or not
            "per_step": [{"generate_s": r["generate_s"], "train_s": r["train_s"], **r["shape"]} for r in rows]}


def measure_config(impl: str, args: train.Args, warmup: int) -> dict:
    """One config's step times (ours or TRL's) and, for GRPO, its floors measured right after them."""
    result = (bench_ours if impl == "ours" else bench_trl)(args, warmup)
    if args.algo == "grpo":
        result["floors"] = phase_floors(result, args)
    return result


# ------------------------------------------------------------------------------ AVSPO's extra work


def advantage_seconds(args: train.Args, reps: int) -> float:
    """Seconds per train.compute_advantages call on realistic [B, G] 0/1 rewards, worst of two batches:
    mixed groups (AVSPO does GRPO's work) and all groups collapsed (it adds virtual samples)."""
    shape = (args.prompts_per_step, args.group_size)
    mixed = (torch.arange(shape[0] * shape[1]).view(shape) % 3 == 0).float()  # every group has both rewards
    batches = {"mixed": mixed, "collapsed": torch.ones(shape).index_fill_(0, torch.tensor([0]), 0.0)}
    def sample_reference():  # only AAPO calls it; its sampling is timed in its own training run
        return None, torch.zeros(shape)

    worst = 0.0
    for rewards in batches.values():
        state = train.algo_state(args)
        train.compute_advantages(args, rewards, state, sample_reference)  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            train.compute_advantages(args, rewards, state, sample_reference)
        worst = max(worst, (time.perf_counter() - start) / reps)
    return worst


# ------------------------------------------------------------------------------ verifier


def verifier_rows(data_dir: Path, limit: int | None) -> list[list[str]] | None:
    """Median and worst µs per call of each verifier on GSM8K and MATH-500 (self + cross) cases;
    None, with a message, when the shared data folder is absent."""
    from benchmarks.verifier_bench import load_cases, math_verify_check, run

    if not (data_dir / "math500_test.jsonl").exists():
        print(f"shared data not found in {data_dir}: verifier section skipped")
        return None
    cases = load_cases(data_dir)
    half = None if limit is None else limit // 2  # MATH-500: as many should-accept as should-reject cases
    sets = {"GSM8K": cases["gsm8k"][:limit], "MATH-500": cases["math_self"][:half] + cases["math_cross"][:half]}
    checks = {"verifier.verify": verify, "math-verify": math_verify_check()}
    rows = []
    for name, check in checks.items():
        if check is None:
            print("math-verify not installed (pip install math-verify): its rows are left out")
            continue
        for label, subset in sets.items():
            print(f"verifier: {name} on {len(subset)} {label} cases")
            agree, seconds = run(check, subset)
            us = [s * 1e6 for s in seconds]
            rows.append([name, label, str(len(us)), f"{100 * agree / len(us):.1f}%",
                         f"{statistics.median(us):.1f}", f"{max(us):.1f}"])
    return rows


# ------------------------------------------------------------------------------ floors


def best_seconds(fn: Callable, reps: int = 3) -> float:
    fn()  # warm-up
    best = float("inf")
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def linear_shapes(model: str) -> tuple[tuple[tuple[int, int], ...], tuple[int, int]]:
    """(out, in) of every matmul weight of one forward pass but the output layer's, and the output layer's."""
    net = load_model(model, torch.device("cpu"))[0]
    head = net.get_output_embeddings()
    body = tuple(tuple(m.weight.shape) for m in net.modules() if isinstance(m, torch.nn.Linear) and m is not head)
    return body, tuple(head.weight.shape)


def machine_rates(dtypes: list[torch.dtype]) -> dict:
    """The physical limits measured here: peak matmul FLOP/s per dtype, from a large square GEMM by the faster of
    torch's default kernel and `model.packed_linear`'s oneDNN one (on a 2-core AMD EPYC the latter reached 227
    against 190 GFLOP/s in fp32, and the kernel floor came out below the physical one), and read bytes/s."""
    rates = {}
    for dtype in dtypes:
        a, b = torch.randn(2048, 2048).to(dtype), torch.randn(2048, 2048).to(dtype)
        packed = packed_linear(b.t().contiguous(), None, 2048)  # a @ b as x @ W.T
        rates[dtype] = 2 * 2048**3 / min(best_seconds(lambda: a @ b, reps=5), best_seconds(lambda: packed(a), reps=5))
    big = torch.ones(2**27)  # 512 MiB, far beyond any cache
    rates["read_bytes_s"] = big.numel() * 4 / best_seconds(lambda: big.sum(), reps=5)
    return rates


def unpacked_linear(weight: torch.Tensor, bias: torch.Tensor | None, rows: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """`model.packed_linear` without the packing (plain `F.linear`): what the benchmarks hold packing against."""
    return lambda x: torch.nn.functional.linear(x, weight, bias)


@functools.cache
def kernel_seconds(shapes: tuple[tuple[int, int], ...], rows: int, dtype: torch.dtype) -> float:
    """Seconds for x[rows, in] @ W.T over every weight in `shapes`, each a distinct tensor (read from memory, as in
    a decoding step): the model's own products at this CPU's best kernel speed, nothing else. Best of plain
    `F.linear` and `model.packed_linear` (oneDNN-packed weights, what fp32 decoding uses)."""
    weights = [torch.randn(o, i).to(dtype) for o, i in shapes]
    inputs = {i: torch.randn(rows, i).to(dtype) for _, i in shapes}
    packed = [packed_linear(w, None, rows) for w in weights]
    return min(best_seconds(lambda: [torch.nn.functional.linear(inputs[w.shape[1]], w) for w in weights], reps=5),
               best_seconds(lambda: [p(inputs[w.shape[1]]) for p, w in zip(packed, weights)], reps=5))


def param_count(shapes: tuple[tuple[int, int], ...]) -> int:
    return sum(o * i for o, i in shapes)


def update_tokens(shape: dict) -> tuple[int, int]:
    """(tokens through the body, tokens through the output layer) of a minimal update of one step's batch."""
    return shape["trained_prompt_tokens"] + shape["trained_completion_tokens"], shape["trained_completion_tokens"]


def step_floors(shape: dict, body: tuple, head: tuple, dtype: torch.dtype, rates: dict, update_rates: tuple) -> dict:
    """One step's floors in seconds, from its batch shape (`batch_shape`); see `phase_floors`."""
    body_params, head_params = param_count(body), param_count((head,))
    lengths, weight_bytes = shape["lengths"], (body_params + head_params) * torch.finfo(dtype).bits // 8
    live = [sum(n > t for n in lengths) for t in range(1, max(lengths))]  # rows that run decoding pass t
    body_tokens, head_tokens = update_tokens(shape)
    gen_flops = 2 * (body_params * (shape["prompt_tokens"] + sum(lengths)) + head_params * sum(lengths))
    return {"gen_kernel": kernel_seconds(body, shape["prompt_tokens"], dtype) + kernel_seconds((head,), 1, dtype)
                          + sum(kernel_seconds(body + (head,), n, dtype) for n in live),  # prefill, then each pass
            "gen_physical": max(weight_bytes * (1 + len(live)) / rates["read_bytes_s"], gen_flops / rates[dtype]),
            "update_kernel": 6 * (body_params * body_tokens / update_rates[0]
                                  + head_params * head_tokens / update_rates[1]),
            "update_physical": 6 * (body_params * body_tokens + head_params * head_tokens) / rates[dtype]}


def phase_floors(r: dict, args: train.Args) -> dict:
    """One GRPO config's two floors per phase, for each timed step's own batch, measured on this machine right
    after its steps (in the same process: this machine's bandwidth and GEMM rate drift by up to 2.5x over minutes,
    so a phase and its floor are timed together). The floors count the work any implementation must do:

    generation: the prefill (each distinct prompt's real tokens once), then one pass per token up to the longest
                row, each pass with the rows still decoding (a row that has ended costs nothing).
                physical = max(weight bytes x passes / read bandwidth, its FLOPs / peak FLOP/s);
                kernel = those products timed on the model's own weight shapes with each pass's rows.
    update:     forward + backward (6 x params x tokens) over the rows an update must train (groups with
                differing rewards) and their real tokens: prompts once, completions without padding, the output
                layer on completion positions only. physical at the peak rate (a large square GEMM); kernel at the
                rate the model's own products reach with an update's tokens per micro-batch (median step).
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
    for key, phase in (("gen_kernel", "generate"), ("gen_physical", "generate"), ("update_kernel", "train"),
                       ("update_physical", "train")):
        pairs = [(s[f"{phase}_s"], f[key]) for s, f in zip(steps, floors) if f[key] > 0]
        result[key] = statistics.median(f for _, f in pairs) if pairs else None
        result[f"{key}_ratio"] = statistics.median(t / f for t, f in pairs) if pairs else None
    return result


def floor_rows(results: dict) -> tuple[list[list[str]], list[str]]:
    """The floor table: each GRPO config's generate and update times against the floors measured with it."""
    rows, params = [], None
    for (impl, _, precision), r in results.items():
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
    notes = [f"matmul params {params / 1e6:.1f}M; peak: a 2048 x 2048 GEMM in the config's dtype; read: a 512 MiB sum",
             "floors count the work any implementation must do for each step's batch: generation = prefill of each "
             "distinct prompt, then one pass per token up to the longest row with the rows still decoding; update = "
             "forward + backward of the rows in groups with differing rewards, real tokens only (prompts once, no "
             "padding), the output layer on completion positions only",
             "physical floor: generation max(weight bytes x passes / bandwidth, FLOPs / peak), update FLOPs / peak; "
             "kernel floor: the same products at the speed the model's own weight shapes reach with the phase's rows",
             "floors and ratios: medians over the timed steps, each step's time against its own batch's floors"]
    return rows, notes


FLOOR_COLUMNS = ["impl", "precision", "generate s", "gen kernel floor s", "gen / kernel", "gen physical floor s",
                 "gen / physical", "update s", "update kernel floor s", "update / kernel", "update physical floor s",
                 "update / physical", "peak GFLOP/s", "read GB/s"]


# ------------------------------------------------------------------------------ report


def markdown_table(headers: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(headers) + " |", "|" + "|".join("---" for _ in headers) + "|"]
    return "\n".join(lines + ["| " + " | ".join(row) + " |" for row in rows])


def fmt(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:.{digits}f}"


STEP_COLUMNS = ["impl", "algo", "precision", "generate s", "reward s", "logprob+backward s", "step s",
                "gen tok/s", "train tok/s", "completion len", "rows trained", "peak MB"]


def step_row(impl: str, algo: str, precision: str, r: dict) -> list[str]:
    return [impl, algo, precision, fmt(r["generate_s"]), fmt(r["reward_s"], 3), fmt(r["train_s"]), fmt(r["step_s"]),
            fmt(r["gen_tok_s"], 0), fmt(r["train_tok_s"], 0), fmt(r["completion_len"], 1), fmt(r["rows_trained"], 0),
            fmt(r["peak_mb"], 0)]


def bench_training(model: str, steps: int, warmup: int, precisions: list[str], with_trl: bool,
                   micro_batch: int = train.Args.micro_batch, adv_reps: int = 10_000,
                   rounds: int = 1) -> tuple[list[list[str]], list[str], dict]:
    """Sections 1-3: the step table rows, the summary lines (ours/TRL, AVSPO and AAPO vs GRPO) and the results.

    Every config runs once per round, configs compared with each other close in time (this machine's speed
    drifts by up to 2.5x over minutes); a ratio is the median of its per-round ratios, and the table shows
    each config's run with the median step time."""
    impls = ["ours", "TRL"] if with_trl else ["ours"]
    configs = [(impl, "grpo", p) for p in precisions for impl in impls]
    configs += [("ours", algo, precisions[0]) for algo in ("avspo", "aapo")]
    runs: dict[tuple, list[dict]] = {config: [] for config in configs}
    for round in range(rounds):
        for i, (impl, algo, precision) in enumerate(configs, 1):
            print(f"[round {round + 1}/{rounds}, {i}/{len(configs)}] {impl} {algo} {precision}: {warmup} warm-up + "
                  f"{steps} timed steps", flush=True)
            args = reference_args(model, steps, precision, algo, micro_batch)
            runs[impl, algo, precision].append(run_isolated(measure_config, impl, args, warmup))
    results = {config: sorted(r, key=lambda run: run["step_s"])[(len(r) - 1) // 2] for config, r in runs.items()}
    rows = [step_row(*config, results[config]) for config in configs]

    def ratio(a: tuple, b: tuple) -> tuple[float, str]:  # median over rounds of a's step time / b's, as text too
        per_round = [x["step_s"] / y["step_s"] for x, y in zip(runs[a], runs[b])]
        median = statistics.median(per_round)
        each = f" (rounds: {', '.join(f'{r:.2f}' for r in per_round)})" if rounds > 1 else ""
        return median, f"{median:.2f}x{each}"

    notes = ["rows trained: completions that went through log-prob + backward; train.update_policy skips "
             "zero-advantage rows (collapsed GRPO groups), TRL trains all of them"]
    for p in precisions:
        if with_trl:
            notes.append(f"ours / TRL step time, {p}: {ratio(('ours', 'grpo', p), ('TRL', 'grpo', p))[1]}")
    grpo = ("ours", "grpo", precisions[0])
    adv = {algo: advantage_seconds(reference_args(model, steps, precisions[0], algo), adv_reps) for algo in train.ALGOS}
    avspo_share = 100 * adv["avspo"] / results[grpo]["step_s"]
    notes.append("advantage step µs/call: " + ", ".join(f"{a} {s * 1e6:.0f}" for a, s in adv.items()) +
                 f"; AVSPO's is {avspo_share:.4f}% of a GRPO step (goal < {AVSPO_GOAL}%): "
                 f"{'met' if avspo_share < AVSPO_GOAL else 'NOT met'}")
    for algo in ("avspo", "aapo"):
        median, text = ratio(("ours", algo, precisions[0]), grpo)
        goal = f" (goal <= {AAPO_GOAL}x: {'met' if median <= AAPO_GOAL else 'NOT met'})" if algo == "aapo" else ""
        notes.append(f"{algo.upper()} / GRPO step time, {precisions[0]}: {text}{goal}")
    return rows, notes, results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias, folder or hub id")
    parser.add_argument("--steps", type=int, default=4, help="timed steps per config (median reported)")
    parser.add_argument("--warmup", type=int, default=1, help="untimed steps before them")
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="fp32",
                        help="bf16: train.py --precision bf16 (TRL: bf16=True); AVSPO/AAPO use the first")
    parser.add_argument("--micro-batch", type=int, default=train.Args.micro_batch,
                        help="completions per forward/backward, ours and TRL's")
    parser.add_argument("--rounds", type=int, default=1, help="run every config this many times, interleaved; "
                        "ratios are medians of the per-round ratios (this machine's speed drifts over minutes)")
    parser.add_argument("--skip-trl", action="store_true", help="leave out TRL's GRPOTrainer")
    parser.add_argument("--skip-verifier", action="store_true", help="leave out the verifier section")
    parser.add_argument("--data-dir", type=Path, default=DATA_DIR, help="shared data with GSM8K / MATH-500")
    parser.add_argument("--quick", action="store_true", help="tiny-qwen2, 2 steps, 1k advantage calls, "
                        "200 verifier cases per set: a smoke test in seconds")
    args = parser.parse_args(argv)
    if args.quick:
        args.model, args.steps = "tiny-qwen2", 2
    precisions = ["fp32", "bf16"] if args.precision == "both" else [args.precision]
    with_trl = not args.skip_trl and importlib.util.find_spec("trl") is not None
    if not args.skip_trl and not with_trl:
        print("trl not installed (pip install trl==1.16.0): TRL rows are left out")
    cuda = torch.cuda.is_available()
    device = f"CUDA {torch.cuda.get_device_name()}" if cuda else f"CPU, torch threads={torch.get_num_threads()}"
    start = time.perf_counter()
    print(f"CPU features: {' '.join(sorted(cpu_features())) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}")
    rows, notes, results = bench_training(args.model, args.steps, args.warmup, precisions, with_trl, args.micro_batch,
                                          adv_reps=1_000 if args.quick else 10_000, rounds=args.rounds)
    verifier = None if args.skip_verifier else verifier_rows(args.data_dir, limit=200 if args.quick else None)
    ref = reference_args(args.model, args.steps, "fp32")
    print(f"\n## Training step: {args.model}, {ref.dataset}, B={ref.prompts_per_step} x G={ref.group_size}, "
          f"{ref.max_new_tokens} new tokens, micro-batch {args.micro_batch}, {device}")
    rounds = f"; each config's run with the median step time of {args.rounds} rounds" if args.rounds > 1 else ""
    print(f"median of {args.steps} steps after {args.warmup} warm-up{rounds}; peak MB = "
          f"{'max CUDA allocated' if cuda else 'max RSS'} of the config's process\n")
    print(markdown_table(STEP_COLUMNS, rows))
    print("\n" + "\n".join(f"- {n}" for n in notes))
    floors, floor_notes = floor_rows(results)
    print(f"\n## Floors: each phase against what this machine allows (CPU features: "
          f"{' '.join(sorted(cpu_features())) or '-'})\n")
    print(markdown_table(FLOOR_COLUMNS, floors))
    print("\n" + "\n".join(f"- {n}" for n in floor_notes))
    if verifier:
        print("\n## Verifier, µs per call\n")
        print(markdown_table(["verifier", "set", "cases", "agree", "median µs", "worst µs"], verifier))
    print(f"\nbenchmarks/bench.py took {time.perf_counter() - start:.0f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

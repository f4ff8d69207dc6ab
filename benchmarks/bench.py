"""Speed and memory of one training step: ours vs TRL's GRPOTrainer, GRPO vs AVSPO vs AAPO, LoRA vs full
fine-tuning, and the verifier.

    python benchmarks/bench.py           # reference config: SmolLM2-135M, fp32, B=2 x G=8, 64 new tokens
    python benchmarks/bench.py --precision both  # also bf16 (TRL: bf16 autocast)
    python benchmarks/bench.py --quick   # tiny random Qwen2, 2 steps, 200 verifier cases per check: seconds
    python benchmarks/bench.py --rounds 3  # every config 3 times, interleaved: ratios robust to drift
    python benchmarks/bench.py --no-fast   # ours on model.py's plain definitions (HF generate, plain forward)
    python benchmarks/bench.py --skip-methods --lora-ranks 32 1 --rounds 3  # LoRA against full fine-tuning

Every training config runs in a fresh process, so its peak memory is its own: max RSS on CPU; on GPU,
the allocator's peak reservation plus the CUDA context (train.py's metrics: hardware.peak_memory_bytes).
Step times are medians over --steps steps after --warmup steps; the held-out evaluation and checkpoint that
train.train does around the steps are not timed.
TRL is optional (pip install trl==1.16.0); without it, or with --skip-trl, its rows are left out.

How each number is measured:
  1. ours: train.train on the config; generate / reward / train (log-probs + backward + optimizer
     step) are the per-step times it logs in metrics.jsonl.
  2. TRL (benchmarks/trl_grpo.py): GRPOTrainer on the same model, prompts, sampling and loss ("dapo",
     beta 0, one update per batch); a callback times each optimizer step, the reward function times
     itself, and _generate_and_score_completions is wrapped to time generation.
  3. AVSPO and AAPO: their own train.train runs. AVSPO's only extra work is its advantage step, timed
     directly (train.compute_advantages, many calls) against GRPO's step time; AAPO also samples a
     second group from the frozen reference model, so its whole step is compared with GRPO's.
  3b. LoRA (--lora-ranks, train.py --lora-rank): the update (train.update_policy: log-probs, backward,
     optimizer step) of full fine-tuning and of adapters of each rank on one fixed rollout of the config,
     every row trained, interleaved (`lora_update_seconds`): the same batch, so the ratio is the update's
     alone; and GRPO's own train.train runs with adapters, whose step (sampling included) is compared with
     full fine-tuning's, though their rollouts part after the first update.
  4. Verifier: verifier.verify (and math-verify, if installed) per call on the GSM8K and MATH-500 cases
     of benchmarks/verifier_bench.py (`python data/prepare.py math gsm8k-solutions` fetches them).
  5. Floors (benchmarks/floors.py): each GRPO phase against the work any implementation must do for its
     batch, timed at this machine's limits right after the config's steps.
"""

import argparse
import copy
import dataclasses
import importlib.util
import json
import statistics
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

import train  # noqa: E402
from benchmarks.floors import FLOOR_COLUMNS, batch_shape, floor_rows, phase_floors  # noqa: E402
from benchmarks.timing import fmt, markdown_table, median_of, run_isolated  # noqa: E402
from data.prepare import DOWNLOADS  # noqa: E402
from data.tasks import load_problems  # noqa: E402
from infra.flags import FlagParser, at_least  # noqa: E402
from infra.hardware import cpu_features, working_copy  # noqa: E402
from infra.lora import add_adapters  # noqa: E402
from infra.written import owned  # noqa: E402
from loop import run  # noqa: E402
from model import load_model, sample  # noqa: E402
from verifier import verify  # noqa: E402

AVSPO_GOAL, AAPO_GOAL = 0.1, 1.6  # AVSPO advantage step < 0.1% of a GRPO step; AAPO step <= 1.6x GRPO's


def reference_args(model: str, steps: int, precision: str, algo: str = "grpo",
                   micro_batch: int = train.Args.micro_batch, fast: bool = True, lora_rank: int = 0
                   ) -> train.Args:
    """The reference config: G=8, 2 prompts, 64 new tokens, lr 1e-5 constant (as TRL's), beta 0, one update,
    no eval, no saving; full fine-tuning, or LoRA adapters of rank `lora_rank`."""
    return train.Args(algo=algo, model=model, dataset="arith-mul1", steps=steps, prompts_per_step=2,
                      group_size=8, max_new_tokens=64, temperature=1.0, lr=1e-5, lr_decay=0.0, beta=0.0,
                      updates_per_batch=1, micro_batch=micro_batch, precision=precision, eval_every=0,
                      eval_size=1, save_every=0, fast=fast, lora_rank=lora_rank)


# ------------------------------------------------------------------------------ one config per process


def bench_ours(args: train.Args, warmup: int) -> dict:
    """train.train for warmup + steps steps; medians of the per-step times it logs, after the warm-up. For
    GRPO, each step's batch shape (`floors.batch_shape`) is recorded from the rollout train.py samples and the
    rewards it scores (run.sample and run.score_groups wrapped for the call)."""
    args = dataclasses.replace(args, steps=warmup + args.steps)
    shapes, rollouts, sample, score_groups = [], [], run.sample, run.score_groups

    def recording_sample(*a, **kw):
        rollouts.append(sample(*a, **kw))
        return rollouts[-1]

    def recording_score_groups(questions, texts, answers, reward_fn):  # right after each run.sample call
        rewards, rollout = score_groups(questions, texts, answers, reward_fn), rollouts.pop()
        prompt_len = rollout.input_ids.shape[1] - rollout.completion_len
        shapes.append(batch_shape(rollout.completion_mask.sum(1).tolist(),
                                  rollout.attention_mask[:: args.group_size, :prompt_len].sum(1).tolist(),
                                  [r for group in rewards for r in group], args.group_size))
        return rewards

    if args.algo == "grpo":  # the only config with floors
        run.sample, run.score_groups = recording_sample, recording_score_groups
    try:
        with tempfile.TemporaryDirectory() as tmp, owned(Path(tmp), "runs") as out:
            run_dir = Path(tmp) / args.algo
            train.train(args, out.subfolder(args.algo, "run"))
            logged = (run_dir / "metrics.jsonl").read_text().splitlines()
            rows = [json.loads(line) for line in logged][warmup:]
    finally:
        run.sample, run.score_groups = sample, score_groups
    for r in rows:
        r["time_step"] = r["time_generate"] + r["time_score"] + r["time_train"]
    return {"generate_s": median_of(rows, "time_generate"), "reward_s": median_of(rows, "time_score"),
            "train_s": median_of(rows, "time_train"), "step_s": median_of(rows, "time_step"),
            "gen_tok_s": median_of(rows, "gen_tokens_per_s"),
            "train_tok_s": median_of(rows, "train_tokens_per_s"),
            "completion_len": median_of(rows, "completion_len"),
            "peak_mb": rows[-1]["peak_memory_bytes"] / 2**20,  # train.py's, hardware.peak_memory_bytes
            "rows_trained": median_of(rows, "rows_trained") if "rows_trained" in rows[0] else None,
            "per_step": [{"generate_s": r["time_generate"], "train_s": r["time_train"], **shape}
                         for r, shape in zip(rows, shapes[warmup:])]}


def measure_config(impl: str, args: train.Args, warmup: int) -> dict:
    """One config's step times (ours or TRL's) and, for GRPO without LoRA, its floors measured right after
    them."""
    if impl == "ours":
        result = bench_ours(args, warmup)
    else:
        from benchmarks.trl_grpo import bench_trl  # TRL is optional
        result = bench_trl(args, warmup)
    if args.algo == "grpo" and not args.lora_rank:
        result["floors"] = phase_floors(result, args)
    return result


def lora_update_seconds(args: train.Args, ranks: tuple[int, ...], reps: int) -> dict[int, list[float]]:
    """{rank: seconds of each of `reps` train.update_policy calls}, rank 0 full fine-tuning, on one rollout of
    the config's first prompts with advantages +-1 (every row trained), the ranks interleaved: the same
    batch for each. LoRA's adapters sit on copies of the loaded model, as run.start_run puts them."""
    master, tokenizer = load_model(args.model, torch.device("cpu"))
    problems = load_problems(args.dataset, "train", args.seed)[: args.prompts_per_step]
    torch.manual_seed(0)
    paths = run.fast_or_plain(args.fast, master.device)
    rollout = sample(master, tokenizer, [p.question for p in problems], args.group_size, args.max_new_tokens,
                     args.temperature, sample_completions=paths.sample_completions,
                     instructions=[p.instruction for p in problems])
    advantages = torch.tensor([1.0, -1.0]).repeat(len(rollout.texts) // 2)
    nets = {0: master}
    for rank in ranks:
        nets[rank] = copy.deepcopy(master)
        add_adapters(nets[rank], rank, train.Args.lora_alpha, args.model, args.seed)
    steps = {}
    for rank, net in nets.items():
        policy = working_copy(net, args.precision)
        trained = [p for p in net.parameters() if p.requires_grad]  # LoRA: the adapters alone
        optimizer = torch.optim.AdamW(trained, lr=args.lr, weight_decay=0.0, fused=True)
        steps[rank] = partial(train.update_policy, net, policy, optimizer, rollout, advantages, None, args)
    times = {rank: [] for rank in nets}
    for _ in range(reps):
        for rank, step in steps.items():
            times[rank].append(step()["time_train"])
    return times


# ------------------------------------------------------------------------------ AVSPO's extra work


def advantage_seconds(args: train.Args, reps: int) -> float:
    """Seconds per train.compute_advantages call on realistic [B, G] 0/1 rewards, worst of two batches:
    mixed groups (AVSPO does GRPO's work) and all groups collapsed (it adds virtual samples)."""
    shape = (args.prompts_per_step, args.group_size)
    mixed = (torch.arange(shape[0] * shape[1]).view(shape) % 3 == 0).float()  # every group has both rewards
    batches = {"mixed": mixed, "collapsed": torch.ones(shape).index_fill_(0, torch.tensor([0]), 0.0)}
    ref_rewards = torch.zeros(shape) if args.algo == "aapo" else None  # AAPO's reference samples: in its run

    worst = 0.0
    for rewards in batches.values():
        state = train.algo_state(args)
        train.compute_advantages(args, rewards, state, ref_rewards)  # warm-up
        start = time.perf_counter()
        for _ in range(reps):
            train.compute_advantages(args, rewards, state, ref_rewards)
        worst = max(worst, (time.perf_counter() - start) / reps)
    return worst


# ------------------------------------------------------------------------------ verifier


def verifier_rows(data_dir: Path, limit: int | None) -> list[list[str]] | None:
    """Median and worst µs per call of each verifier on GSM8K and MATH-500 (self + cross) cases;
    None, with a message, when the data folder lacks them."""
    from benchmarks.verifier_bench import load_cases, math_verify_check, run as run_checks

    if not (data_dir / "math500_test.jsonl").exists():
        print(f"no math500_test.jsonl in {data_dir} (python data/prepare.py math gsm8k-solutions): "
              "verifier section skipped")
        return None
    cases = load_cases(data_dir)
    half = None if limit is None else limit // 2  # MATH-500: as many should-accept as should-reject cases
    sets = {"GSM8K": cases["gsm8k"][:limit],
            "MATH-500": cases["math_self"][:half] + cases["math_cross"][:half]}
    checks = {"verifier.verify": verify, "math-verify": math_verify_check()}
    rows = []
    for name, check in checks.items():
        if check is None:
            print("math-verify not installed (pip install math-verify): its rows are left out")
            continue
        for label, subset in sets.items():
            print(f"verifier: {name} on {len(subset)} {label} cases")
            agree, seconds = run_checks(check, subset)
            us = [s * 1e6 for s in seconds]
            rows.append([name, label, str(len(us)), f"{100 * agree / len(us):.1f}%",
                         f"{statistics.median(us):.1f}", f"{max(us):.1f}"])
    return rows


# ------------------------------------------------------------------------------ report


STEP_COLUMNS = ["impl", "algo", "precision", "generate s", "reward s", "logprob+backward s", "step s",
                "gen tok/s", "train tok/s", "completion len", "rows trained", "peak MB"]


def step_row(impl: str, algo: str, precision: str, lora_rank: int, r: dict) -> list[str]:
    algo = f"{algo}, LoRA r{lora_rank}" if lora_rank else algo
    return [impl, algo, precision, fmt(r["generate_s"]), fmt(r["reward_s"], 3), fmt(r["train_s"]),
            fmt(r["step_s"]), fmt(r["gen_tok_s"], 0), fmt(r["train_tok_s"], 0), fmt(r["completion_len"], 1),
            fmt(r["rows_trained"], 0), fmt(r["peak_mb"], 0)]


def bench_training(model: str, steps: int, warmup: int, precisions: list[str], with_trl: bool,
                   micro_batch: int = train.Args.micro_batch, adv_reps: int = 10_000, rounds: int = 1,
                   fast: bool = True, methods: bool = True, lora_ranks: tuple[int, ...] = (32,)
                   ) -> tuple[list[list[str]], list[str], dict]:
    """Sections 1-3: the step table rows, the summary lines (ours/TRL, AVSPO and AAPO vs GRPO (`methods`),
    LoRA of each rank in `lora_ranks` vs full fine-tuning), the results; a config is (impl, algo, precision,
    LoRA rank, 0 for full fine-tuning).

    Every config runs once per round, configs compared with each other close in time (this machine's speed
    drifts by up to 2.5x over minutes); a ratio is the median of its per-round ratios, and the table shows
    each config's run with the median step time."""
    impls = ["ours", "TRL"] if with_trl else ["ours"]
    configs = [(impl, "grpo", p, 0) for p in precisions for impl in impls]
    configs += [("ours", algo, precisions[0], 0) for algo in ("avspo", "aapo") if methods]
    configs += [("ours", "grpo", precisions[0], rank) for rank in lora_ranks]
    runs: dict[tuple, list[dict]] = {config: [] for config in configs}
    for round in range(rounds):
        for i, (impl, algo, precision, rank) in enumerate(configs, 1):
            print(f"[round {round + 1}/{rounds}, {i}/{len(configs)}] {impl} {algo} {precision}"
                  f"{f' LoRA r{rank}' if rank else ''}: {warmup} warm-up + {steps} timed steps", flush=True)
            args = reference_args(model, steps, precision, algo, micro_batch, fast, rank)
            runs[impl, algo, precision, rank].append(run_isolated(measure_config, impl, args, warmup))
    results = {config: sorted(r, key=lambda run: run["step_s"])[(len(r) - 1) // 2]
               for config, r in runs.items()}
    rows = [step_row(*config, results[config]) for config in configs]

    def ratio(a: tuple, b: tuple) -> tuple[float, str]:  # median over rounds of a's step time / b's, and text
        per_round = [x["step_s"] / y["step_s"] for x, y in zip(runs[a], runs[b])]
        median = statistics.median(per_round)
        each = f" (rounds: {', '.join(f'{r:.2f}' for r in per_round)})" if rounds > 1 else ""
        return median, f"{median:.2f}x{each}"

    notes = ["rows trained: completions that went through log-prob + backward; train.update_policy skips "
             "zero-advantage rows (collapsed GRPO groups), TRL trains all of them"]
    for p in precisions:
        if with_trl:
            text = ratio(("ours", "grpo", p, 0), ("TRL", "grpo", p, 0))[1]
            notes.append(f"ours / TRL step time, {p}: {text}")
    grpo = ("ours", "grpo", precisions[0], 0)
    if methods:
        adv = {algo: advantage_seconds(reference_args(model, steps, precisions[0], algo), adv_reps)
               for algo in train.ALGOS}
        avspo_share = 100 * adv["avspo"] / results[grpo]["step_s"]
        notes.append("advantage step µs/call: " + ", ".join(f"{a} {s * 1e6:.0f}" for a, s in adv.items()) +
                     f"; AVSPO's is {avspo_share:.4f}% of a GRPO step (goal < {AVSPO_GOAL}%): "
                     f"{'met' if avspo_share < AVSPO_GOAL else 'NOT met'}")
    for algo in ("avspo", "aapo") if methods else ():
        median, text = ratio(("ours", algo, precisions[0], 0), grpo)
        met = "met" if median <= AAPO_GOAL else "NOT met"
        goal = f" (goal <= {AAPO_GOAL}x: {met})" if algo == "aapo" else ""
        notes.append(f"{algo.upper()} / GRPO step time, {precisions[0]}: {text}{goal}")
    if lora_ranks:
        args = reference_args(model, steps, precisions[0], micro_batch=micro_batch, fast=fast)
        updates = run_isolated(lora_update_seconds, args, lora_ranks, max(3, rounds))
    for rank in lora_ranks:
        per_rep = [lora / full for lora, full in zip(updates[rank], updates[0])]
        seconds = f"{statistics.median(updates[rank]):.2f} s against {statistics.median(updates[0]):.2f} s"
        step = ratio(("ours", "grpo", precisions[0], rank), grpo)[1]
        notes.append(f"LoRA r{rank} / full fine-tuning, {precisions[0]}: update time on one rollout of "
                     f"{args.prompts_per_step * args.group_size} rows, every one trained, "
                     f"{statistics.median(per_rep):.2f}x (reps: {', '.join(f'{r:.2f}' for r in per_rep)}; "
                     f"{seconds}); train.py's step time {step}")
    return rows, notes, results


def main(argv: list[str] | None = None) -> int:
    parser = FlagParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2-135m", help="model alias, folder or hub id")
    parser.add_argument("--steps", type=at_least(1), default=4,
                        help="timed steps per config (median reported)")
    parser.add_argument("--warmup", type=at_least(0), default=1, help="untimed steps before them")
    parser.add_argument("--precision", choices=("fp32", "bf16", "both"), default="fp32",
                        help="bf16: train.py --precision bf16 (TRL: bf16=True); AVSPO/AAPO use the first")
    parser.add_argument("--micro-batch", type=at_least(1), default=train.Args.micro_batch,
                        help="completions per forward/backward, ours and TRL's")
    parser.add_argument("--rounds", type=at_least(1), default=1, help="run every config this many times, "
                        "interleaved; ratios are medians of the per-round ratios (machine speed drifts)")
    parser.add_argument("--fast", action=argparse.BooleanOptionalAction, default=True,
                        help="ours on the fast paths (train.py --fast); --no-fast: the plain definitions")
    parser.add_argument("--skip-trl", action="store_true", help="leave out TRL's GRPOTrainer")
    parser.add_argument("--skip-methods", action="store_true", help="leave out AVSPO and AAPO")
    parser.add_argument("--lora-ranks", type=at_least(1), nargs="*", default=[32],
                        help="GRPO with LoRA adapters of each rank against full fine-tuning (none: no LoRA)")
    parser.add_argument("--skip-verifier", action="store_true", help="leave out the verifier section")
    parser.add_argument("--data-dir", type=Path, default=DOWNLOADS,
                        help="GSM8K's model solutions and MATH-500, as data/prepare.py writes them")
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
    device = (f"CUDA {torch.cuda.get_device_name()}" if cuda
              else f"CPU, torch threads={torch.get_num_threads()}")
    start = time.perf_counter()
    print(f"CPU features: {' '.join(sorted(cpu_features())) or 'none of avx2/avx512f/avx512_bf16/amx_bf16'}")
    rows, notes, results = bench_training(args.model, args.steps, args.warmup, precisions, with_trl,
                                          args.micro_batch, adv_reps=1_000 if args.quick else 10_000,
                                          rounds=args.rounds, fast=args.fast, methods=not args.skip_methods,
                                          lora_ranks=tuple(args.lora_ranks))
    verifier = None if args.skip_verifier else verifier_rows(args.data_dir, limit=200 if args.quick else None)
    ref = reference_args(args.model, args.steps, "fp32")
    print(f"\n## Training step: {args.model}, {ref.dataset}, B={ref.prompts_per_step} x G={ref.group_size}, "
          f"{ref.max_new_tokens} new tokens, micro-batch {args.micro_batch}, {device}"
          f"{'' if args.fast else ', ours on the plain paths (--no-fast)'}")
    rounds = (f"; each config's run with the median step time of {args.rounds} rounds" if args.rounds > 1
              else "")
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

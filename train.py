"""GRPO, AVSPO, AAPO and DAPO's dynamic sampling side by side, on one device or under torchrun.

    python train.py                                    # GRPO on arith-mul1 with the embedded SmolLM2-135M
    python train.py --algo grpo,avspo,aapo,dapo        # all four on the same prompts and seed, one plot
    torchrun --standalone --nproc_per_node 2 train.py  # the same run, its batch split over 2 processes

Read top to bottom, in the order a step runs: config, sample and score, ALGO LOGIC (the one place the
methods differ), the loss and the update, then the loop. Plumbing lives in common.py.

Choices, each made once here:
  1. Token-level loss ("dapo" in TRL): the batch's per-token losses summed, divided by its completion token
     count, so every token weighs the same (a per-sequence mean favours short wrong answers).
  2. One update per batch by default: the PPO ratio is exactly 1, the loss value is -mean(A) per token (~0)
     and its gradient is REINFORCE's, -A grad log pi; so we log advantage stats and the grad norm.
  3. Under torchrun each process samples its share of the B prompts; rewards are gathered (ACR and every
     logged number are the whole batch's), the loss is divided by the whole batch's token count, and
     gradients are summed once per update (processes skip different numbers of zero-advantage rows).
  4. The learning rate decays linearly to 0 over the run (TRL's and nanochat's chat_rl default; --lr-decay). At a
     constant lr the default run's policy often collapsed to terse answers ("6 * 7 is 36") and lost accuracy late;
     decaying, it kept writing its working for longer. Default run, 6 seeds, held-out accuracy at step 40: constant
     0.83, decay over the last half 0.87, over the whole run 0.94 (README, "What the default run shows").
"""

import dataclasses
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from functools import partial
from pathlib import Path
from typing import Sequence

import torch
from tqdm import tqdm

from advantage import (AdaptiveThreshold, aapo_advantages, aapo_margin, avspo_advantages, collapsed_groups,
                       grpo_advantages)
from common import (all_sum, append_jsonl, arg, at_least, close_processes, ctrl_c_stops_after_the_step,
                    dataclass_parser, find_checkpoint, fraction, gather_groups, init_processes, restore_checkpoint,
                    save_checkpoint, start_logs, step_metrics, sum_gradients, summarise_run, write_jsonl)
from data.tasks import Problem, load_eval_problems, load_problems
from eval import evaluate, score_groups
from model import (Rollout, accumulate_gradients, completion_logprobs, copy_weights, load_model, real_tokens,
                   replace_groups, sample, trim_padding, working_copy)
from verifier import load_reward

ALGOS = ("grpo", "avspo", "aapo", "dapo")


@dataclass
class Args:
    # run
    algo: str = arg("grpo", "grpo, avspo, aapo, dapo (GRPO + dynamic sampling), or a comma list: same prompts")
    model: str = arg("smollm2-135m", "alias (smollm2-135m, tiny-qwen2), hub id, local folder or .gguf file")
    dataset: str = arg("arith-mul1", "arith-<level> (add1 mul1 add2 mul2 mul3), arith-mix, or a GSM8K/MATH .jsonl")
    eval_dataset: str = arg("", "held-out problems (default: the test split of --dataset)")
    reward: str = arg("verifier", "verifier (verifier.py), math-verify (optional package), or module:function")
    out: str = arg("runs/default", "run folder: one subfolder per algorithm, plus curves.png")
    seed: int = arg(0, "seeds the prompts of each step and the sampling")
    resume: bool = arg(False, "continue each algorithm from the checkpoint in its run folder")
    # sampling
    steps: int = arg(40, "optimizer steps (one batch of groups each)", type=at_least(1))
    prompts_per_step: int = arg(2, "prompts per step (B), over all processes", type=at_least(1))
    group_size: int = arg(8, "completions per prompt (G)", type=at_least(2))
    max_new_tokens: int = arg(64, "completion length limit; longer completions are truncated", type=at_least(1))
    temperature: float = arg(1.0, "sampling temperature, also applied to the log-probs")
    top_p: float = arg(1.0, "nucleus sampling")
    # optimisation
    lr: float = arg(2e-5, "AdamW learning rate (at the first step)")
    lr_decay: float = arg(1.0, "the last fraction of --steps over which the lr decays linearly to 0 (0: constant)",
                          type=fraction)
    beta: float = arg(0.0, "k3 KL penalty to the reference model (0: no reference forward)")
    epsilon: float = arg(0.2, "PPO clip: ratio lower bound 1 - epsilon")
    epsilon_high: float = arg(0.2, "PPO clip: ratio upper bound 1 + epsilon_high (DAPO uses 0.28)")
    updates_per_batch: int = arg(1, "optimizer steps per batch (PPO epochs); >1 makes the clip act", type=at_least(1))
    micro_batch: int = arg(8, "completions per forward/backward pass (gradient accumulation)", type=at_least(1))
    max_grad_norm: float = arg(1.0, "gradient clipping")
    grad_checkpointing: bool = arg(False, "recompute activations in backward: less memory, ~30% slower")
    precision: str = arg("auto", "auto (bf16 on CUDA and on CPUs with native bf16: avx512_bf16/amx_bf16), fp32, bf16",
                         choices=("auto", "fp32", "bf16"))
    # AVSPO (He et al., 2026) and AAPO (Xiong et al., 2025)
    acr_threshold: float = arg(0.5, "AVSPO: initial ACR threshold")
    fixed_threshold: bool = arg(False, "AVSPO: keep the threshold fixed instead of adapting it")
    alpha: float = arg(0.5, "AVSPO: K = ceil(G * ACR^alpha) virtual samples")
    num_virtual: int = arg(0, "AVSPO: fixed K virtual samples per collapsed group (0: adaptive)")
    delta_low: float = arg(0.2, "AAPO: margin clip below")
    delta_high: float = arg(0.28, "AAPO: margin clip above")
    resample_rounds: int = arg(2, "DAPO: most rounds of new prompts for collapsed groups", type=at_least(0))
    # evaluation and logging
    eval_every: int = arg(10, "greedy held-out accuracy every N steps (0: only before and after)")
    eval_size: int = arg(64, "held-out problems per evaluation")
    save_every: int = arg(10, "checkpoint every N steps, at the end and on Ctrl-C (0: never)")


def parse_args(argv: list[str] | None = None) -> Args:
    """One flag per Args field; bad values stop here, before any model loads."""
    parser = dataclass_parser(Args, __doc__.split("\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    if unknown := set(args.algo.split(",")) - set(ALGOS):
        parser.error(f"--algo: unknown algorithm(s) {', '.join(sorted(unknown))}; choose from {', '.join(ALGOS)}")
    if args.prompts_per_step % int(os.environ.get("WORLD_SIZE", 1)):
        parser.error(f"--prompts-per-step {args.prompts_per_step} must be a multiple of the number of processes")
    try:  # read the data and the reward before any model: a bad line fails in a second, naming file and line
        load_reward(args.reward)
        load_problems(args.dataset, "train", args.seed)
        if args.eval_dataset:
            load_eval_problems(args.eval_dataset, args.seed)
    except (FileNotFoundError, ValueError, ImportError) as e:
        parser.error(str(e))
    return args


# ------------------------------------------------------------------------------ sample and score


def step_problems(problems: list[Problem], args: Args, step: int, round: int = 0) -> list[Problem]:
    """The B prompts of a step (or resampling round): every algorithm, process and resumed run draws the same."""
    seed = args.seed * 1_000_003 + step + round * 1_000_000_007
    return random.Random(seed).sample(problems, min(args.prompts_per_step, len(problems)))


def generate_and_score(net, problems: list[Problem], tokenizer, args: Args, reward_fn, timer: dict):
    """G completions for each of this process's b prompts, and their rewards [b, G]."""
    start = time.perf_counter()
    rollout = sample(net, tokenizer, [p.question for p in problems], args.group_size, args.max_new_tokens,
                     args.temperature, args.top_p)
    timer["generate"] += time.perf_counter() - start
    timer["gen_tokens"] += rollout.completion_mask.sum().item()
    start = time.perf_counter()
    rewards = torch.tensor(score_groups(rollout.texts, [p.answer for p in problems], reward_fn))  # [b, G]
    timer["score"] += time.perf_counter() - start
    return rollout, rewards


# ------------------------------------------------------------------------------ ALGO LOGIC: methods differ only here
# A method = what it samples, the state it carries across steps (checkpointed), how it turns rewards into
# advantages. To add one: an estimator in advantage.py, its name in ALGOS, a branch in the functions below.


def sample_batch(args: Args, rollout_and_score, draw_problems, mine: slice, pad_token_id: int):
    """This process's rollout, the batch's rewards [B, G], how many groups were sampled again. DAPO's dynamic sampling
    (Yu et al. 2025, arXiv 2503.14476) gives each collapsed group a new prompt, up to --resample-rounds times."""
    rollout, local = rollout_and_score(draw_problems(0)[mine])  # [b, G]
    rewards, resampled = gather_groups(local), 0  # [B, G]
    for round in range(1, (args.resample_rounds if args.algo == "dapo" else 0) + 1):
        collapsed = collapsed_groups(rewards)  # [B], the same on every process
        if not collapsed.any():
            break
        redo = collapsed[mine].nonzero().flatten().tolist()  # this process's collapsed groups
        if redo:
            fresh = draw_problems(round)[mine]
            new, local[redo] = rollout_and_score([fresh[g] for g in redo])
            rollout = replace_groups(rollout, redo, new, args.group_size, pad_token_id)
        rewards, resampled = gather_groups(local), resampled + int(collapsed.sum())
    return rollout, rewards, resampled


def algo_state(args: Args) -> dict:
    """What a method carries from step to step: AVSPO's adaptive threshold (with the previous reward)."""
    if args.algo == "avspo":
        return {"threshold": AdaptiveThreshold(value=args.acr_threshold, low=min(0.1, args.acr_threshold),
                                               high=max(0.9, args.acr_threshold))}
    return {}


def compute_advantages(args: Args, rewards: torch.Tensor, state: dict, sample_reference) -> tuple[torch.Tensor, dict]:
    """Advantages [B, G] from rewards [B, G], and what to log about them. `sample_reference()` samples and
    scores G completions per prompt from the frozen reference model: only a method that calls it pays for it."""
    if args.algo in ("grpo", "dapo"):
        return grpo_advantages(rewards), {}
    if args.algo == "avspo":
        threshold = state["threshold"]
        advantages, info = avspo_advantages(rewards, acr_threshold=threshold.value, alpha=args.alpha,
                                            num_virtual=args.num_virtual or None, return_info=True)
        log = {"acr_threshold": threshold.value, "avspo_triggered": info.triggered,
               "virtual_samples": info.num_virtual * info.num_collapsed}
        if not args.fixed_threshold:
            threshold.update(info.num_collapsed / len(rewards), rewards.mean().item())  # takes effect next step
        return advantages, log
    if args.algo == "aapo":
        ref_rewards = gather_groups(sample_reference()[1])  # [B, G]
        deltas = dict(delta_low=args.delta_low, delta_high=args.delta_high)
        margin = aapo_margin(rewards, ref_rewards, **deltas)  # [B, G]
        return aapo_advantages(rewards, ref_rewards, **deltas), {"ref_reward_mean": ref_rewards.mean().item(),
                                                                 "margin_mean": margin.mean().item()}
    raise ValueError(f"unknown algorithm {args.algo!r}")


# ------------------------------------------------------------------------------ the loss and the update


def policy_loss(logp, old_logp, ref_logp, advantages, mask, *, clip_low: float, clip_high: float, beta: float,
                num_tokens: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """PPO-clipped surrogate (Schulman et al. 2017, Eq. 7) + beta * k3 KL, summed over tokens / num_tokens."""
    ratio = torch.exp(logp - old_logp)  # [n, C], exactly 1 on the first update of a batch
    clipped = ratio.clamp(1 - clip_low, 1 + clip_high)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # [n, C]
    kl = None
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 estimator (Schulman, 2020), >= 0
        per_token = per_token + beta * kl
    loss = (per_token * mask).sum() / num_tokens  # token-level normalisation (choice 1)
    return loss, (None if kl is None else (kl * mask).sum().detach() / num_tokens)


def scheduled_lr(args: Args, step: int) -> float:
    """The lr of step 1..steps (choice 4): args.lr, falling linearly to 0 over the last `lr_decay` of the run, to
    args.lr / steps at the last step when lr_decay is 1 (TRL's linear schedule). From the step alone: --resume
    continues the schedule."""
    if args.lr_decay == 0:
        return args.lr
    return args.lr * min(1.0, (1 - (step - 1) / args.steps) / args.lr_decay)


def update_policy(model, net, optimizer, rollout: Rollout, b_advantages, ref_model, args: Args) -> dict:
    """`updates_per_batch` optimizer steps on this process's rows, in micro-batches; returns what to log.
    Forward and backward run on `net`, the working copy that samples (`model.working_copy`: `model` itself in fp32,
    its bf16 copy in bf16); the optimizer steps `model`'s float32 weights, then `net` takes them.
    Rows with advantage 0 (a collapsed GRPO group) add nothing to the gradient when beta = 0: their forward
    and backward are skipped. A non-finite gradient skips the step, leaving weights and optimizer unchanged.
    A micro-batch holds one prompt's rows where it can: it runs as one packed token stream (`model.pack_rows`) in
    which each distinct prompt costs its tokens once."""
    device = b_advantages.device
    num_tokens, = all_sum([rollout.completion_mask.sum().item()], device)  # every row of every process counts
    rows = torch.arange(len(b_advantages)) if args.beta > 0 else b_advantages.nonzero().flatten().cpu()
    rows = rows[rollout.completion_mask[rows].sum(1).argsort(stable=True)]  # shortest first: similar lengths pad less
    rows = rows[(rows // args.group_size).argsort(stable=True)]  # then by prompt, by length within each
    micro = [(idx, *trim_padding(rollout.input_ids[idx], rollout.attention_mask[idx], rollout.completion_mask[idx]))
             for idx in rows.split(args.micro_batch) if len(idx)]
    loss_args = dict(clip_low=args.epsilon, clip_high=args.epsilon_high, beta=args.beta, num_tokens=num_tokens)

    def logprobs(network, ids, attn, mask):
        return completion_logprobs(network, ids, attn, mask.shape[1], args.temperature)

    with torch.no_grad():  # log-probs that stay fixed during the updates: old policy (PPO epochs) and reference
        old_logp = [logprobs(net, *m[1:]) if args.updates_per_batch > 1 else None for m in micro]
        ref_logp = [logprobs(ref_model, *m[1:]) if args.beta > 0 else None for m in micro]
    net.train()
    skipped = 0
    for _ in range(args.updates_per_batch):
        loss_sum, kl_sum = 0.0, 0.0
        for (idx, ids, attn, mask), old, ref in zip(micro, old_logp, ref_logp):
            logp = logprobs(net, ids, attn, mask)  # [n, C] with grad
            loss, kl = policy_loss(logp, logp.detach() if old is None else old, ref, b_advantages[idx], mask,
                                   **loss_args)
            loss.backward()
            accumulate_gradients(net, into=model)  # bf16: into the float32 gradients, micro-batch by micro-batch
            loss_sum += loss.item()
            kl_sum += 0.0 if kl is None else kl.item()
        sum_gradients(model)  # over processes; each one's loss is already divided by the global token count
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        if math.isfinite(grad_norm):
            optimizer.step()
            copy_weights(model, into=net)  # bf16: the working copy follows the step (nothing to do in fp32)
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    net.eval()
    tokens = sum(real_tokens(ids, attn, mask.shape[1]) for _, ids, attn, mask in micro)  # prompts once, no padding
    loss_sum, kl_sum, rows_trained, train_tokens = all_sum([loss_sum, kl_sum, len(rows), tokens], device)
    return {"loss": loss_sum, "kl": kl_sum if args.beta > 0 else None, "grad_norm": grad_norm, "skipped": skipped,
            "rows_trained": int(rows_trained), "train_tokens": int(train_tokens)}


# ------------------------------------------------------------------------------ the loop


def train(args: Args, run_dir: Path, stop_requested: Sequence = ()) -> dict | None:
    """Train one algorithm; process 0 writes config.json, metrics.jsonl, evals.jsonl, checkpoint/, summary.json.
    Once `stop_requested` is non-empty (Ctrl-C, see main), no new step starts: KeyboardInterrupt after saving."""
    rank, world, device = init_processes()
    is_main = rank == 0
    checkpoint = find_checkpoint(run_dir) if args.resume else None
    if args.resume and not checkpoint and is_main:
        print(f"[{args.algo}] --resume: no checkpoint in {run_dir}, starting from scratch")
    model, tokenizer = load_model(str(checkpoint / "model") if checkpoint else args.model, device)
    # auto: bf16 on CUDA and on CPUs with native bf16, then a bf16 copy samples and trains (float32 master weights)
    net = working_copy(model, args.precision)
    ref_model = None  # the frozen initial policy, for AAPO's r_ref and the KL, in the working copy's dtype
    if args.algo == "aapo" or args.beta > 0:
        ref_model = load_model(args.model, device)[0].requires_grad_(False).to(net.dtype)
    if args.grad_checkpointing:
        net.activation_checkpointing_enable()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0, fused=True)  # 3x faster on CPU
    reward_fn = load_reward(args.reward)
    state = algo_state(args)
    done = restore_checkpoint(checkpoint, optimizer, state) if checkpoint else 0  # the last completed step
    train_problems = load_problems(args.dataset, "train", args.seed)
    eval_problems = (load_eval_problems(args.eval_dataset, args.seed) if args.eval_dataset
                     else load_problems(args.dataset, "test", args.seed))[: args.eval_size]

    def run_eval(step: int) -> float:
        result = evaluate(net, tokenizer, eval_problems, max_new_tokens=args.max_new_tokens, reward_fn=reward_fn)
        append_jsonl(run_dir / "evals.jsonl", {"step": step, "eval_accuracy": result["accuracy"],
                                               "eval_accuracy_by_level": result["accuracy_by_level"]})
        write_jsonl(run_dir / "eval_records.jsonl", result["records"])  # the latest evaluation, problem by problem
        return result["accuracy"]

    if is_main:
        last = start_logs(run_dir, dataclasses.asdict(args), done)
        totals = {key: last.get(f"{key}_total", 0) for key in ("gen_tokens", "train_tokens")}
        if not checkpoint and not stop_requested:
            print(f"[{args.algo}] held-out accuracy before training: {run_eval(0):.3f} ({len(eval_problems)} problems)")
    mine = slice(rank * args.prompts_per_step // world, (rank + 1) * args.prompts_per_step // world)  # my prompts
    if all_sum([len(stop_requested)], device)[0] > 0:  # Ctrl-C while loading: stop before the first step
        raise KeyboardInterrupt
    stop = False
    bar = tqdm(range(done + 1, args.steps + 1), desc=args.algo, initial=done, total=args.steps, disable=not is_main)
    for step in bar:
        torch.manual_seed(args.seed * 1_000_003 + step * 1_000 + rank)  # samples depend on (seed, step, rank) only
        draw_problems = partial(step_problems, train_problems, args, step)  # round -> the B prompts to sample
        timer = {"generate": 0.0, "score": 0.0, "gen_tokens": 0}
        rollout_and_score = partial(generate_and_score, tokenizer=tokenizer, args=args, reward_fn=reward_fn,
                                    timer=timer)
        # ---- sample G completions for each prompt and score them: rewards [B, G] of the whole batch
        rollout, rewards, resampled = sample_batch(args, partial(rollout_and_score, net), draw_problems, mine,
                                                   tokenizer.pad_token_id)
        # ---- advantages [B, G]: ALGO LOGIC (AAPO samples the reference model here)
        sample_reference = partial(rollout_and_score, ref_model, draw_problems(0)[mine])
        advantages, extra = compute_advantages(args, rewards, state, sample_reference)
        # ---- this process's rows: loss, backward, optimizer step
        lr = scheduled_lr(args, step)
        for group in optimizer.param_groups:
            group["lr"] = lr
        start = time.perf_counter()
        stats = update_policy(model, net, optimizer, rollout, advantages[mine].flatten().to(device), ref_model, args)
        timer["train"] = time.perf_counter() - start
        # ---- log, save, evaluate
        record = {"step": step, **step_metrics(rewards, advantages, rollout, timer, device), **extra, **stats,
                  "train_tokens_per_s": stats["train_tokens"] / timer["train"], "resampled_groups": resampled, "lr": lr}
        stop = all_sum([len(stop_requested)], device)[0] > 0  # every process stops after the same step
        if is_main:
            totals = {key: total + record[key] for key, total in totals.items()}  # x-axis: compute spent so far
            append_jsonl(run_dir / "metrics.jsonl", record | {f"{k}_total": v for k, v in totals.items()})
            bar.set_postfix_str(f"reward {record['reward_mean']:.2f} acr {record['acr']:.2f} "
                                f"eff {record['acr_effective']:.2f} |g| {stats['grad_norm']:.2f}")
            if args.save_every and (step % args.save_every == 0 or step == args.steps or stop):
                save_checkpoint(run_dir, model, tokenizer, optimizer, step, state)
            if (args.eval_every and step % args.eval_every == 0 and not stop) or step == args.steps:
                run_eval(step)
        if stop:
            break
    bar.close()
    if stop or stop_requested:
        if is_main and args.save_every:
            print(f"[{args.algo}] interrupted: checkpoint of step {step} saved in {run_dir}; continue with --resume")
        raise KeyboardInterrupt
    return summarise_run(run_dir, args.algo) if is_main else None


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    try:
        with ctrl_c_stops_after_the_step() as stop_requested:  # Ctrl-C: the loop stops after its step, saved
            summaries = [train(dataclasses.replace(args, algo=algo), Path(args.out) / algo, stop_requested)
                         for algo in args.algo.split(",")]
    except FileNotFoundError as e:  # an unknown model or a missing file: one line, not a traceback
        sys.exit(f"error: {e}")
    except KeyboardInterrupt:  # the checkpoint is saved and said so (or a second Ctrl-C); no traceback
        sys.exit(130)
    finally:
        close_processes()
    if summaries[0] is not None:  # process 0 reports; the others wrote nothing
        from plots import report_runs  # matplotlib only here: `import train` stays light
        report_runs(Path(args.out), summaries)
    return summaries


if __name__ == "__main__":
    main()

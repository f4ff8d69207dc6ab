"""GRPO, AVSPO, AAPO and DAPO's dynamic sampling side by side, on one device or under torchrun.

    python train.py                                    # GRPO on arith-mul1 with the embedded SmolLM2-135M
    python train.py --algo grpo,avspo,aapo,dapo        # all four on the same prompts and seed, one plot
    torchrun --standalone --nproc_per_node 2 train.py  # the same run, its batch split over 2 processes

Read top to bottom, in the order a step runs: config, ALGO LOGIC (sampling and advantages, the one place the
methods differ), the loss and the update, then the loop. Plumbing lives in loop/run.py and the files it names.

Choices, each made once here:
  1. Token-level loss ("dapo" in TRL): per-token losses summed over the batch / its completion token count.
  2. One update per batch by default: the PPO ratio is exactly 1, the loss value is -mean(A) per token (~0)
     and its gradient is REINFORCE's, -A grad log pi; so we log advantage stats and the grad norm.
  3. Under torchrun each process samples its share of the B prompts; rewards are gathered (every logged number
     is the batch's), the loss is over the batch's token count, and gradients are summed once per update.
  4. The learning rate decays linearly to 0 (TRL's and nanochat's default; docs/results.md shows why).
"""

import dataclasses
import math
import os
import sys
import time
from contextlib import nullcontext
from functools import partial
from pathlib import Path
from typing import Callable, Sequence

import torch
from tqdm import tqdm

from advantage import (AVSPO_ENDS, AdaptiveThreshold, aapo_advantages, aapo_margin, avspo_advantages,
                       collapsed_groups, grpo_advantages)
from data.tasks import Problem, step_problems
from infra.flags import FlagParser, arg, at_least, dataclass_parser, folder, in_range, names_from, non_empty
from infra.hardware import DEVICES, accumulate_gradients, copy_weights
from infra.written import Folder
from loop.metrics import group_map, group_samples, step_metrics, summarise_run
from loop.processes import (StoppedWhileScoring, all_sum, bad_input_is_one_line, exits_cleanly,
                            gather_groups, init_processes, sum_gradients)
from loop.run import (Run, SamplingOutOfMemory, after_step, before_failed_step, check_inputs, fast_or_plain,
                      first_eval, sample_and_score, start_run)
from loop.run_folder import folder_problem, owned_out, start_logs, stopped_line
from model import PROMPT_FORMATS, Rollout, real_tokens, replace_groups, trim_padding
from verifier import REWARD_TIMEOUT, RewardError, reward_range

ALGOS, PRECISIONS = ("grpo", "avspo", "aapo", "dapo"), ("auto", "fp32", "bf16")
POSITIVE, NON_NEGATIVE = in_range(0, math.inf, low_open=True), in_range(0, math.inf)
UNIT_OPEN = in_range(0, 1, low_open=True)  # (0, 1]
SEED, STEP = 1_000_003, 1_000  # a step's sampling seed: seed * SEED + step * STEP + rank (`train_step`)


@dataclasses.dataclass
class Args:
    # run
    algo: str = arg("grpo", "grpo, avspo, aapo, dapo (GRPO + dynamic sampling), or a comma list of them",
                    type=names_from(ALGOS))
    model: str = arg("smollm2-135m", "smollm2-135m, tiny-qwen2, hub id, folder or .gguf file", type=non_empty)
    dataset: str = arg("arith-mul1", "arith-<level> (add1 mul1 add2 mul2 mul3), arith-mix, or a .jsonl")
    eval_dataset: str = arg("", "held-out problems (default: --dataset's test split; a file's every 10th)")
    reward: str = arg("verifier", "verifier (verifier.py), math-verify (optional package), module:function")
    reward_range: tuple = arg((0.0, 1.0), "lo,hi: the rewards' range (else the run stops)", type=reward_range)
    reward_timeout: float = arg(REWARD_TIMEOUT, "seconds a reward call may take, else it scores 0 (not the "
                                "verifier's, which is bounded; 0: no limit)", type=NON_NEGATIVE)
    out: str = arg("runs/default", "run folder: one subfolder per algorithm, plus curves.png", type=folder)
    seed: int = arg(0, "seeds the prompts of each step and the sampling")
    resume: bool = arg(False, "continue each algorithm from the checkpoint in its run folder")
    overwrite: bool = arg(False, "replace the runs in --out, only what they wrote (else a folder is refused)")
    device: str = arg("auto", "auto (CUDA if this process can use it, else CPU), cpu, cuda", choices=DEVICES)
    fast: bool = arg(True, "fast paths where verified (CPU: fast/decoding.py, packing.py); --no-fast: plain")
    # sampling
    steps: int = arg(30, "optimizer steps (one batch of groups each)", type=at_least(1))
    prompts_per_step: int = arg(2, "prompts per step (B), over all processes", type=at_least(1))
    group_size: int = arg(8, "completions per prompt (G)", type=at_least(2))
    max_new_tokens: int = arg(32, "completion length limit (longer ones are truncated)", type=at_least(1))
    temperature: float = arg(1.0, "sampling temperature, also applied to the log-probs", type=POSITIVE)
    top_p: float = arg(1.0, "nucleus sampling", type=UNIT_OPEN)
    prompt_format: str = arg("chat", "chat (the tokenizer's chat template), raw (plain text: base models)",
                             choices=PROMPT_FORMATS)
    system: str = arg("", "system message of every chat prompt; empty: the chat template's own")
    max_prompt_tokens: int = arg(0, "skip (and count) longer prompts, in tokens (0: none)", type=at_least(0))
    # optimisation
    lr: float = arg(2e-5, "AdamW learning rate (at the first step)", type=POSITIVE)
    lr_decay: float = arg(1.0, "last fraction of the steps in which the lr falls to 0", type=in_range(0, 1))
    beta: float = arg(0.0, "k3 KL penalty to the reference model (0: none)", type=NON_NEGATIVE)
    epsilon: float = arg(0.2, "PPO clip: ratio lower bound 1 - epsilon", type=in_range(0, 1, high_open=True))
    epsilon_high: float = arg(0.2, "PPO clip: ratio upper bound 1 + epsilon_high", type=NON_NEGATIVE)
    updates_per_batch: int = arg(1, "optimizer steps per batch (> 1: the PPO clip acts)", type=at_least(1))
    micro_batch: int = arg(8, "completions per forward/backward pass", type=at_least(1))
    max_grad_norm: float = arg(1.0, "gradient clipping", type=POSITIVE)
    grad_checkpointing: bool = arg(False, "recompute activations in backward: less memory, more time")
    precision: str = arg("auto", "auto (bf16 where native on the GPU or CPU), fp32, bf16", choices=PRECISIONS)
    lora_rank: int = arg(0, "LoRA: adapters of this rank on every linear layer (0: none)", type=at_least(0))
    lora_alpha: float = arg(32.0, "LoRA: the adapters are scaled by alpha / rank", type=POSITIVE)
    # AVSPO (He et al., 2026) and AAPO (Xiong et al., 2025)
    acr_threshold: float = arg(0.5, "AVSPO: initial ACR threshold", type=in_range(0, 1))
    fixed_threshold: bool = arg(False, "AVSPO: keep the threshold fixed instead of adapting it")
    alpha: float = arg(0.5, "AVSPO: K = ceil(G * ACR^alpha) virtual samples", type=NON_NEGATIVE)
    num_virtual: int = arg(0, "AVSPO: K virtual rewards per collapsed group (0: adaptive)", type=at_least(0))
    virtual_delta: float = arg(0.1, "AVSPO: virtual rewards at max - delta, min + delta", type=UNIT_OPEN)
    virtual_ends: str = arg("both", "AVSPO: collapsed groups given virtual rewards", choices=AVSPO_ENDS)
    delta_low: float = arg(0.2, "AAPO: margin clip below", type=NON_NEGATIVE)
    delta_high: float = arg(0.28, "AAPO: margin clip above", type=NON_NEGATIVE)
    resample_rounds: int = arg(2, "DAPO: most rounds of new prompts for collapsed groups", type=at_least(0))
    # evaluation and logging
    eval_every: int = arg(10, "held-out accuracy every N steps (0: before and after)", type=at_least(0))
    eval_size: int = arg(64, "held-out problems per evaluation", type=at_least(1))
    save_every: int = arg(40, "checkpoint every N steps, at the end, when stopped (0: no)", type=at_least(0))
    log_samples: str = arg("evals", "samples.jsonl: the groups' prompts, completions, rewards, advantages, "
                           "on evaluation steps, every step or none", choices=("evals", "every", "none"))
    show_group: bool = arg(True, "at each evaluation, print one training group (a collapsed one if any)")


def parse_args(argv: list[str] | None = None, parser: FlagParser | None = None) -> Args:
    """One flag per Args field; bad values stop here, before any model loads (`parser.error`: one line)."""
    parser = parser or dataclass_parser(Args, __doc__.split("\n")[0])
    args = Args(**vars(parser.parse_args(argv)))
    if args.prompts_per_step % (world := int(os.environ.get("WORLD_SIZE", 1))):
        parser.error(f"--prompts-per-step {args.prompts_per_step} must be a multiple of the process count")
    low, high = -((2**63 + STEP) // SEED), (2**64 - args.steps * STEP - world) // SEED
    if not low <= args.seed <= high:  # torch.manual_seed's range [-2**63, 2**64), as train_step seeds it
        parser.error(f"--seed must be in [{low}, {high}] (with --steps {args.steps}), got {args.seed}")
    if args.virtual_delta > args.reward_range[1] - args.reward_range[0]:
        parser.error(f"--virtual-delta {args.virtual_delta} is wider than --reward-range {args.reward_range}")
    if args.resume and args.overwrite:
        parser.error("--resume continues the runs in --out, --overwrite replaces them: choose one")
    with bad_input_is_one_line(parser.error):  # data, reward, tokenizer before any model: a bad line at once
        check_inputs(args)
    return args


# ------------------------------------------------------------------------------ ALGO LOGIC: methods differ
# A method = what it samples, its state across steps (checkpointed), its advantages (from advantage.py).
SampleAndScore = Callable[[torch.nn.Module, list[Problem]], tuple[Rollout, torch.Tensor]]  # -> rewards [b, G]


def sample_batch(args: Args, sample_and_score: SampleAndScore, policy, problems_of_round, mine: slice,
                 pad_token_id: int):
    """This process's rollout and prompts; the batch's rewards [B, G] as trained and as first sampled; which
    of the B groups were replaced [B]; how many were sampled again. DAPO's dynamic sampling (Yu et al. 2025,
    arXiv 2503.14476) gives each collapsed group a new prompt, up to --resample-rounds times."""
    problems = problems_of_round(0)[mine]
    rollout, local = sample_and_score(policy, problems)  # [b, G]
    rewards = first_rewards = gather_groups(local.clone())  # [B, G]; a copy, as the rounds overwrite local
    replaced, resampled = torch.zeros(len(rewards), dtype=torch.bool), 0
    for round in range(1, (args.resample_rounds if args.algo == "dapo" else 0) + 1):
        collapsed = collapsed_groups(rewards)  # [B], the same on every process
        if not collapsed.any():
            break
        redo = collapsed[mine].nonzero().flatten().tolist()  # this process's collapsed groups
        if redo:
            fresh = problems_of_round(round)[mine]
            new, local[redo] = sample_and_score(policy, [fresh[g] for g in redo])
            rollout = replace_groups(rollout, redo, new, args.group_size, pad_token_id)
            problems = [fresh[g] if g in redo else p for g, p in enumerate(problems)]
        rewards, replaced = gather_groups(local), replaced | collapsed
        resampled += int(collapsed.sum())
    return rollout, problems, rewards, first_rewards, replaced, resampled


def reference_rewards(args: Args, sample_and_score: SampleAndScore, reference, problems: list[Problem]):
    """AAPO's r_ref [B, G]: rewards of G completions per prompt from the frozen reference; None otherwise."""
    with reference() if args.algo == "aapo" else nullcontext() as network:  # LoRA: the policy, adapters off
        return None if network is None else gather_groups(sample_and_score(network, problems)[1])


def algo_state(args: Args) -> dict:
    """What a method carries from step to step: AVSPO's adaptive threshold (with its reward average)."""
    if args.algo == "avspo":
        return {"threshold": AdaptiveThreshold(start=args.acr_threshold, low=min(0.1, args.acr_threshold),
                                               high=max(0.9, args.acr_threshold))}
    return {}


def compute_advantages(args: Args, rewards: torch.Tensor, state: dict, ref_rewards: torch.Tensor | None):
    """Advantages [B, G] from rewards [B, G] (AAPO: and r_ref [B, G]), and what to log about them."""
    if args.algo in ("grpo", "dapo"):
        return grpo_advantages(rewards), {}
    if args.algo == "avspo":
        threshold = state["threshold"]
        advantages, info = avspo_advantages(rewards, acr_threshold=threshold.value, alpha=args.alpha,
                                            num_virtual=args.num_virtual or None, delta=args.virtual_delta,
                                            ends=args.virtual_ends, reward_range=args.reward_range,
                                            return_info=True)
        log = {"acr_threshold": threshold.value, "avspo_triggered": info.triggered,
               "virtual_samples": info.num_virtual * info.num_treated}
        if not args.fixed_threshold:  # the new value acts from the next step on
            threshold.update(info.num_collapsed / len(rewards), rewards.mean().item())
        return advantages, log
    if args.algo == "aapo":
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
    """The lr of step 1..steps (choice 4): args.lr, falling linearly to 0 over the last `lr_decay` of the run
    (to lr / steps at the last step when lr_decay is 1, as TRL's); from the step alone, --resume continues."""
    return args.lr * (1.0 if args.lr_decay == 0 else min(1.0, (1 - (step - 1) / args.steps) / args.lr_decay))


def update_policy(master, policy, optimizer, rollout: Rollout, b_advantages, reference, args: Args) -> dict:
    """`updates_per_batch` optimizer steps on this process's rows, in micro-batches; returns what to log.
    Forward and backward run on `policy`; the optimizer steps `master`'s float32 weights, then `policy` takes
    them. Rows with advantage 0 add nothing to the gradient when beta = 0: they are skipped. A non-finite
    gradient skips the step, leaving weights and optimizer unchanged."""
    device, start = b_advantages.device, time.perf_counter()
    num_tokens, = all_sum([rollout.completion_mask.sum().item()], device)  # every row of every process counts
    # Which rows train, in which order: bookkeeping on the host (CPU), like every index tensor here. A host
    # index may pick rows of a GPU tensor; GPU indices may not index a host tensor (tests/test_device.py).
    lengths = rollout.completion_mask.sum(1).cpu()  # [N]
    rows = torch.arange(len(b_advantages)) if args.beta > 0 else b_advantages.nonzero().flatten().cpu()
    rows = rows[lengths[rows].argsort(stable=True)]  # shortest first, then by prompt:
    rows = rows[(rows // args.group_size).argsort(stable=True)]  # micro-batches of one prompt pad little
    ids_all, attn_all, mask_all = rollout.input_ids, rollout.attention_mask, rollout.completion_mask
    micro = [(idx, *trim_padding(ids_all[idx], attn_all[idx], mask_all[idx]))  # (rows, ids, attn, mask)
             for idx in rows.split(args.micro_batch) if len(idx)]
    loss_kw = dict(clip_low=args.epsilon, clip_high=args.epsilon_high, beta=args.beta, num_tokens=num_tokens)
    logprobs = partial(fast_or_plain(args.fast, device).completion_logprobs, temperature=args.temperature)
    with torch.no_grad():  # fixed during the updates: the old policy's (PPO epochs) and the reference's
        old_logp = [logprobs(policy, i, a, m.shape[1]) if args.updates_per_batch > 1 else None
                    for _, i, a, m in micro]
        with reference() if args.beta > 0 else nullcontext() as ref:  # under LoRA: the policy, adapters off
            ref_logp = [logprobs(ref, i, a, m.shape[1]) if args.beta > 0 else None for _, i, a, m in micro]
    policy.train()
    skipped = 0
    for _ in range(args.updates_per_batch):
        loss_sum, kl_sum = 0.0, 0.0
        for (idx, ids, attn, mask), old, ref in zip(micro, old_logp, ref_logp):
            logp = logprobs(policy, ids, attn, mask.shape[1])  # [n, C] with grad
            loss, kl = policy_loss(logp, logp.detach() if old is None else old, ref, b_advantages[idx], mask,
                                   **loss_kw)
            loss.backward()
            accumulate_gradients(policy, into=master)  # bf16: summed in float32, micro-batch by micro-batch
            loss_sum += loss.item()
            kl_sum += 0.0 if kl is None else kl.item()
        sum_gradients(master)  # over processes; each one's loss is already divided by the global token count
        grad_norm = torch.nn.utils.clip_grad_norm_(master.parameters(), args.max_grad_norm).item()
        if math.isfinite(grad_norm):
            optimizer.step()
            copy_weights(master, into=policy)  # bf16: the working copy follows the step
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    policy.eval()
    tokens = sum(real_tokens(ids, attn, mask.shape[1]) for _, ids, attn, mask in micro)  # each prompt once
    loss_sum, kl_sum, rows_trained, train_tokens = all_sum([loss_sum, kl_sum, len(rows), tokens], device)
    seconds = time.perf_counter() - start
    return {"loss": loss_sum, "kl": kl_sum if args.beta > 0 else None, "grad_norm": grad_norm,
            "skipped": skipped, "rows_trained": int(rows_trained), "train_tokens": int(train_tokens),
            "time_train": seconds, "train_tokens_per_s": train_tokens / seconds}


# ------------------------------------------------------------------------------ the loop


def train_step(args: Args, run: Run, step: int, rank: int, mine: slice, device: torch.device) -> tuple:
    """One step: sample and score the batch, its advantages (ALGO LOGIC), the update; returns its record and
    this process's groups in words (`group_samples`)."""
    torch.manual_seed(args.seed * SEED + step * STEP + rank)  # samples: (seed, step, rank) alone
    run.costs.clear()
    score = partial(sample_and_score, args, run)
    problems_of_round = partial(step_problems, run.train_problems, args.prompts_per_step, args.seed, step)
    rollout, problems, rewards, first_rewards, replaced, resampled = sample_batch(
        args, score, run.policy, problems_of_round, mine, run.tokenizer.pad_token_id)  # rewards [B, G]
    ref_rewards = reference_rewards(args, score, run.reference, problems_of_round(0)[mine])
    advantages, extra = compute_advantages(args, rewards, run.state, ref_rewards)  # [B, G]: ALGO LOGIC
    lr = scheduled_lr(args, step)
    for group in run.optimizer.param_groups:
        group["lr"] = lr
    b_advantages = advantages[mine].flatten().to(device)  # this process's rows
    stats = update_policy(run.master, run.policy, run.optimizer, rollout, b_advantages, run.reference, args)
    record = {"step": step, **step_metrics(rewards, advantages, rollout, run.costs, device), **extra, **stats,
              "resampled_groups": resampled, "lr": lr, **group_map(first_rewards, advantages, replaced)}
    return record, group_samples(step, problems, rollout.texts, mine.start, rewards, advantages, ref_rewards,
                                 replaced)


def train(args: Args, files: Folder | None, stop_requested: Sequence = ()) -> dict | None:
    """Train one algorithm into its folder `files` (None on processes > 0); Ctrl-C: saved, then stops."""
    rank, world, device = init_processes(args.device)
    run_dir, is_main = Path(args.out) / args.algo, rank == 0
    run = start_run(args, run_dir, device, is_main, algo_state(args),
                    with_reference=args.algo == "aapo" or args.beta > 0)  # AAPO's r_ref, the KL
    if is_main:
        totals = start_logs(files, dataclasses.asdict(args), run.done)  # tokens generated, trained so far
        if not stop_requested:
            first_eval(args, run, files)
    mine = slice(rank * args.prompts_per_step // world, (rank + 1) * args.prompts_per_step // world)
    if all_sum([len(stop_requested)], device)[0] > 0:  # Ctrl-C while loading: stop before the first step
        raise KeyboardInterrupt
    stop = False
    bar = tqdm(range(run.done + 1, args.steps + 1), args.algo, total=args.steps, initial=run.done,
               disable=rank > 0)
    for step in bar:
        try:
            record, samples = train_step(args, run, step, rank, mine, device)
        except (RewardError, StoppedWhileScoring, SamplingOutOfMemory) as e:  # save the steps before it
            if is_main:
                before_failed_step(args, run, files, step, e)
            raise
        stop = all_sum([len(stop_requested)], device)[0] > 0  # every process stops after the same step
        if is_main:
            totals = after_step(args, run, files, record, totals, stop, samples)
            bar.set_postfix_str(" ".join(f"{k} {record[k]:.2f}" for k in ("reward_mean", "acr", "grad_norm")))
        if stop:
            break
    bar.close()
    if stop or stop_requested:
        if is_main:
            print(stopped_line(args, run_dir, step))
        raise KeyboardInterrupt
    return summarise_run(files, args.algo, time.perf_counter() - run.started) if is_main else None


def main(argv: list[str] | None = None) -> list[dict]:
    with exits_cleanly() as stop_requested:  # Ctrl-C, even while checking the flags: one line, no traceback
        args = parse_args(argv)
        with owned_out(args.out) as out:  # Ctrl-C: the loop stops after its step, saved
            if out and (problem := folder_problem(args, out)):  # the owner judges: nothing changes in between
                sys.exit(f"error: {problem}")
            summaries = [train(dataclasses.replace(args, algo=algo), out and out.subfolder(algo, "run"),
                               stop_requested) for algo in args.algo.split(",")]
            if out:  # process 0, <out>'s one owner, reports; the others wrote nothing
                from loop.plots import report_runs  # matplotlib only here: `import train` stays light
                report_runs(out, summaries)
    return summaries


if __name__ == "__main__":
    main()

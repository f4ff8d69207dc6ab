"""GRPO, AVSPO and AAPO on one device, side by side.

Read top to bottom:
    config -> helpers (loss, update, checkpoint) -> the loop: sample groups, verify, advantages,
    loss, step, log, sometimes evaluate and checkpoint -> compare several algorithms in one plot.

Choices, each made once here:
  1. Loss normalisation: token-level ("dapo" in TRL): sum of per-token losses over the whole batch
     divided by its number of completion tokens, so every token weighs the same whatever the length of
     its completion (TRL's "grpo" per-sequence mean favours short wrong answers; "dr_grpo" divides by
     a constant). Advantages are per completion, broadcast over its tokens.
  2. One update per batch by default (--updates-per-batch 1): old log-probs are the current ones
     detached, so the PPO ratio is exactly 1, the clip never acts, and the loss value is just -mean(A)
     per token (~0) while its gradient is the REINFORCE gradient -A * grad log pi. So we log advantage
     stats and the grad norm, not only the loss.
  3. KL to the reference is the k3 estimator exp(ref - logp) - (ref - logp) - 1 (Schulman, 2020),
     computed only when --beta > 0; the AAPO paper uses no KL and no ratio (the same gradient here).
"""

import argparse
import copy
import dataclasses
import json
import math
import random
import shutil
import sys
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from advantage import (AdaptiveThreshold, aapo_advantages, aapo_margin, advantage_collapse_rate, avspo_advantages,
                       collapsed_groups, effective_collapse_rate, grpo_advantages, num_virtual_samples)
from data.tasks import Problem, load_eval_problems, load_problems
from eval import evaluate
from model import Rollout, completion_logprobs, load_model, pick_device, sample, trim_padding
from plots import plot_training_curves, read_jsonl
from verifier import verify

ALGOS = ("grpo", "avspo", "aapo")


def arg(default, help: str):
    """A config field whose help text becomes its --help line."""
    return dataclasses.field(default=default, metadata={"help": help})


@dataclass
class Args:
    # run
    algo: str = arg("grpo", "grpo, avspo, aapo, or a comma list (e.g. grpo,avspo,aapo) run on the same prompts and seed")
    model: str = arg("smollm2-135m", "alias (smollm2-135m, tiny-qwen2), hub id, local folder or .gguf file")
    dataset: str = arg("arith-mul1", "arith-<level> (add1, mul1, add2, mul2, mul3) or a GSM8K/MATH-form .jsonl file")
    eval_dataset: str = arg("", "held-out problems (default: the test split of --dataset)")
    out: str = arg("runs/default", "run folder: one subfolder per algorithm, plus curves.png")
    seed: int = arg(0, "seeds the prompts of each step and the sampling")
    resume: bool = arg(False, "continue each algorithm from the checkpoint in its run folder")
    # sampling
    steps: int = arg(40, "optimizer steps (one batch of groups each)")
    prompts_per_step: int = arg(2, "prompts per step (B)")
    group_size: int = arg(8, "completions per prompt (G)")
    max_new_tokens: int = arg(64, "completion length limit; longer completions are truncated")
    temperature: float = arg(1.0, "sampling temperature, also applied to the log-probs")
    top_p: float = arg(1.0, "nucleus sampling")
    # optimisation
    lr: float = arg(2e-5, "AdamW learning rate")
    beta: float = arg(0.0, "k3 KL penalty to the reference model (0: no reference forward)")
    epsilon: float = arg(0.2, "PPO clip: ratio lower bound 1 - epsilon")
    epsilon_high: float = arg(0.2, "PPO clip: ratio upper bound 1 + epsilon_high (DAPO uses 0.28)")
    updates_per_batch: int = arg(1, "optimizer steps per sampled batch (PPO epochs); >1 makes the clip matter")
    micro_batch: int = arg(8, "completions per forward/backward pass (gradient accumulation)")
    max_grad_norm: float = arg(1.0, "gradient clipping")
    grad_checkpointing: bool = arg(False, "recompute activations in backward: less memory, ~30% slower")
    precision: str = arg("auto", "auto (bf16 autocast on CUDA, fp32 on CPU), fp32, or bf16 (autocast on CPU too)")
    # AVSPO (He et al., 2026) and AAPO (Xiong et al., 2025)
    acr_threshold: float = arg(0.5, "AVSPO: initial ACR threshold tau_adapt(0)")
    fixed_threshold: bool = arg(False, "AVSPO: keep the threshold fixed instead of adapting it (Eq. 12)")
    alpha: float = arg(0.5, "AVSPO: K = ceil(G * ACR^alpha) virtual samples (Eq. 9)")
    num_virtual: int = arg(0, "AVSPO: fixed K virtual samples per collapsed group (0: adaptive Eq. 9)")
    delta_low: float = arg(0.2, "AAPO: margin clip below")
    delta_high: float = arg(0.28, "AAPO: margin clip above")
    # evaluation and logging
    eval_every: int = arg(10, "greedy held-out accuracy every N steps (0: only before and after)")
    eval_size: int = arg(64, "held-out problems per evaluation")
    save_every: int = arg(10, "checkpoint every N steps, at the end and on Ctrl-C (0: never)")


def parse_args(argv: list[str] | None = None) -> Args:
    """argparse from the Args dataclass: one flag per field."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    for f in dataclasses.fields(Args):
        flag = "--" + f.name.replace("_", "-")
        if f.type is bool:
            parser.add_argument(flag, action="store_true", help=f.metadata["help"])
        else:
            parser.add_argument(flag, type=f.type, default=f.default, help=f"{f.metadata['help']} (default: {f.default})")
    args = Args(**vars(parser.parse_args(argv)))
    for algo in args.algo.split(","):
        if algo not in ALGOS:
            parser.error(f"--algo: unknown algorithm {algo!r}; choose from {', '.join(ALGOS)} or a comma list")
    if args.group_size < 2:
        parser.error("--group-size must be >= 2: advantages compare samples within a group")
    for name in ("steps", "prompts_per_step", "max_new_tokens", "updates_per_batch", "micro_batch"):
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1")
    if args.precision not in ("auto", "fp32", "bf16"):
        parser.error("--precision must be auto, fp32 or bf16")
    try:  # read the data before loading any model: a bad line fails in a second, naming file and line
        load_problems(args.dataset, "train", args.seed)
        if args.eval_dataset:
            load_eval_problems(args.eval_dataset, args.seed)
    except (FileNotFoundError, ValueError) as e:
        parser.error(str(e))
    return args


# ------------------------------------------------------------------------------ the loss


def policy_loss(logp, old_logp, ref_logp, advantages, mask, args: Args, num_tokens: int):
    """PPO-clipped surrogate (Schulman et al. 2017, Eq. 7) + beta * k3 KL, normalised per token."""
    ratio = torch.exp(logp - old_logp)  # [n, C], exactly 1 on the first update of a batch
    clipped = ratio.clamp(1 - args.epsilon, 1 + args.epsilon_high)
    per_token = -torch.min(ratio * advantages[:, None], clipped * advantages[:, None])  # [n, C]
    kl = None
    if ref_logp is not None:
        kl = torch.exp(ref_logp - logp) - (ref_logp - logp) - 1  # k3 estimator, >= 0
        per_token = per_token + args.beta * kl
    loss = (per_token * mask).sum() / num_tokens  # token-level normalisation over the whole batch
    return loss, (None if kl is None else (kl * mask).sum().detach() / num_tokens)


def update_policy(model, optimizer, rollout: Rollout, b_advantages, ref_model, args: Args, autocast) -> dict:
    """`updates_per_batch` optimizer steps on one batch, in micro-batches; returns what to log.

    Rows whose advantage is 0 (every row of a collapsed GRPO group) add nothing to the gradient when
    beta = 0, so their forward and backward passes are skipped: the gradient is the same, the cost is not.
    A non-finite gradient (from a NaN/inf loss) skips the step and leaves weights and optimizer as they were.
    """
    num_tokens = int(rollout.completion_mask.sum())  # the denominator counts every row, trained or not
    rows = torch.arange(len(b_advantages)) if args.beta > 0 else b_advantages.nonzero().flatten().cpu()
    micro = []
    for i in range(0, len(rows), args.micro_batch):
        idx = rows[i : i + args.micro_batch]
        micro.append((idx, *trim_padding(rollout.input_ids[idx], rollout.attention_mask[idx], rollout.completion_mask[idx])))

    def logprobs(net, ids, attn, mask):
        with autocast:
            return completion_logprobs(net, ids, attn, mask.shape[1], args.temperature)

    with torch.no_grad():  # log-probs that stay fixed during the updates: old policy (PPO epochs) and reference
        old_logp = [logprobs(model, *m[1:]) if args.updates_per_batch > 1 else None for m in micro]
        ref_logp = [logprobs(ref_model, *m[1:]) if args.beta > 0 else None for m in micro]
    model.train()
    skipped = 0
    for _ in range(args.updates_per_batch):
        loss_sum, kl_sum = 0.0, 0.0
        for (idx, ids, attn, mask), old, ref in zip(micro, old_logp, ref_logp):
            logp = logprobs(model, ids, attn, mask)  # [n, C] with grad
            loss, kl = policy_loss(logp, logp.detach() if old is None else old, ref, b_advantages[idx], mask, args,
                                   num_tokens)
            loss.backward()
            loss_sum += loss.item()
            kl_sum += 0.0 if kl is None else kl.item()
        if not micro:  # nothing to learn from: a zero gradient, so the optimizer steps exactly as it would
            for p in model.parameters():
                p.grad = torch.zeros_like(p)
        grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.max_grad_norm).item()
        if math.isfinite(grad_norm):
            optimizer.step()
        else:
            skipped += 1
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    return {"loss": loss_sum, "kl": kl_sum if args.beta > 0 else None, "grad_norm": grad_norm, "skipped": skipped,
            "rows_trained": len(rows), "train_tokens": sum(ids.numel() for _, ids, _, _ in micro)}


# ------------------------------------------------------------------------------ checkpoints


def save_checkpoint(run_dir: Path, model, tokenizer, optimizer, state: dict) -> None:
    """HF folder + optimizer + loop state, written to a temp folder then renamed into place."""
    tmp, final, old = run_dir / "checkpoint.tmp", run_dir / "checkpoint", run_dir / "checkpoint.old"
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp / "model")
    tokenizer.save_pretrained(tmp / "model")
    torch.save({**state, "optimizer": optimizer.state_dict()}, tmp / "state.pt")
    if final.exists():
        final.rename(old)
    tmp.rename(final)
    shutil.rmtree(old, ignore_errors=True)


def load_checkpoint(run_dir: Path) -> Path | None:
    for folder in (run_dir / "checkpoint", run_dir / "checkpoint.old"):  # .old: crashed between renames
        if (folder / "state.pt").exists():
            return folder
    return None


def capture_rng() -> dict:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "cuda": torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None}


def restore_rng(rng: dict) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    if rng["cuda"] is not None and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(rng["cuda"])


# ------------------------------------------------------------------------------ one algorithm, one run


def step_problems(problems: list[Problem], args: Args, step: int) -> list[Problem]:
    """The prompts of a step depend only on (seed, step): every algorithm and a resumed run see the same."""
    return random.Random(args.seed * 1_000_003 + step).sample(problems, min(args.prompts_per_step, len(problems)))


def score(rollout: Rollout, batch: list[Problem], group_size: int) -> torch.Tensor:
    """Verifier rewards [B, G] of the B*G completions of a rollout."""
    rewards = [verify(text, batch[i // group_size].answer) for i, text in enumerate(rollout.texts)]
    return torch.tensor(rewards).view(len(batch), group_size)  # [B, G]


def compute_advantages(args: Args, rewards, ref_rewards, threshold: AdaptiveThreshold) -> tuple[torch.Tensor, dict]:
    """Advantages [B, G] and what to log about them: the only place the three algorithms differ."""
    if args.algo == "grpo":
        return grpo_advantages(rewards), {}
    if args.algo == "avspo":
        acr = advantage_collapse_rate(rewards)
        advantages = avspo_advantages(rewards, acr_threshold=threshold.value, alpha=args.alpha,
                                      num_virtual=args.num_virtual or None)
        k = args.num_virtual or num_virtual_samples(args.group_size, acr, args.alpha)
        triggered = acr > threshold.value
        return advantages, {"acr_threshold": threshold.value, "avspo_triggered": triggered,
                            "virtual_samples": k * int(collapsed_groups(rewards).sum()) if triggered else 0}
    deltas = dict(delta_low=args.delta_low, delta_high=args.delta_high)
    return aapo_advantages(rewards, ref_rewards, **deltas), {
        "ref_reward_mean": ref_rewards.mean().item(), "margin_mean": aapo_margin(rewards, ref_rewards, **deltas).mean().item()}


def append_jsonl(path: Path, record: dict) -> None:
    with path.open("a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl_upto(path: Path, last_step: int) -> list[dict]:
    return [r for r in read_jsonl(path) if r["step"] <= last_step]


def train(args: Args, run_dir: Path) -> dict:
    """Train one algorithm (args.algo); writes config.json, metrics.jsonl, evals.jsonl, checkpoint/, summary.json."""
    device = pick_device()
    bf16 = args.precision == "bf16" or (args.precision == "auto" and device.type == "cuda")
    autocast = torch.autocast(device.type, dtype=torch.bfloat16) if bf16 else nullcontext()
    checkpoint = load_checkpoint(run_dir) if args.resume else None
    if args.resume and not checkpoint:
        print(f"[{args.algo}] --resume: no checkpoint in {run_dir}, starting from scratch")
    model, tokenizer = load_model(str(checkpoint / "model") if checkpoint else args.model, device)
    ref_model = None
    if args.algo == "aapo" or args.beta > 0:  # frozen copy of the initial policy, only when needed
        ref_model = load_model(args.model, device)[0] if checkpoint else copy.deepcopy(model)
        ref_model.eval().requires_grad_(False)
    if args.grad_checkpointing:
        model.activation_checkpointing_enable()
    model.eval()  # dropout off; update_policy switches to train mode only around the backward passes
    run_dir.mkdir(parents=True, exist_ok=True)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    train_problems = load_problems(args.dataset, "train", args.seed)
    eval_problems = (load_eval_problems(args.eval_dataset, args.seed) if args.eval_dataset
                     else load_problems(args.dataset, "test", args.seed))[: args.eval_size]
    threshold = AdaptiveThreshold(init=args.acr_threshold, low=min(0.1, args.acr_threshold),
                                  high=max(0.9, args.acr_threshold))
    metrics_path, evals_path = run_dir / "metrics.jsonl", run_dir / "evals.jsonl"

    def run_eval(step: int) -> float:
        with autocast:
            accuracy = evaluate(model, tokenizer, eval_problems, max_new_tokens=args.max_new_tokens)["accuracy"]
        append_jsonl(evals_path, {"step": step, "eval_accuracy": accuracy})
        return accuracy

    if checkpoint:  # drop what was logged after the checkpoint, restore optimizer, RNG and AVSPO state
        state = torch.load(checkpoint / "state.pt", weights_only=False)
        optimizer.load_state_dict(state["optimizer"])
        restore_rng(state["rng"])
        done, prev_reward, threshold.value = state["step"], state["prev_reward"], state["threshold"]
        for path in (metrics_path, evals_path):
            path.write_text("".join(json.dumps(r) + "\n" for r in read_jsonl_upto(path, done)))
    else:
        (run_dir / "config.json").write_text(json.dumps(dataclasses.asdict(args), indent=2))
        metrics_path.write_text("")
        evals_path.write_text("")
        print(f"[{args.algo}] held-out accuracy before training: {run_eval(0):.3f} ({len(eval_problems)} problems)")
        done, prev_reward = 0, None  # done: the last step whose update and metrics are complete
        random.seed(args.seed), np.random.seed(args.seed), torch.manual_seed(args.seed)
    rng_after_step = capture_rng()

    def checkpoint_now() -> None:
        save_checkpoint(run_dir, model, tokenizer, optimizer, {"step": done, "threshold": threshold.value,
                                                               "prev_reward": prev_reward, "rng": rng_after_step})

    bar = tqdm(range(done + 1, args.steps + 1), desc=args.algo, initial=done, total=args.steps)
    try:
        for step in bar:
            # ---- sample G completions for each of B prompts (and, for AAPO, G from the reference)
            batch = step_problems(train_problems, args, step)
            questions = [p.question for p in batch]
            t0 = time.perf_counter()
            with autocast:
                rollout = sample(model, tokenizer, questions, args.group_size, args.max_new_tokens,
                                 args.temperature, args.top_p)
                ref_rollout = sample(ref_model, tokenizer, questions, args.group_size, args.max_new_tokens,
                                     args.temperature, args.top_p) if args.algo == "aapo" else None
            t1 = time.perf_counter()
            # ---- verify
            rewards = score(rollout, batch, args.group_size)  # [B, G]
            ref_rewards = score(ref_rollout, batch, args.group_size) if ref_rollout else None  # [B, G]
            t2 = time.perf_counter()
            # ---- advantages, loss, backward, optimizer step
            advantages, extra = compute_advantages(args, rewards, ref_rewards, threshold)  # [B, G]
            stats = update_policy(model, optimizer, rollout, advantages.flatten().to(device), ref_model, args, autocast)
            t3 = time.perf_counter()
            # ---- log (the names are documented in the README)
            gen_tokens = rollout.completion_mask.sum().item() + (ref_rollout.completion_mask.sum().item() if ref_rollout else 0)
            record = {
                "step": step, "reward_mean": rewards.mean().item(), "accuracy": (rewards == 1).float().mean().item(),
                "acr": advantage_collapse_rate(rewards), "acr_effective": effective_collapse_rate(advantages),
                "all_correct_frac": (rewards.amin(1) == 1).float().mean().item(),
                "all_wrong_frac": (rewards.amax(1) == 0).float().mean().item(),
                "adv_abs_mean": advantages.abs().mean().item(), "adv_std": advantages.std().item(), **extra, **stats,
                "completion_len": rollout.completion_mask.sum(1).float().mean().item(),
                "truncated_frac": rollout.truncated.float().mean().item(),
                "time_generate": t1 - t0, "time_score": t2 - t1, "time_train": t3 - t2,
                "gen_tokens_per_s": gen_tokens / (t1 - t0), "train_tokens_per_s": stats["train_tokens"] / (t3 - t2),
            }
            append_jsonl(metrics_path, record)
            if args.algo == "avspo" and not args.fixed_threshold and prev_reward is not None:
                threshold.update(record["acr"], record["reward_mean"] - prev_reward)  # AVSPO Eq. 12, for next step
            prev_reward, done, rng_after_step = record["reward_mean"], step, capture_rng()
            bar.set_postfix_str(f"reward {record['reward_mean']:.2f} acr {record['acr']:.2f} "
                                f"eff {record['acr_effective']:.2f} |g| {stats['grad_norm']:.2f} "
                                f"len {record['completion_len']:.0f} {t3 - t0:.1f}s")
            if (args.eval_every and step % args.eval_every == 0) or step == args.steps:
                run_eval(step)
            if args.save_every and (step % args.save_every == 0 or step == args.steps):
                checkpoint_now()
    except KeyboardInterrupt:
        bar.close()
        if args.save_every:
            checkpoint_now()
            print(f"\n[{args.algo}] interrupted: checkpoint of step {done} saved in {run_dir}; resume with --resume")
        raise
    rows, evals = read_jsonl_upto(metrics_path, done), read_jsonl_upto(evals_path, done)
    summary = {"algo": args.algo, "acc_before": evals[0]["eval_accuracy"], "acc_after": evals[-1]["eval_accuracy"],
               "acr_mean": float(np.mean([r["acr"] for r in rows])),
               "acr_effective_mean": float(np.mean([r["acr_effective"] for r in rows])),
               "reward_mean": float(np.mean([r["reward_mean"] for r in rows])),
               "seconds_per_step": float(np.mean([r["time_generate"] + r["time_score"] + r["time_train"] for r in rows]))}
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2))
    return summary


def main(argv: list[str] | None = None) -> list[dict]:
    args = parse_args(argv)
    out = Path(args.out)
    try:
        summaries = [train(dataclasses.replace(args, algo=algo), out / algo) for algo in args.algo.split(",")]
    except FileNotFoundError as e:  # an unknown model or a missing file: one line, not a traceback
        sys.exit(f"error: {e}")
    plot = plot_training_curves(out, [s["algo"] for s in summaries])
    print(f"\n{'algo':6} {'acc before':>10} {'acc after':>10} {'ACR':>6} {'eff. ACR':>9} {'s/step':>7}")
    for s in summaries:
        print(f"{s['algo']:6} {s['acc_before']:10.3f} {s['acc_after']:10.3f} {s['acr_mean']:6.2f} "
              f"{s['acr_effective_mean']:9.2f} {s['seconds_per_step']:7.1f}")
    print(f"run folder: {out.resolve()}\nplot: {plot.resolve()}")
    return summaries


if __name__ == "__main__":
    main()

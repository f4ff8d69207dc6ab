"""What a step logs (docs/metrics.md): its metrics, collapse as a diagnostic (the early ACR, the map of
groups), the run's summary, and the training groups in words (samples.jsonl, one group shown at evaluations).
"""

import json
import math
from pathlib import Path

import torch
from tqdm import tqdm

from advantage import advantage_collapse_rate, effective_collapse_rate, grpo_advantages
from data.tasks import Problem
from infra.hardware import peak_memory_bytes
from infra.written import Folder
from loop.processes import all_sum
from loop.run_folder import read_jsonl
from model import Rollout

EARLY_FRACTION, EARLY_MAX_STEPS = 0.2, 100  # ours: the first 20% of the steps; the paper reads its first 100
COLLAPSED_SETUP = 0.75  # ours: an early ACR this high means three groups in four teach nothing


def early_steps(steps: int) -> int:
    """The steps whose ACR is the run's early ACR: the first 20% (at least 1, at most 100)."""
    return max(1, min(EARLY_MAX_STEPS, math.ceil(EARLY_FRACTION * steps)))


def early_collapse(records: list[dict]) -> dict:
    """Mean raw ACR of these steps' metrics records, and its two ends (all-wrong, all-correct groups)."""
    mean = lambda key: sum(r[key] for r in records) / len(records)  # noqa: E731
    return {"early_steps": len(records), "early_acr": mean("acr"),
            "early_all_wrong_frac": mean("all_wrong_frac"),
            "early_all_correct_frac": mean("all_correct_frac")}


def collapse_warning(run_dir: Path, group_size: int) -> str | None:
    """One line when the early ACR (He et al.: it predicts the final accuracy) says the setup wastes its
    samples, naming the end that collapses and what to try; None otherwise."""
    early = early_collapse(read_jsonl(run_dir / "metrics.jsonl"))
    if early["early_acr"] < COLLAPSED_SETUP:
        return None
    wrong, right = early["early_all_wrong_frac"], early["early_all_correct_frac"]
    cause = (f"the task is too hard for this model, or G = {group_size} is too small to find a right answer: "
             "try an easier --dataset or level, a larger --group-size" if wrong >= right else
             "the task is too easy for this model: try a harder --dataset or level")
    return (f"warning: early ACR {early['early_acr']:.2f} over the first {early['early_steps']} steps "
            f"({wrong:.0%} of groups all-wrong, {right:.0%} all-correct), so most groups teach nothing; "
            f"{cause}, "
            "or --algo avspo or dapo")


def group_kinds(rewards: torch.Tensor) -> list[str]:
    """Each of the B groups of rewards [B, G] as one character: C all-correct, W all-wrong, = all equal
    otherwise, M mixed."""
    return ["C" if lo == 1 else "W" if hi == 0 else "=" if lo == hi else "M"
            for lo, hi in zip(rewards.amin(1).tolist(), rewards.amax(1).tolist())]


def group_map(first_rewards: torch.Tensor, advantages: torch.Tensor, replaced: torch.Tensor) -> dict:
    """The batch's B groups as strings, for a collapse map: how each group came out as first sampled
    (`group_kinds`), whether the method gave it a non-zero advantage (1/0), and whether dynamic sampling
    replaced its prompt (1/0)."""
    kinds = group_kinds(first_rewards)
    signal = (advantages.abs().amax(dim=1) >= 1e-6).tolist()  # as effective_collapse_rate's tau
    return {"groups_sampled": "".join(kinds), "groups_signal": "".join("01"[s] for s in signal),
            "groups_replaced": "".join("01"[r] for r in replaced.tolist())}


def step_metrics(rewards, advantages, rollout: Rollout, costs: dict, device) -> dict:
    """What a step logs about its whole batch (the names are documented in docs/metrics.md)."""
    completion_tokens, truncated, gen_tokens, timeouts = all_sum(
        [rollout.completion_mask.sum().item(), rollout.truncated.sum().item(), costs["gen_tokens"],
         costs.get("reward_timeouts", 0)], device)
    return {"reward_mean": rewards.mean().item(), "accuracy": (rewards == 1).float().mean().item(),
            "acr": advantage_collapse_rate(rewards), "acr_effective": effective_collapse_rate(advantages),
            "all_correct_frac": (rewards.amin(1) == 1).float().mean().item(),
            "all_wrong_frac": (rewards.amax(1) == 0).float().mean().item(),
            "adv_abs_mean": advantages.abs().mean().item(), "adv_std": advantages.std().item(),
            "completion_len": completion_tokens / rewards.numel(),
            "truncated_frac": truncated / rewards.numel(),
            "gen_tokens": int(gen_tokens), "gen_tokens_per_s": gen_tokens / costs["generate"],
            "time_generate": costs["generate"], "time_score": costs["score"],
            "reward_timeouts": int(timeouts), "peak_memory_bytes": peak_memory_bytes(device)}



def summarise_run(folder: Folder, algo: str, wall_seconds: float) -> dict:
    """Means over a finished run's steps, the steps that trained no row, its early collapse
    (`early_collapse`), and the `wall_seconds` of the process that finished it, from loading the model on,
    into summary.json."""
    rows, evals = read_jsonl(folder.path / "metrics.jsonl"), read_jsonl(folder.path / "evals.jsonl")
    mean = lambda key: sum(r[key] for r in rows) / len(rows)  # noqa: E731
    seconds = sum(r["time_generate"] + r["time_score"] + r["time_train"] for r in rows)
    summary = {"algo": algo, "acc_before": evals[0]["eval_accuracy"], "acc_after": evals[-1]["eval_accuracy"],
               "acr_mean": mean("acr"), "acr_effective_mean": mean("acr_effective"),
               "reward_mean": mean("reward_mean"), "seconds_per_step": seconds / len(rows),
               "steps_without_signal": sum(r["rows_trained"] == 0 for r in rows),
               **early_collapse(rows[: early_steps(len(rows))]), "time_run": wall_seconds}
    folder.write("summary.json", json.dumps(summary, indent=2))
    return summary


# ------------------------------------------------------------------------------ the training groups, in words

SAMPLE_CHARS, SAMPLE_GROUPS = 500, 8  # samples.jsonl's bounds: characters of a text, groups of a step
COLLAPSED = {"C": "all-correct", "W": "all-wrong", "=": "all-equal"}  # the collapsed `group_kinds`


def cut(text: str, limit: int) -> str:
    """At most `limit` characters; a cut text ends in an ellipsis."""
    return text if len(text) <= limit else text[: limit - 1] + "…"


def group_samples(step: int, problems: list[Problem], texts: list[str], first: int, rewards: torch.Tensor,
                  advantages: torch.Tensor, ref_rewards: torch.Tensor | None,
                  replaced: torch.Tensor) -> list[dict]:
    """samples.jsonl's records of a step: this process's groups as trained (at most SAMPLE_GROUPS), the
    `problems` and their G `texts` each, problems[0] being the batch's group `first`; rewards, advantages and
    AAPO's r_ref [B, G] are the batch's. Beside the method's advantages, GRPO's for the same rewards: the two
    differ where AVSPO's virtual rewards or AAPO's margin act. Texts are cut to SAMPLE_CHARS characters."""
    grpo, kinds, group_size = grpo_advantages(rewards), group_kinds(rewards), rewards.shape[1]  # [B, G]
    records = []
    for i, problem in enumerate(problems[:SAMPLE_GROUPS]):
        b = first + i
        records.append({
            "step": step, "group": b, "prompt": cut(problem.question, SAMPLE_CHARS),
            "gold": cut(problem.answer, SAMPLE_CHARS), "collapsed": COLLAPSED.get(kinds[b]),
            "rewards": rewards[b].tolist(), "advantages": [round(a, 4) for a in advantages[b].tolist()],
            "grpo_advantages": [round(a, 4) for a in grpo[b].tolist()],
            **({"ref_rewards": ref_rewards[b].tolist()} if ref_rewards is not None else {}),  # AAPO
            **({"resampled": True} if replaced[b] else {}),  # DAPO: a new prompt, in place of a collapsed one
            "completions": [cut(t, SAMPLE_CHARS) for t in texts[i * group_size : (i + 1) * group_size]]})
    return records


def show_group(algo: str, step: int, accuracy: float, samples: list[dict]) -> None:
    """At an evaluation, one of the step's training groups in words, a collapsed one where there is one: each
    completion on one line, its reward and advantage beside GRPO's for the same rewards."""
    group = next((s for s in samples if s["collapsed"]), samples[0])
    one_line = lambda text, limit: cut(" ".join(text.split()), limit)  # noqa: E731
    lines = [f"[{algo}] step {step}: held-out accuracy {accuracy:.3f}; a training group of this step, "
             f"{group['collapsed'] or 'mixed'}: {one_line(group['prompt'], 40)} "
             f"(gold {one_line(group['gold'], 20)})", "  reward  advantage  GRPO's  completion"]
    lines += [f"  {r:6.2f}  {a:+9.3f}  {g:+6.3f}  {one_line(text, 80)}" for r, a, g, text in
              zip(group["rewards"], group["advantages"], group["grpo_advantages"], group["completions"])]
    tqdm.write("\n".join(lines))

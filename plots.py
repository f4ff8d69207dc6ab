"""Plots of training runs: raw and effective ACR, reward, held-out accuracy and length over steps."""

from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt
import numpy as np

from common import read_jsonl

COLORS = {"grpo": "tab:blue", "avspo": "tab:orange", "aapo": "tab:green", "dapo": "tab:red"}


def smooth(values: list[float], window: int = 5) -> np.ndarray:
    """Trailing moving average: with 2 prompts a step, per-step ACR only takes the values 0, .5 and 1."""
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i - window + 1) : i + 1].mean() for i in range(len(values))])


def plot_training_curves(out_dir: Path, algos: list[str], path: Path | None = None) -> Path:
    """One figure comparing the algorithms run under out_dir/<algo>/ (metrics.jsonl, evals.jsonl)."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (ax_acr, ax_reward), (ax_eval, ax_len) = axes
    for algo in algos:
        rows, evals = read_jsonl(out_dir / algo / "metrics.jsonl"), read_jsonl(out_dir / algo / "evals.jsonl")
        steps, color = [r["step"] for r in rows], COLORS.get(algo)
        ax_acr.plot(steps, smooth([r["acr"] for r in rows]), color=color, label=f"{algo} raw ACR")
        ax_acr.plot(steps, smooth([r["acr_effective"] for r in rows]), color=color, ls="--",
                    label=f"{algo} effective ACR")
        ax_reward.plot(steps, smooth([r["reward_mean"] for r in rows]), color=color, label=algo)
        ax_eval.plot([e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", color=color, label=algo)
        ax_len.plot(steps, smooth([r["completion_len"] for r in rows]), color=color, label=algo)
    ax_acr.set(title="advantage collapse (5-step mean)", ylabel="fraction of groups", ylim=(-0.05, 1.05))
    ax_reward.set(title="batch reward (5-step mean)", ylabel="mean reward", ylim=(-0.05, 1.05))
    ax_eval.set(title="held-out accuracy (greedy)", ylabel="accuracy", xlabel="step", ylim=(-0.05, 1.05))
    ax_len.set(title="completion length (5-step mean)", ylabel="tokens", xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    path = path or out_dir / "curves.png"
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return path


def report_runs(out_dir: Path, summaries: list[dict]) -> None:
    """The closing table of train.py (one row per algorithm) and its comparison plot."""
    print(f"\n{'algo':6} {'acc before':>10} {'acc after':>10} {'ACR':>6} {'eff. ACR':>9} {'s/step':>7}")
    for s in summaries:
        print(f"{s['algo']:6} {s['acc_before']:10.3f} {s['acc_after']:10.3f} {s['acr_mean']:6.2f} "
              f"{s['acr_effective_mean']:9.2f} {s['seconds_per_step']:7.1f}")
    plot = plot_training_curves(out_dir, [s["algo"] for s in summaries])
    print(f"run folder: {out_dir.resolve()}\nplot: {plot.resolve()}")

"""Plots of training runs: raw and effective ACR, reward, held-out accuracy and length over steps."""

import io
import textwrap
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # files only, no screen needed
import matplotlib.pyplot as plt
import numpy as np

from infra.written import Folder
from loop.run_folder import PLOT, read_jsonl

COLORS = {"grpo": "tab:blue", "avspo": "tab:orange", "aapo": "tab:green", "dapo": "tab:red"}


def save_figure(fig, folder: Folder, name: str, dpi: int = 90, title: str | None = None) -> Path:
    """Lay out, write and close a figure (closing frees it: experiments draw many); returns its path. Drawn
    in memory, then written whole (`Folder.write`). A long title is wrapped to the figure's width (about 9
    characters an inch at the default font)."""
    if title:
        fig.suptitle(textwrap.fill(title, width=int(9 * fig.get_figwidth())))
    fig.tight_layout()
    png = io.BytesIO()
    fig.savefig(png, dpi=dpi, format="png")
    plt.close(fig)
    return folder.write(name, png.getvalue())


def smooth(values: list[float], window: int = 5) -> np.ndarray:
    """Trailing moving average: with 2 prompts a step, per-step ACR only takes the values 0, .5 and 1."""
    values = np.asarray(values, dtype=float)
    return np.array([values[max(0, i - window + 1) : i + 1].mean() for i in range(len(values))])


def plot_training_curves(out: Folder, algos: list[str], name: str = PLOT) -> Path:
    """One figure comparing the algorithms run under <out>/<algo>/ (metrics.jsonl, evals.jsonl), written to
    <out>/`name`."""
    fig, axes = plt.subplots(2, 2, figsize=(11, 7), sharex=True)
    (ax_acr, ax_reward), (ax_eval, ax_len) = axes
    for algo in algos:
        run_dir = out.path / algo
        rows, evals = read_jsonl(run_dir / "metrics.jsonl"), read_jsonl(run_dir / "evals.jsonl")
        steps, color = [r["step"] for r in rows], COLORS.get(algo)
        ax_acr.plot(steps, smooth([r["acr"] for r in rows]), color=color, label=f"{algo} raw ACR")
        ax_acr.plot(steps, smooth([r["acr_effective"] for r in rows]), color=color, ls="--",
                    label=f"{algo} effective ACR")
        ax_reward.plot(steps, smooth([r["reward_mean"] for r in rows]), color=color, label=algo)
        ax_eval.plot([e["step"] for e in evals], [e["eval_accuracy"] for e in evals], "o-", color=color,
                     label=algo)
        ax_len.plot(steps, smooth([r["completion_len"] for r in rows]), color=color, label=algo)
    ax_acr.set(title="advantage collapse (5-step mean)", ylabel="fraction of groups", ylim=(-0.05, 1.05))
    ax_reward.set(title="batch reward (5-step mean)", ylabel="mean reward", ylim=(-0.05, 1.05))
    ax_eval.set(title="held-out accuracy (greedy)", ylabel="accuracy", xlabel="step", ylim=(-0.05, 1.05))
    ax_len.set(title="completion length (5-step mean)", ylabel="tokens", xlabel="step")
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    return save_figure(fig, out, name)


def report_runs(out: Folder, summaries: list[dict]) -> None:
    """The closing table of train.py (one row per algorithm) and its comparison plot."""
    print(f"\n{'algo':6} {'acc before':>10} {'acc after':>10} {'ACR':>6} {'eff. ACR':>9} {'s/step':>7}")
    for s in summaries:
        print(f"{s['algo']:6} {s['acc_before']:10.3f} {s['acc_after']:10.3f} {s['acr_mean']:6.2f} "
              f"{s['acr_effective_mean']:9.2f} {s['seconds_per_step']:7.1f}")
    plot = plot_training_curves(out, [s["algo"] for s in summaries])
    print(f"run folder: {out.path.resolve()}\nplot: {plot.resolve()}")


# ------------------------------------------------------------------------------ experiments.py figures


def style(name: str) -> dict:
    """A method's colour from its algorithm (avspo-always: avspo's), dashed for a variant."""
    return {"color": COLORS.get(name.split("-")[0]), "ls": "--" if "-" in name else "-"}


def plot_difficulty(result: dict, folder: Folder, name: str, subtitle: str) -> None:
    """Stacked all-wrong / all-correct group fractions per level, with the sampled accuracy on top."""
    levels = list(result)
    wrong = [result[lv]["all_wrong_frac"] for lv in levels]
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(levels, wrong, color="tab:red", label="all wrong")
    ax.bar(levels, [result[lv]["all_correct_frac"] for lv in levels], bottom=wrong, color="tab:green",
           label="all correct")
    ax.plot(levels, [result[lv]["accuracy"] for lv in levels], "ko-", label="accuracy")
    ax.set(title=f"ACR before training ({subtitle})", xlabel="level (easy to hard; mix: all pooled)",
           ylabel="fraction of groups", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    save_figure(fig, folder, name)


def plot_compare_curves(runs: dict[str, list[Path]], folder: Folder, name: str, title: str) -> None:
    """Raw ACR, effective ACR and reward, mean over seeds, against steps (top) and tokens (bottom)."""
    panels = [("acr", "raw ACR"), ("acr_effective", "effective ACR"), ("reward_mean", "batch reward")]
    fig, axes = plt.subplots(2, 3, figsize=(14, 7))
    for method, dirs in runs.items():
        rows = [read_jsonl(d / "metrics.jsonl") for d in dirs]
        steps = [r["step"] for r in rows[0]]
        tokens = np.mean([[r["gen_tokens_total"] for r in run] for run in rows], axis=0)  # x: mean over seeds
        for col, (key, label) in enumerate(panels):
            curve = np.mean([smooth([r[key] for r in run]) for run in rows], axis=0)
            for ax, x, xlabel in ((axes[0, col], steps, "step"), (axes[1, col], tokens, "generated tokens")):
                ax.plot(x, curve, label=method, **style(method))
                ax.set(title=f"{label} (5-step mean, mean over seeds)", xlabel=xlabel, ylim=(-0.05, 1.05))
    for ax in axes.flat:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
    save_figure(fig, folder, name, dpi=80, title=title)


def plot_precision_curves(runs: dict[str, list[Path]], folder: Folder, name: str, title: str) -> None:
    """Held-out accuracy, batch reward and seconds per step against steps for each precision: every seed thin,
    the mean over seeds thick."""
    fig, axes = plt.subplots(1, 3, figsize=(15, 4.2))
    for (precision, dirs), color in zip(runs.items(), ("tab:blue", "tab:gray")):
        evals = [read_jsonl(d / "evals.jsonl") for d in dirs]
        rows = [read_jsonl(d / "metrics.jsonl") for d in dirs]
        curves = [([e["step"] for e in evals[0]], [[e["eval_accuracy"] for e in run] for run in evals]),
                  ([r["step"] for r in rows[0]], [smooth([r["reward_mean"] for r in run]) for run in rows]),
                  ([r["step"] for r in rows[0]],
                   [smooth([r["time_generate"] + r["time_score"] + r["time_train"] for r in run])
                    for run in rows])]
        for ax, (steps, per_seed) in zip(axes, curves):
            for seed_curve in per_seed:
                ax.plot(steps, seed_curve, color=color, alpha=0.25, lw=0.8)
            ax.plot(steps, np.mean(per_seed, axis=0), color=color, lw=2,
                    label=f"{precision}, mean of {len(dirs)} seeds")
    for ax, label in zip(axes, ("held-out accuracy (greedy)", "batch reward (5-step mean)",
                                "seconds per step (5-step mean)")):
        ax.set(title=label, xlabel="step")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    axes[0].set_ylim(-0.05, 1.05)
    axes[1].set_ylim(-0.05, 1.05)
    axes[2].set_ylim(bottom=0)
    save_figure(fig, folder, name, title=title)


def plot_accuracy_vs_compute(table: dict, folder: Folder, name: str, title: str) -> None:
    """Final accuracy against total generated tokens; Δ vs GRPO; accuracy per level: all with 95% CIs."""
    fig, (ax_cost, ax_delta, ax_level) = plt.subplots(1, 3, figsize=(16, 4.2))
    names = list(table)
    err = lambda x: [[x["mean"] - x["ci"][0]], [x["ci"][1] - x["mean"]]]  # noqa: E731
    for i, method in enumerate(names):
        row, color = table[method], style(method)["color"]
        cost = row["cost"]["gen_tokens"]
        ax_cost.errorbar(cost["mean"], row["accuracy"]["mean"], yerr=err(row["accuracy"]), xerr=cost["std"],
                         fmt="s" if "-" in method else "o", color=color, capsize=3, label=method)
        ax_delta.errorbar(i, row["delta"]["mean"], yerr=err(row["delta"]), fmt="o", color=color, capsize=4)
        levels = list(row["by_level"])
        width = 0.8 / len(names)
        for j, level in enumerate(levels):
            acc = row["by_level"][level]
            ax_level.bar(j + (i - len(names) / 2 + 0.5) * width, acc["mean"], width, color=color,
                         hatch="//" if "-" in method else None, yerr=err(acc), capsize=2,
                         label=method if j == 0 else None)
    ax_cost.set(title="final accuracy vs generated tokens (x: ± std over seeds)",
                xlabel="generated tokens per run",
                ylabel="held-out accuracy [95% CI]")
    ax_delta.axhline(0, color="k", lw=0.8)
    ax_delta.set(title="Δ accuracy vs GRPO, paired by seed [95% CI]", xticks=range(len(names)),
                 xticklabels=names,
                 ylabel="accuracy difference")
    ax_level.set(title="accuracy per level [95% CI]", xticks=range(len(levels)), xticklabels=levels,
                 ylabel="held-out accuracy", ylim=(0, 1.05))
    for ax in (ax_cost, ax_delta, ax_level):
        ax.grid(alpha=0.3)
    ax_cost.legend(fontsize=8)
    ax_level.legend(fontsize=7)
    save_figure(fig, folder, name, dpi=80, title=title)


def plot_early_acr_scatter(result: dict, folder: Folder, name: str, points: str = "GRPO runs") -> None:
    """The AVSPO paper's Figure 1 at small scale: colour = level, marker = group size, the fitted line."""
    markers = dict(zip(sorted({r["group_size"] for r in result["runs"]}), "ov^sDP*X"))
    levels = list(dict.fromkeys(r["level"] for r in result["runs"]))
    level_colors = {lv: plt.cm.viridis(i / max(1, len(levels) - 1)) for i, lv in enumerate(levels)}
    fig, ax = plt.subplots(figsize=(6.4, 4.4))
    for r in result["runs"]:
        ax.scatter(r["early_acr"], r["accuracy"], color=level_colors[r["level"]],
                   marker=markers[r["group_size"]],
                   alpha=0.8)
    for level, color in level_colors.items():
        ax.scatter([], [], color=color, label=level)
    for g, marker in markers.items():
        ax.scatter([], [], color="grey", marker=marker, label=f"G={g}")
    if np.isfinite(result["slope"]):
        x = np.array([min(r["early_acr"] for r in result["runs"]),
                      max(r["early_acr"] for r in result["runs"])])
        ax.plot(x, result["slope"] * x + result["intercept"], "k--", lw=1)
    ci = lambda v: f"[{v[0]:.2f}, {v[1]:.2f}]"  # noqa: E731
    within = result["within"]
    ax.set(title=f"{len(result['runs'])} {points}: slope {result['slope']:.2f} {ci(result['slope_ci'])}, "
                 f"R² = {result['r2']:.2f}; within levels {within['slope']:.2f} {ci(within['slope_ci'])}, "
                 f"R² = {within['r2']:.2f}",
           xlabel=f"early raw ACR (mean over the first 20% of steps; {result['distinct_early_acr']} values)",
           ylabel="final held-out accuracy")
    ax.title.set_fontsize(9)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    save_figure(fig, folder, name)


def plot_accuracy_vs_tokens(table: dict, folder: Folder, name: str, title: str) -> None:
    """Held-out accuracy at each of train.py's evaluations against the tokens generated by then: learning per
    unit of compute. Line: the mean over seeds; band: the lowest to the highest seed."""
    fig, ax = plt.subplots(figsize=(7.5, 4.6))
    for method, row in table.items():
        curve, look = row["curve"], style(method)
        ax.plot(curve["gen_tokens"], curve["accuracy"], marker="o", ms=3, label=method, **look)
        ax.fill_between(curve["gen_tokens"], curve["accuracy_low"], curve["accuracy_high"],
                        color=look["color"], alpha=0.12)
    ax.set(xlabel="generated tokens (policy, AAPO's reference, DAPO's resampling), mean over seeds",
           ylabel="held-out accuracy (greedy)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    save_figure(fig, folder, name, title=title)


KIND_COLORS = {"C": "tab:green", "W": "tab:red", "=": "gold", "M": "0.85"}  # group_map's kinds


def plot_collapse_map(runs: dict[str, Path], folder: Folder, name: str, title: str) -> None:
    """Steps x groups of one run per method, each group coloured by how it was first sampled (all-correct,
    all-wrong, mixed); a dot where a collapsed group still got a non-zero advantage (AVSPO's virtual rewards,
    AAPO's margin), a square where dynamic sampling replaced its prompt (DAPO)."""
    from matplotlib.colors import ListedColormap
    from matplotlib.patches import Patch

    kinds = list(KIND_COLORS)
    fig, axes = plt.subplots(len(runs), 1, figsize=(12, 1.35 * len(runs) + 1.2), sharex=True, squeeze=False)
    for ax, (method, run) in zip(axes[:, 0], runs.items()):
        rows = read_jsonl(run / "metrics.jsonl")
        grid = np.array([[kinds.index(k) for k in r["groups_sampled"]] for r in rows]).T  # [B, steps]
        ax.imshow(grid, aspect="auto", interpolation="nearest", vmin=-0.5, vmax=len(kinds) - 0.5,
                  cmap=ListedColormap(list(KIND_COLORS.values())),
                  extent=(0.5, len(rows) + 0.5, grid.shape[0] - 0.5, -0.5))
        cells = [(r["step"], g, r) for r in rows for g in range(len(r["groups_sampled"]))]
        rescued = [(s, g) for s, g, r in cells
                   if r["groups_sampled"][g] != "M" and r["groups_signal"][g] == "1"]
        replaced = [(s, g) for s, g, r in cells if r["groups_replaced"][g] == "1"]
        for points, marker in ((rescued, "o"), (replaced, "s")):
            if points:
                ax.scatter(*zip(*points), marker=marker, s=14, facecolors="k" if marker == "o" else "none",
                           edgecolors="k", linewidths=0.8)
        ax.set(ylabel=method, yticks=[])
    axes[-1, 0].set_xlabel("step")
    handles = [Patch(color=KIND_COLORS["C"], label="all correct"),
               Patch(color=KIND_COLORS["W"], label="all wrong"), Patch(color=KIND_COLORS["M"], label="mixed"),
               plt.Line2D([], [], color="k", marker="o", ls="", ms=4, label="collapsed, given signal"),
               plt.Line2D([], [], color="k", marker="s", ls="", ms=4, mfc="none", label="prompt replaced")]
    axes[0, 0].legend(handles=handles, fontsize=7, ncol=5, loc="lower left", bbox_to_anchor=(0, 1.02))
    save_figure(fig, folder, name, title=title)

"""Reproduce the papers' claims at small scale; writes the figures in docs/ and a results JSON.

    python experiments.py                     # everything, ~90 min on 2 CPU cores
    python experiments.py --only difficulty   # one part: difficulty, compare, variants, scatter
    python experiments.py --quick             # tiny model, a few steps: checks the pipeline in ~1 min

1. difficulty: ACR of the untrained model at each arithmetic level, split into all-correct/all-wrong.
2. compare:    GRPO vs AVSPO vs AAPO, same prompts, several seeds: raw/effective ACR, reward, accuracy.
3. variants:   AVSPO as in the released code (K = 1, always on) against the paper's adaptive K and threshold.
4. scatter:    early ACR (first steps) against final held-out accuracy over every run of 2 and 3.
"""

import argparse
import json
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import numpy as np
import torch
from tqdm import tqdm

import train
from advantage import advantage_collapse_rate
from data.tasks import LEVELS, load_problems
from model import load_model, sample
from common import read_jsonl
from plots import COLORS, smooth
from eval import score_groups
from verifier import verify

DOCS = Path(__file__).resolve().parent / "docs"
ALGOS = ["grpo", "avspo", "aapo"]
EARLY_STEPS = 10


def acr_by_difficulty(model_name: str, prompts: int, group_size: int, max_new_tokens: int, figures: Path,
                      batch: int = 8) -> dict:
    """Sample G completions for `prompts` training problems of each level with the untrained model."""
    model, tokenizer = load_model(model_name)
    torch.manual_seed(0)
    result = {}
    for level in LEVELS:
        problems = load_problems(f"arith-{level}", "train")[:prompts]
        rewards = []
        for i in tqdm(range(0, len(problems), batch), desc=level):
            chunk = problems[i : i + batch]
            rollout = sample(model, tokenizer, [p.question for p in chunk], group_size, max_new_tokens)
            rewards.append(torch.tensor(score_groups(rollout.texts, [p.answer for p in chunk], verify)))
        r = torch.cat(rewards)  # [prompts, G]
        result[level] = {"accuracy": r.mean().item(), "acr": advantage_collapse_rate(r),
                         "all_correct_frac": (r.amin(1) == 1).float().mean().item(),
                         "all_wrong_frac": (r.amax(1) == 0).float().mean().item(), "prompts": len(problems)}
        print(level, result[level])
    levels = list(result)
    fig, ax = plt.subplots(figsize=(6, 3.6))
    ax.bar(levels, [result[lv]["all_wrong_frac"] for lv in levels], color="tab:red", label="all wrong")
    ax.bar(levels, [result[lv]["all_correct_frac"] for lv in levels], color="tab:green", label="all correct",
           bottom=[result[lv]["all_wrong_frac"] for lv in levels])
    ax.plot(levels, [result[lv]["accuracy"] for lv in levels], "ko-", label="accuracy")
    ax.set(title=f"ACR before training ({model_name}, G={group_size}, T=1)", xlabel="level (easy to hard)",
           ylabel="fraction of groups", ylim=(0, 1.05))
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(figures / "acr_vs_difficulty.png", dpi=90)
    plt.close(fig)
    return result


def run_training(out: Path, seed: int, common: list[str], algos: str, extra: list[str] = ()) -> None:
    """One train.py invocation; skipped when its summaries already exist, so a rerun only fills gaps."""
    if all((out / a / "summary.json").exists() for a in algos.split(",")):
        return
    train.main(common + ["--algo", algos, "--seed", str(seed), "--out", str(out), *extra])


def summarise(run_dirs: list[Path]) -> dict:
    """Mean and spread over seeds of a set of runs of one algorithm."""
    summaries = [json.loads((d / "summary.json").read_text()) for d in run_dirs]
    out = {}
    for key in ("acc_before", "acc_after", "acr_mean", "acr_effective_mean", "reward_mean", "seconds_per_step"):
        values = [s[key] for s in summaries]
        out[key] = {"mean": float(np.mean(values)), "std": float(np.std(values)), "values": values}
    return out


def plot_comparison(runs: dict[str, list[Path]], path: Path, title: str) -> None:
    """Curves averaged over seeds (shaded: min to max) for each algorithm."""
    fig, axes = plt.subplots(1, 4, figsize=(16, 3.6))
    panels = [("acr", "raw ACR"), ("acr_effective", "effective ACR"), ("reward_mean", "batch reward")]
    for name, dirs in runs.items():
        color = COLORS.get(name.split("-")[0])
        ls = "--" if "-" in name else "-"
        rows = [read_jsonl(d / "metrics.jsonl") for d in dirs]
        steps = [r["step"] for r in rows[0]]
        for ax, (key, label) in zip(axes, panels):
            curves = np.array([smooth([r[key] for r in run]) for run in rows])
            ax.plot(steps, curves.mean(0), color=color, ls=ls, label=name)
            ax.fill_between(steps, curves.min(0), curves.max(0), color=color, alpha=0.15)
            ax.set(title=f"{label} (5-step mean)", xlabel="step", ylim=(-0.05, 1.05))
        evals = np.array([[e["eval_accuracy"] for e in read_jsonl(d / "evals.jsonl")] for d in dirs])
        eval_steps = [e["step"] for e in read_jsonl(dirs[0] / "evals.jsonl")]
        axes[3].errorbar(eval_steps, evals.mean(0), yerr=evals.std(0), color=color, ls=ls, marker="o", label=name)
        axes[3].set(title="held-out accuracy (greedy)", xlabel="step", ylim=(-0.05, 1.05))
    for ax in axes:
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=80)
    plt.close(fig)


def early_acr_scatter(run_dirs: list[Path], figures: Path) -> dict:
    """Early raw ACR (mean over the first EARLY_STEPS steps) against final held-out accuracy, with R^2."""
    x = [np.mean([r["acr"] for r in read_jsonl(d / "metrics.jsonl")[:EARLY_STEPS]]) for d in run_dirs]
    y = [read_jsonl(d / "evals.jsonl")[-1]["eval_accuracy"] for d in run_dirs]
    slope, intercept = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(np.mean(y)))
    residual = np.sum((np.array(y) - (slope * np.array(x) + intercept)) ** 2)
    total = np.sum((np.array(y) - np.mean(y)) ** 2)
    r2 = float(1 - residual / total) if total > 0 else 0.0
    fig, ax = plt.subplots(figsize=(5, 3.6))
    for d, xi, yi in zip(run_dirs, x, y):
        variant = "-k1" if d.parent.name.endswith("-k1") else ""
        ax.scatter(xi, yi, color=COLORS.get(d.name), marker="s" if variant else "o", label=d.name + variant)
    ax.plot(sorted(x), [slope * xi + intercept for xi in sorted(x)], "k--", lw=1)
    handles, labels = ax.get_legend_handles_labels()
    unique = dict(zip(labels, handles))
    ax.legend(unique.values(), unique.keys(), fontsize=8)
    ax.set(title=f"early ACR vs final accuracy ({len(x)} runs, R² = {r2:.2f})",
           xlabel=f"mean raw ACR, steps 1-{EARLY_STEPS}", ylabel="final held-out accuracy")
    fig.tight_layout()
    fig.savefig(figures / "early_acr_vs_accuracy.png", dpi=90)
    plt.close(fig)
    return {"r2": r2, "slope": float(slope), "points": [[float(a), float(b)] for a, b in zip(x, y)]}


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", default="runs/experiments")
    p.add_argument("--only", default="difficulty,compare,variants,scatter")
    p.add_argument("--seeds", default="0,1")
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--difficulty-prompts", type=int, default=48)
    p.add_argument("--figures", default="", help="where the PNGs go (default: docs/, or <out>/figures with --quick)")
    p.add_argument("--quick", action="store_true", help="tiny model, 2 steps, 4 prompts: checks the pipeline")
    args = p.parse_args(argv)
    out, parts, seeds = Path(args.out), args.only.split(","), [int(s) for s in args.seeds.split(",")]
    model = "tiny-qwen2" if args.quick else "smollm2-135m"
    steps, prompts = (2, 4) if args.quick else (args.steps, args.difficulty_prompts)
    common = ["--model", model, "--dataset", "arith-mul1", "--steps", str(steps), "--eval-every", "10",
              "--save-every", str(steps)] + (["--max-new-tokens", "8", "--eval-size", "4"] if args.quick else [])
    figures = Path(args.figures) if args.figures else (out / "figures" if args.quick else DOCS)
    figures.mkdir(parents=True, exist_ok=True)
    out.mkdir(parents=True, exist_ok=True)
    results_path = out / "results.json"
    results = json.loads(results_path.read_text()) if results_path.exists() else {}
    results["scale"] = {"model": model, "dataset": "arith-mul1", "steps": steps, "prompts_per_step": 2,
                        "group_size": 8, "seeds": seeds}
    if "difficulty" in parts:
        results["difficulty"] = acr_by_difficulty(model, prompts, 8, 8 if args.quick else 64, figures)
    if "compare" in parts:
        for seed in seeds:
            run_training(out / f"seed{seed}", seed, common, ",".join(ALGOS))
        runs = {a: [out / f"seed{s}" / a for s in seeds] for a in ALGOS}
        results["compare"] = {a: summarise(dirs) for a, dirs in runs.items()}
        plot_comparison(runs, figures / "compare.png", f"GRPO vs AVSPO vs AAPO, {model} on arith-mul1, seeds {seeds}")
    if "variants" in parts:
        released = ["--num-virtual", "1", "--acr-threshold", "0", "--fixed-threshold"]
        for seed in seeds:
            run_training(out / f"seed{seed}-k1", seed, common, "avspo", released)
        runs = {"avspo": [out / f"seed{s}" / "avspo" for s in seeds],
                "avspo-k1": [out / f"seed{s}-k1" / "avspo" for s in seeds]}
        results["variants"] = {name: summarise(dirs) for name, dirs in runs.items()}
        plot_comparison(runs, figures / "avspo_variants.png", "AVSPO: adaptive K and threshold vs K=1 always on")
    if "scatter" in parts:
        dirs = [d for d in sorted(out.glob("seed*/*")) if (d / "summary.json").exists()]
        results["scatter"] = early_acr_scatter(dirs, figures)
    results_path.write_text(json.dumps(results, indent=2))
    print(json.dumps({k: v for k, v in results.items() if k != "scatter"}, indent=1)[:3000])
    print(f"results: {results_path}\nfigures: {figures}")
    return results


if __name__ == "__main__":
    main()

"""The study's numbers from its runs' logs (accuracy with paired bootstrap CIs, collapse, cost, curves, the
early-ACR fit), and their markdown tables."""

import json
from pathlib import Path

import numpy as np

from data.tasks import level_order
from run_folder import read_jsonl
from stats import bootstrap_accuracy, interval, line_fit
from study_runs import ABLATIONS, BASELINE, LORA


def accuracy_table(correct: np.ndarray, levels: np.ndarray, names: list[str], resamples: int,
                   baseline: str = BASELINE) -> dict:
    """For each method: accuracy and Δ to `baseline` (paired), overall and per level, each with its 95% CI;
    for a method with ablations in ABLATIONS, also its overall Δ to each (paired the same way)."""
    boot, base = bootstrap_accuracy(correct, levels, resamples), names.index(baseline)
    table = {}
    for i, name in enumerate(names):
        row = {"accuracy": None, "delta": None, "by_level": {}, "delta_by_level": {}}
        for key, mask in ([("all", np.ones(len(levels), bool))]
                          + [(lv, levels == lv) for lv in level_order(levels)]):
            point = correct[:, :, mask].mean(axis=(1, 2))  # [M]
            acc, delta = interval(point[i], boot[key][:, i]), interval(point[i] - point[base],
                                                                         boot[key][:, i] - boot[key][:, base])
            if key == "all":
                row["accuracy"], row["delta"] = acc, delta
            else:
                row["by_level"][key], row["delta_by_level"][key] = acc, delta
        row["per_seed"] = correct[i].mean(axis=1).tolist()
        table[name] = row
    for name, ablations in ABLATIONS.items():
        for ablation in [a for a in ablations if name in names and a in names]:
            i, j = names.index(name), names.index(ablation)
            point = table[name]["accuracy"]["mean"] - table[ablation]["accuracy"]["mean"]
            table[name].setdefault("delta_vs_ablation", {})[ablation] = interval(
                point, boot["all"][:, i] - boot["all"][:, j])
    return table


def compute_cost(runs: list[Path]) -> dict:
    """What a method spent, mean (and std) over seeds: generated and trained tokens, seconds."""
    rows = [read_jsonl(d / "metrics.jsonl") for d in runs]
    values = {"gen_tokens": [r[-1]["gen_tokens_total"] for r in rows],
              "train_tokens": [r[-1]["train_tokens_total"] for r in rows],
              "seconds": [sum(x["time_generate"] + x["time_score"] + x["time_train"] for x in r)
                          for r in rows]}
    return {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "per_seed": v} for k, v in values.items()}


def collapse(runs: list[Path]) -> dict:
    """Mean over steps, then mean (and std) over seeds: the raw ACR (groups sampled all-equal) and the
    effective ACR (groups whose advantages are all zero after the method: what it left unused), over the whole
    run and over its first and last quarters of steps, and the last minus the first (late_rise: does collapse
    rise late in training, as AAPO says?); the all-correct and all-wrong fractions over its last quarter,
    where the papers place late collapse; for AVSPO, the share of steps its trigger fired. Also the share of
    steps whose gradient norm exceeded --max-grad-norm and was clipped: while the clip binds, signal given
    to collapsed groups shrinks the mixed groups' share of the step."""
    rows = [read_jsonl(d / "metrics.jsonl") for d in runs]
    max_norms = [json.loads((d / "config.json").read_text())["max_grad_norm"] for d in runs]
    quarter = -(-len(rows[0]) // 4)
    everything, first_quarter, last_quarter = slice(None), slice(None, quarter), slice(-quarter, None)
    spans = {"acr": ("acr", everything), "acr_effective": ("acr_effective", everything),
             "acr_effective_first_quarter": ("acr_effective", first_quarter),
             "acr_effective_last_quarter": ("acr_effective", last_quarter),
             "all_correct_frac": ("all_correct_frac", last_quarter),
             "all_wrong_frac": ("all_wrong_frac", last_quarter)}
    if "avspo_triggered" in rows[0][0]:  # AVSPO: the share of steps on which its trigger fired
        spans["avspo_triggered"] = ("avspo_triggered", everything)
    per_seed = {name: [float(np.mean([x[key] for x in r[span]])) for r in rows]
                for name, (key, span) in spans.items()}
    per_seed["late_rise"] = [last - first for first, last in zip(per_seed["acr_effective_first_quarter"],
                                                                 per_seed["acr_effective_last_quarter"])]
    per_seed["clipped"] = [float(np.mean([x["grad_norm"] > max_norm for x in r]))
                           for r, max_norm in zip(rows, max_norms)]
    return {k: {"mean": float(np.mean(v)), "std": float(np.std(v)), "per_seed": v}
            for k, v in per_seed.items()}


def seed_deltas(table: dict, resamples: int, seed: int = 0, baseline: str = BASELINE) -> None:
    """Add to each method's collapse and cost numbers a 95% bootstrap CI over the seeds ("ci"), and their
    difference to `baseline` paired by seed, with its CI ("delta"): for claims about collapse and cost, where
    each seed gives one number."""
    rng = np.random.default_rng(seed)
    seeds = len(table[baseline]["cost"]["seconds"]["per_seed"])
    picks = rng.integers(0, seeds, size=(resamples, seeds))  # [R, S]: the same draws for every number
    for row in table.values():
        for group in ("collapse", "cost"):
            for key, stat in row[group].items():
                values = np.array(stat["per_seed"])  # [S]
                stat["ci"] = interval(values.mean(), values[picks].mean(axis=1))["ci"]
                if key in table[baseline][group]:
                    diff = values - np.array(table[baseline][group][key]["per_seed"])  # [S]
                    stat["delta"] = interval(diff.mean(), diff[picks].mean(axis=1))


def accuracy_curves(runs: list[Path]) -> dict:
    """train.py's evaluations (the held-out prefix, greedy) against the steps and generated tokens spent by
    then: the mean over seeds, and the range of the seeds."""
    evals, rows = ([read_jsonl(d / "evals.jsonl") for d in runs],
                   [read_jsonl(d / "metrics.jsonl") for d in runs])
    steps = [e["step"] for e in evals[0]]
    for run, logged in zip(runs, evals):  # curves average the seeds step by step
        if (run_steps := [e["step"] for e in logged]) != steps:
            raise SystemExit(f"{run / 'evals.jsonl'}: evaluated at steps {run_steps}, "
                             f"not {steps} like {runs[0]}")
    tokens = [[0] + [r[s - 1]["gen_tokens_total"] for s in steps[1:]] for r in rows]  # [S][evals]
    accuracy = [[e["eval_accuracy"] for e in run] for run in evals]
    return {"steps": steps, "gen_tokens": np.mean(tokens, axis=0).tolist(),
            "accuracy": np.mean(accuracy, axis=0).tolist(), "accuracy_low": np.min(accuracy, axis=0).tolist(),
            "accuracy_high": np.max(accuracy, axis=0).tolist()}


def early_acr_scatter(runs: list[dict], resamples: int) -> dict:
    """Fit final accuracy = slope * early ACR + intercept over the runs; bootstrap CIs over runs."""
    x, y = np.array([r["early_acr"] for r in runs]), np.array([r["accuracy"] for r in runs])
    return {**line_fit(x, y, resamples), "distinct_early_acr": len(set(x.tolist())), "runs": runs}


def markdown_table(table: dict) -> str:
    """method | accuracy [95% CI] | Δ vs GRPO [95% CI] | per-level accuracy | collapse | AVSPO's trigger and
    the clipped steps (shares of steps) | costs."""
    levels = list(next(iter(table.values()))["by_level"])
    lines = [f"| method | accuracy [95% CI] | Δ vs {BASELINE.upper()} [95% CI] | {' / '.join(levels)} | "
             "raw / effective ACR | all-correct / all-wrong, last quarter | trigger | clipped "
             "| generated tokens | seconds |", "|---|---|---|---|---|---|---|---|---|---|"]
    for name, row in table.items():
        cost, acr = row["cost"], row["collapse"]
        by_level = " / ".join(f"{row['by_level'][lv]['mean']:.2f}" for lv in levels)
        trigger = f"{acr['avspo_triggered']['mean']:.2f}" if "avspo_triggered" in acr else "-"
        lines.append(f"| {name} | {with_ci(row['accuracy'])} | "
                     f"{'-' if name == BASELINE else with_ci(row['delta'], '+')} | "
                     f"{by_level} | {acr['acr']['mean']:.2f} / {acr['acr_effective']['mean']:.2f} | "
                     f"{acr['all_correct_frac']['mean']:.2f} / {acr['all_wrong_frac']['mean']:.2f} | "
                     f"{trigger} | {acr['clipped']['mean']:.2f} | "
                     f"{cost['gen_tokens']['mean']:,.0f} | {cost['seconds']['mean']:,.0f} |")
    return "\n".join(lines)


def with_ci(x: dict, sign: str = "") -> str:
    """An interval's mean [low, high], to 3 decimals (sign "+": signed, for a Δ)."""
    return f"{x['mean']:{sign}.3f} [{x['ci'][0]:{sign}.3f}, {x['ci'][1]:{sign}.3f}]"


def lora_table(result: dict) -> str:
    """arm | learning rate (the sweep's accuracies) | accuracy | Δ vs full fine-tuning | raw ACR | s/step |
    verdict on "matches"."""
    lines = [f"| arm | lr (sweep: lr accuracy) | accuracy [95% CI] | Δ vs {LORA[0]} [95% CI] | raw ACR | "
             f"s/step | matches (±{result['margin'] * 100:g} points) |", "|---|---|---|---|---|---|---|"]
    for arm, row in result["arms"].items():
        sweep = ", ".join(f"{lr} {a:.3f}" for lr, a in result["sweep"]["accuracy"][arm].items())
        lines.append(f"| {arm} | {row['lr']} ({sweep}) | {with_ci(row['accuracy'])} | "
                     f"{'-' if arm == LORA[0] else with_ci(row['delta'], '+')} | "
                     f"{row['collapse']['acr']['mean']:.2f} | {row['seconds_per_step']['mean']:.1f} | "
                     f"{row['verdict'] or '-'} |")
    return "\n".join(lines)


def pick_lr(accuracy: dict[str, float]) -> str:
    """The learning rate with the most accurate final model; the smaller of those that tie."""
    return max(sorted(accuracy, key=float), key=accuracy.__getitem__)  # max keeps the first of a tie


def print_results(results: dict, parts: list[str]) -> None:
    """The tables and fits of the parts that ran."""
    for part in ("compare", "readings", "lora"):
        if part in parts:
            print(f"\n{part}:\n" + results[f"{part}_table"])
    if "precision" in parts:
        for name, row in results["precision"].items():
            print(f"\n{name}: held-out accuracy {np.mean(row['acc_before']):.3f} -> "
                  f"{np.mean(row['acc_after']):.3f} "
                  f"(per seed {row['acc_after']}), {row['cost']['seconds']['mean']:.0f} s of steps a run")
    if "scatter" in parts:
        s = results["scatter"]
        print(f"\nearly ACR vs accuracy over {len(s['runs'])} runs: slope {s['slope']:.2f} {s['slope_ci']}, "
              f"R² {s['r2']:.2f} {s['r2_ci']}")

"""The study's numbers from its runs' logs (accuracy with paired bootstrap CIs, collapse, cost, curves, the
early-ACR fits), their markdown tables, and report.md: the papers' claims judged by the README's rule."""

import json
import math
from pathlib import Path

import numpy as np

from data.tasks import NO_LEVEL, level_order, load_problems, step_problems
from metrics import early_steps
from run_folder import RunFolderError, read_jsonl
from stats import bootstrap_accuracy, claim_verdict, interval, line_fit
from study_runs import ABLATIONS, BASELINE, LORA, final_records, held_out
from written import Folder


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


def early_acr_by_level(runs: dict[int, Path], config, per_level: int | None, resamples: int) -> dict:
    """AVSPO's Figure 1 (He et al., arXiv 2605.21125) from the compare runs of one method (GRPO), seed ->
    run: for each seed and level of the data, the early raw ACR of that level's groups and the final accuracy
    on that level's held-out problems; the line through these points with bootstrap CIs (`early_acr_scatter`).
    A group's level is its prompt's: each step's prompts follow from the seed and step alone
    (`data.tasks.step_problems`), in the order of metrics.jsonl's `groups_sampled` (C, W, =: collapsed)."""
    points = []
    for seed, run in runs.items():
        problems = load_problems(config.dataset, "train", seed)
        steps = read_jsonl(run / "metrics.jsonl")[: early_steps(config.steps)]
        collapsed, groups = {}, {}
        for record in steps:
            for problem, kind in zip(step_problems(problems, config.prompts_per_step, seed, record["step"]),
                                     record["groups_sampled"]):
                level = problem.level or NO_LEVEL
                groups[level] = groups.get(level, 0) + 1
                collapsed[level] = collapsed.get(level, 0) + (kind != "M")
        records = final_records(run, held_out(config, seed, per_level))
        for level in level_order(groups):
            answers = [r["correct"] for r in records if (r["level"] or NO_LEVEL) == level]
            if answers:  # a level with no held-out problem has no final accuracy
                points.append({"level": level, "group_size": config.group_size, "seed": seed,
                               "groups": groups[level], "early_acr": collapsed[level] / groups[level],
                               "accuracy": float(np.mean(answers))})
    return early_acr_scatter(points, resamples)


def fit_line(fit: dict) -> str:
    """A line's fit in words: its slope and R², each with its 95% CI (`stats.line_fit`)."""
    if not math.isfinite(fit["slope"]):
        return "no line: no spread in early ACR or accuracy"
    slope, r2 = fit["slope_ci"], fit["r2_ci"]
    return (f"slope {fit['slope']:.2f} [{slope[0]:.2f}, {slope[1]:.2f}], R² {fit['r2']:.2f} "
            f"[{r2[0]:.2f}, {r2[1]:.2f}]")


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
    if "compare" in parts and (fit := results.get("early_acr_by_level")):
        print(f"\nearly ACR vs accuracy by level, {len(fit['runs'])} (seed, level) points: {fit_line(fit)}")
    if "scatter" in parts:
        s = results["scatter"]
        print(f"\nearly ACR vs accuracy over {len(s['runs'])} runs: {fit_line(s)}")


# The papers' claims a compare study can speak to: (claim, method, measure, the claimed effect's least size)
CLAIMS = [("AVSPO (He et al., arXiv 2605.21125): +4 to +6 points over GRPO", "avspo", "accuracy", 0.04),
          ("AAPO (Xiong et al., arXiv 2505.14264): +2.5 to +4.6 points over GRPO", "aapo", "accuracy", 0.025),
          ("DAPO's dynamic sampling (Yu et al., 2025) beats GRPO", "dapo", "accuracy", 0.0),
          ("AVSPO: virtual rewards cut the collapsed groups by 58-63%", "avspo", "cut", 0.58),
          ("AAPO: GRPO's zero-advantage groups rise late in training", "grpo", "late rise", 0.0),
          ("AVSPO: early ACR predicts final accuracy (its R² 0.617)", "grpo", "early ACR", 0.0)]


def claim_rows(results: dict) -> list[str]:
    """The CLAIMS rows this study's compare results can judge (`stats.claim_verdict`): claim | measured here
    (95% CI) | verdict."""
    table, fit, rows = results["compare"], results.get("early_acr_by_level"), []
    points = lambda ci: f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"  # noqa: E731
    for claim, method, measure, claimed in CLAIMS:
        if method not in table or (measure != "late rise" and BASELINE not in table):
            continue
        if measure == "accuracy":
            delta = table[method]["delta"]
            said, ci, sign = f"{100 * delta['mean']:+.1f} {points(delta['ci'])} points", delta["ci"], 1
        elif measure == "cut":  # of the effective ACR, against GRPO's, its seeds' deltas over GRPO's mean
            stat = table[method]["collapse"]["acr_effective"]
            base = table[BASELINE]["collapse"]["acr_effective"]["mean"]
            ci, sign = [-x / base for x in reversed(stat["delta"]["ci"])], 1
            said = f"{-stat['delta']['mean'] / base:.0%} [{ci[0]:.0%}, {ci[1]:.0%}] (Δ / GRPO's {base:.2f})"
        elif measure == "late rise":
            rise = table[method]["collapse"]["late_rise"]
            said = f"{rise['mean']:+.2f} [{rise['ci'][0]:+.2f}, {rise['ci'][1]:+.2f}], last quarter - first"
            ci, sign = rise["ci"], 1
        elif fit and math.isfinite(fit["slope"]):  # early ACR: a higher one, a lower accuracy
            said, ci, sign = f"{fit_line(fit)} over {len(fit['runs'])} points", fit["slope_ci"], -1
        else:
            continue
        rows.append(f"| {claim} | {said} | **{claim_verdict(ci, claimed, sign)}** |")
    return rows


def report(results: dict, what: str) -> str:
    """report.md: the methods side by side, the early-ACR fit by level, and the claims this study judges."""
    lines = [f"# The study: {what}", "", "## The methods (95% CIs over seeds and problems)", "",
             results["compare_table"], ""]
    if fit := results.get("early_acr_by_level"):
        lines += ["## Early ACR against final accuracy, by level (AVSPO's Figure 1)", "",
                  f"{fit_line(fit)}, over {len(fit['runs'])} (GRPO seed, level) points", ""]
    lines += ["## The papers' claims", "", "Confirmed: the interval excludes no effect, on the claimed side; "
              "refuted: it excludes the claimed effect; inconclusive: it holds both.", "",
              "| claim | measured here (95% CI) | verdict |", "|---|---|---|", *claim_rows(results)]
    return "\n".join(lines) + "\n"


def results_so_far(figures: Folder, name: str) -> dict:
    """The results.json that experiments.py wrote in the figures' folder, which a study's parts update; a
    RunFolderError in one line where it is not results."""
    if not figures.ours(name):
        return {}
    try:
        results = json.loads((figures.path / name).read_text())
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise RunFolderError(f"{figures.path / name} is not JSON ({e}): restore it, or choose another "
                             "--figures") from None
    if not isinstance(results, dict):
        raise RunFolderError(f"{figures.path / name} holds a {type(results).__name__}, not results: "
                             "restore it, or choose another --figures")
    return results

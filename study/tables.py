"""The study's numbers from its runs' logs (accuracy with paired bootstrap CIs, collapse, cost, curves, the
early-ACR fits), their markdown tables, and report.md: the papers' claims judged by the README's rule."""

import json
import math
from pathlib import Path

import numpy as np

from data.tasks import NO_LEVEL, level_order, load_problems, step_problems
from infra.written import Folder
from loop.metrics import early_steps
from loop.run_folder import RunFolderError, read_jsonl
from study.flags import ABLATIONS, BASELINE, LORA
from study.runs import final_records, held_out
from study.stats import RULE, line_fit, mean_interval, no_information, seed_interval, verdict


def accuracy_table(correct: np.ndarray, levels: np.ndarray, problems: np.ndarray, names: list[str],
                   baseline: str = BASELINE) -> dict:
    """For each method: accuracy and Δ to `baseline` (paired), overall and per level, each with its 95%
    interval by the study's design (`stats.mean_interval`: correct [M, S, N]; `problems` [S, N], the problem
    at each position; `levels` [N], each position's level); for a method with ablations in ABLATIONS, also
    its overall Δ to each (paired the same way)."""
    base = names.index(baseline)
    table = {}
    for i, name in enumerate(names):
        row = {"accuracy": None, "delta": None, "by_level": {}, "delta_by_level": {}}
        for key, mask in ([("all", np.ones(len(levels), bool))]
                          + [(lv, levels == lv) for lv in level_order(levels)]):
            acc = mean_interval(correct[i][:, mask], problems[:, mask])
            delta = mean_interval(correct[i][:, mask] - correct[base][:, mask], problems[:, mask])
            if key == "all":
                row["accuracy"], row["delta"] = acc, delta
            else:
                row["by_level"][key], row["delta_by_level"][key] = acc, delta
        row["per_seed"] = correct[i].mean(axis=1).tolist()
        table[name] = row
    for name, ablations in ABLATIONS.items():
        for ablation in [a for a in ablations if name in names and a in names]:
            i, j = names.index(name), names.index(ablation)
            table[name].setdefault("delta_vs_ablation", {})[ablation] = mean_interval(correct[i] - correct[j],
                                                                                      problems)
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


def seed_deltas(table: dict, baseline: str = BASELINE) -> None:
    """Add to each method's collapse and cost numbers a 95% t interval over the seeds ("ci"), and their
    difference to `baseline` paired by seed, with its interval ("delta"; `stats.seed_interval`): for claims
    about collapse and cost, where each seed gives one number."""
    for row in table.values():
        for group in ("collapse", "cost"):
            for key, stat in row[group].items():
                values = np.array(stat["per_seed"])  # [S]
                stat["ci"] = seed_interval(values)["ci"]
                if key in table[baseline][group]:
                    stat["delta"] = seed_interval(values - np.array(table[baseline][group][key]["per_seed"]))


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


def early_acr_scatter(runs: list[dict]) -> dict:
    """Fit final accuracy = slope * early ACR + intercept over the runs, pooled (the paper's claim) and
    within each level (`stats.line_fit`): how much of the pooled fit is the levels' difference."""
    x, y = np.array([r["early_acr"] for r in runs]), np.array([r["accuracy"] for r in runs])
    fit = line_fit(x, y, np.array([r["level"] for r in runs]))
    return {**fit, "distinct_early_acr": len(set(x.tolist())), "runs": runs}


def early_acr_by_level(runs: dict[int, Path], config, per_level: int | None) -> dict:
    """AVSPO's Figure 1 (He et al., arXiv 2605.21125) from the compare runs of one method (GRPO), seed ->
    run: for each seed and level of the data, the early raw ACR of that level's groups and the final accuracy
    on that level's held-out problems; the line through these points, pooled and within levels
    (`early_acr_scatter`).
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
    return early_acr_scatter(points)


def fit_line(fit: dict) -> str:
    """A line's fit in words (`stats.line_fit`): pooled, its slope with its 95% interval and R²; within the
    levels, the same; and the R² of the levels alone."""
    if not math.isfinite(fit["slope"]):
        return "no line: no spread in early ACR or accuracy"
    slope, within = fit["slope_ci"], fit["within"]
    said = f"pooled: slope {fit['slope']:.2f} [{slope[0]:.2f}, {slope[1]:.2f}], R² {fit['r2']:.2f}"
    if not math.isfinite(within["slope"]):
        return f"{said}; within levels: no line"
    low, high = within["slope_ci"]
    return (f"{said}; within levels: slope {within['slope']:.2f} [{low:.2f}, {high:.2f}], R² "
            f"{within['r2']:.2f}; the level alone: R² {fit['r2_groups']:.2f}")


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


# The papers' claims a compare study can speak to: (claim, method, measure, the region claimed for the effect)
CLAIMS = [("AVSPO (He et al., arXiv 2605.21125): +4 to +6 points over GRPO (at least +4)", "avspo",
           "accuracy", (0.04, math.inf)),
          ("AAPO (Xiong et al., arXiv 2505.14264): +2.5 to +4.6 points over GRPO (at least +2.5)", "aapo",
           "accuracy", (0.025, math.inf)),
          ("DAPO's dynamic sampling (Yu et al., 2025) beats GRPO", "dapo", "accuracy", (0.0, math.inf)),
          ("AVSPO: virtual rewards cut the collapsed groups by 58-63% (at least 58%)", "avspo", "cut",
           (0.58, math.inf)),
          ("AAPO: GRPO's zero-advantage groups rise late in training", "grpo", "late rise", (0.0, math.inf)),
          ("AVSPO: early ACR predicts final accuracy (its R² 0.617): a negative slope", "grpo", "early ACR",
           (-math.inf, 0.0))]


def judged(ci: list[float], region: tuple[float, float], why_not: str | None) -> str:
    """A claim's verdict (`stats.verdict`), or "no information" and why (`stats.no_information`)."""
    return f"no information: {why_not}" if why_not else verdict(ci, region)


def claim_rows(results: dict) -> list[str]:
    """The CLAIMS rows this study's compare results can judge: claim | measured here (95% interval) |
    verdict (`judged`)."""
    table, fit, rows = results["compare"], results.get("early_acr_by_level"), []
    points = lambda ci: f"[{100 * ci[0]:+.1f}, {100 * ci[1]:+.1f}]"  # noqa: E731
    for claim, method, measure, region in CLAIMS:
        if method not in table or (measure != "late rise" and BASELINE not in table):
            continue
        if measure == "accuracy":
            delta = table[method]["delta"]
            said, ci = f"{100 * delta['mean']:+.1f} {points(delta['ci'])} points", delta["ci"]
            why_not = no_information(*(np.array(table[m]["per_seed"]) for m in (method, BASELINE)))
        elif measure == "cut":  # of the effective ACR, against GRPO's: its seeds' Δ over GRPO's mean
            stat, base = (table[m]["collapse"]["acr_effective"] for m in (method, BASELINE))
            ci = [-x / base["mean"] for x in reversed(stat["delta"]["ci"])]
            said = (f"{-stat['delta']['mean'] / base['mean']:.1%} [{ci[0]:.1%}, {ci[1]:.1%}] (Δ / GRPO's "
                    f"{base['mean']:.3f})")
            why_not = no_information(np.array(stat["per_seed"]), np.array(base["per_seed"]))
        elif measure == "late rise":
            acr = table[method]["collapse"]
            rise = acr["late_rise"]
            said = f"{rise['mean']:+.3f} [{rise['ci'][0]:+.3f}, {rise['ci'][1]:+.3f}], last quarter - first"
            ci = rise["ci"]
            why_not = no_information(*(np.array(acr[f"acr_effective_{q}_quarter"]["per_seed"])
                                       for q in ("first", "last")))
        elif fit and math.isfinite(fit["slope"]):  # early ACR: a higher one, a lower accuracy
            said, ci, why_not = f"{fit_line(fit)}, over {len(fit['runs'])} points", fit["slope_ci"], None
        else:
            continue
        said_of_it = judged(ci, region, why_not)
        rows.append(f"| {claim} | {said} | {said_of_it if why_not else f'**{said_of_it}**'} |")
    return rows


def design_note(table: dict) -> str:
    """What report.md's intervals are, by the study's design and seeds."""
    row = next(iter(table.values()))
    seeds, design = len(row["per_seed"]), row["accuracy"]["design"]
    how = ("each seed drew its own held-out problems (nested): a t interval over the per-seed means, with "
           f"{seeds - 1} degrees of freedom" if design == "nested" else
           "every seed answered the same problems (crossed, one test file): the seeds' spread plus the "
           "problems' shared part (two-way analysis of variance), with Satterthwaite's degrees of freedom; "
           "more seeds cannot narrow the problems' part")
    note = f"Design: {how}. Per-seed numbers (collapse, cost): a t interval over the {seeds} seeds."
    if seeds == 2:
        note += (" With 2 seeds each interval rests on 1 degree of freedom (t quantile 12.7): wide, and it "
                 "covers 83-97% of simulated studies rather than 95% (tests/test_stats.py).")
    return note


def report(results: dict, what: str, data: str) -> str:
    """report.md: the data (`data_line`), the methods side by side, the early-ACR fit by level, and the claims
    this study judges."""
    lines = [f"# The study: {what}", "", data, "",
             "## The methods (95% intervals over seeds and problems)", "",
             design_note(results["compare"]), "", results["compare_table"], ""]
    if fit := results.get("early_acr_by_level"):
        lines += ["## Early ACR against final accuracy, by level (AVSPO's Figure 1)", "",
                  f"{fit_line(fit)}, over {len(fit['runs'])} (GRPO seed, level) points", ""]
    lines += ["## The papers' claims", "", RULE, "",
              "| claim | measured here (95% interval) | verdict |", "|---|---|---|", *claim_rows(results)]
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

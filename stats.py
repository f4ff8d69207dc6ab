"""The study's statistics (experiments.py): bootstrap intervals for accuracies and their paired differences,
the verdict on a claim, a line's fit with its intervals, and the planner's expected interval width. Pure:
arrays in, numbers out, no files and no model.

Every interval is a percentile 95% bootstrap over what varies between studies: the training seeds, and the
held-out problems within each seed (stratified by level). Two methods are compared paired, on the same draws.
"""

import math

import numpy as np

Z95 = 1.959963984540054  # the normal's 97.5% quantile: a 95% interval is the mean +- Z95 standard errors


def bootstrap_accuracy(correct: np.ndarray, levels: np.ndarray, resamples: int = 2000, seed: int = 0) -> dict:
    """Bootstrap accuracies [R, M] of M methods from correct [M, S, N] (seeds x held-out problems, 0/1).

    Each resample draws S seeds with replacement, and within each drawn seed N problems with replacement,
    stratified by level (the test split is). Every method sees the same draws, so a difference between two
    methods is paired by seed and by problem. Returns {"all": [R, M], level: [R, M] for each level}.
    """
    rng = np.random.default_rng(seed)
    m, s, n = correct.shape
    seeds = rng.integers(0, s, size=(resamples, s))  # [R, S]
    problems = np.empty((resamples, s, n), dtype=int)  # [R, S, N]: stays within each level's positions
    for level in dict.fromkeys(levels):
        where = np.flatnonzero(levels == level)
        problems[:, :, where] = rng.choice(where, size=(resamples, s, len(where)))
    picked = correct[:, seeds[:, :, None], problems]  # [M, R, S, N]
    out = {"all": picked.mean(axis=(2, 3)).T}
    for level in dict.fromkeys(levels):
        out[level] = picked[..., levels == level].mean(axis=(2, 3)).T
    return out


def interval(point: float, samples: np.ndarray) -> dict:
    """Point estimate (on the data as observed) with the percentile 95% CI of its bootstrap samples."""
    low, high = np.percentile(samples, [2.5, 97.5])
    return {"mean": float(point), "ci": [float(low), float(high)], "half_width": float(high - low) / 2}


def verdict(delta: dict, margin: float) -> str:
    """Whether Δ's 95% interval says two arms match, as the README's claims are judged: confirmed when it
    excludes a difference of `margin` either way, refuted when it excludes every difference under it."""
    low, high = delta["ci"]
    if -margin < low and high < margin:
        return "confirmed"
    return "refuted" if high < -margin or low > margin else "inconclusive"


def claim_verdict(ci: list[float], claimed: float, sign: int = 1) -> str:
    """A paper's claim of an effect of at least `claimed` (sign -1: a fall, of at least `claimed`), judged by
    the effect's 95% interval as the README judges its claims: refuted when it excludes the claimed effect
    (a cut of 27-52% against a claimed 58%); else confirmed when it excludes no effect, on the claimed side;
    inconclusive when it holds both."""
    low, high = sorted(sign * x for x in ci)
    if high < claimed:
        return "refuted"
    return "confirmed" if low > 0 else "inconclusive"


def line_fit(x: np.ndarray, y: np.ndarray, resamples: int, seed: int = 0) -> dict:
    """y = slope * x + intercept by least squares, its R^2, and bootstrap 95% CIs of the slope and R^2 over
    the points (resampled with replacement). No spread in x or y: no line (NaN); a resample that drew one x
    value alone has none either and is left out of the intervals."""
    def fit(x: np.ndarray, y: np.ndarray) -> tuple[float, float, float]:
        if np.ptp(x) == 0 or np.ptp(y) == 0:  # a flat y has R^2 undefined
            return math.nan, math.nan, math.nan
        slope, intercept = np.polyfit(x, y, 1)
        return slope, intercept, 1 - np.sum((y - slope * x - intercept) ** 2) / np.sum((y - y.mean()) ** 2)

    slope, intercept, r2 = fit(x, y)
    rng = np.random.default_rng(seed)
    boot = np.array([fit(x[i], y[i]) for i in rng.integers(0, len(x), size=(resamples, len(x)))])  # [R, 3]

    def ci(col: int) -> list[float]:
        finite = boot[np.isfinite(boot[:, col]), col]
        return [float(v) for v in np.percentile(finite, [2.5, 97.5])] if len(finite) else [math.nan, math.nan]

    return {"slope": float(slope), "slope_ci": ci(0), "intercept": float(intercept), "r2": float(r2),
            "r2_ci": ci(2)}


# ------------------------------------------------------------------------------ the planner's width
# A paired Δ between two methods, per seed s: Δ_s = δ + u_s + e_s. u_s is what training on seed s adds
# (variance `seed_var`), e_s the evaluation's noise on N problems: the mean of N per-problem differences
# d_i in {-1, 0, 1} (variance `problem_var` / N; 2p(1-p) for two independent methods of accuracy p, less when
# they err on the same problems). The bootstrap above resamples the seeds, whose spread holds both parts,
# and the problems again within each seed, so its variance of the mean Δ over S seeds is
#     ((S - 1) / S) (seed_var + problem_var / N) / S  +  problem_var / (N S)
# ((S - 1) / S: a bootstrap over S values is that much narrower than their standard error). Its 95% half
# width is Z95 times the root (tests/test_stats.py checks it against the bootstrap on simulated studies).


def expected_half_width(seeds: int, problems: int, problem_var: float, seed_var: float) -> float:
    """The 95% half width that `bootstrap_accuracy` gives a paired Δ over `seeds` seeds and `problems`
    held-out problems (the model above)."""
    per_seed = seed_var + problem_var / problems
    return Z95 * math.sqrt(((seeds - 1) / seeds * per_seed + problem_var / problems) / seeds)


def decision_probability(seeds: int, margin: float, problems: int, problem_var: float, seed_var: float,
                         true_delta: float = 0.0) -> float:
    """The chance that a study of `seeds` seeds decides a claim of ±margin (`verdict` says confirmed or
    refuted, not inconclusive) when Δ's true value is `true_delta`: the observed Δ is normal around it, with
    the model's standard error over seeds, sqrt((seed_var + problem_var / N) / S), and the interval is it
    +- `expected_half_width`. Confirmed: |Δ| + width < margin; refuted: |Δ| - width > margin."""
    width = expected_half_width(seeds, problems, problem_var, seed_var)
    se = math.sqrt((seed_var + problem_var / problems) / seeds)
    if se == 0:
        return float(abs(true_delta) < margin - width or abs(true_delta) > margin + width)

    def below(x: float) -> float:  # P(observed Δ < x)
        return 0.5 * (1 + math.erf((x - true_delta) / (se * math.sqrt(2))))

    confirm = max(0.0, below(margin - width) - below(width - margin))
    refute = 1 - below(margin + width) + below(-margin - width)
    return confirm + refute


def seeds_to_decide(margin: float, problems: int, problem_var: float, seed_var: float,
                    true_delta: float = 0.0, power: float = 0.8, most: int = 1000) -> int | None:
    """The fewest seeds (2 or more) that decide a claim of ±margin with probability `power` when Δ's true
    value is `true_delta` (`decision_probability`); None if `most` do not."""
    return next((s for s in range(2, most + 1) if decision_probability(
        s, margin, problems, problem_var, seed_var, true_delta) >= power), None)


def variance_parts(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(problem_var, seed_var) of the paired Δ of method b against a, from their correct [S, N] (0/1) on the
    same seeds and problems: the per-problem differences' variance within a seed, averaged over seeds; and
    the spread of the per-seed Δ beyond what evaluation noise explains (at least 0; 0 from one seed)."""
    d = b.astype(float) - a.astype(float)  # [S, N] in {-1, 0, 1}
    problem_var = float(d.var(axis=1).mean())
    if len(d) < 2:
        return problem_var, 0.0
    return problem_var, max(0.0, float(d.mean(axis=1).var(ddof=1)) - problem_var / d.shape[1])

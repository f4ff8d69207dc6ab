"""The study's statistics (experiments.py, study/plan.py): 95% intervals for accuracies, their paired
differences and the per-seed numbers (collapse, cost), a line's fit, the verdict on a claim, and the planner's
power. Pure: arrays in, numbers out, no files and no model.

What an interval is about: the population that the training seeds and the held-out problems are drawn from.
The seed is the unit that varies between studies (Colas et al., arXiv 1806.08295), and the problems are a
sample too (Miller, arXiv 2411.00640). They are either nested in the seeds (each seed draws its own held-out
problems: arith-mix) or crossed with them (one fixed test file, every seed the same problems: MATH-500);
`design` reads which from the problems' identities. A score x[s, i] (0/1, or a paired difference b - a in
{-1, 0, 1}) is modelled as

    x[s, i] = mu + u_s + v_i + e_si,   with variances seed_var, problem_var, noise_var

and its mean over S seeds and N problems has the variance seed_var / S + problem_var / N + noise_var / (S N).
Nested, v_i is drawn afresh with each seed and belongs with e_si (problem_var 0): the S per-seed means are
independent, and the interval is a t interval over them with S - 1 degrees of freedom. Crossed, v_i is shared
by every seed, so no number of seeds averages it away: a two-way analysis of variance estimates each part,
and the interval is a t interval with Satterthwaite's degrees of freedom. tests/test_stats.py measures the
coverage of both on simulated studies of either design, and on the committed runs.
"""

import math

import numpy as np
from scipy import stats as sp

# ------------------------------------------------------------------------------ intervals by design


def design(problems: np.ndarray) -> str:
    """"crossed" where every seed of `problems` [S, N] (each position's problem identity) holds the same
    problems, as one test file gives; else "nested" (each seed its own draw, however many coincide)."""
    rows = np.sort(problems, axis=1)  # [S, N]: a seed's problems in one order
    return "crossed" if len(rows) > 1 and (rows == rows[0]).all() else "nested"


def two_way(x: np.ndarray, problems: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Crossed: x's mean squares (MS_seed, MS_problem, MS_noise), [...] each, of x [..., S, N], each problem's
    column aligned across the seeds first. Their expectations: N seed_var + noise_var, S problem_var +
    noise_var, and noise_var."""
    s, n = x.shape[-2:]
    x = x[..., np.arange(s)[:, None], np.argsort(problems, axis=1, kind="stable")]  # column i: one problem
    seed_means, problem_means = x.mean(axis=-1), x.mean(axis=-2)  # [..., S], [..., N]
    grand = x.mean(axis=(-2, -1))[..., None, None]
    noise = x - seed_means[..., :, None] - problem_means[..., None, :] + grand  # [..., S, N]
    return (n * seed_means.var(axis=-1, ddof=1), s * problem_means.var(axis=-1, ddof=1),
            (noise ** 2).sum(axis=(-2, -1)) / ((s - 1) * (n - 1)))


def crossed_terms(ms_seed: np.ndarray, ms_problem: np.ndarray, ms_noise: np.ndarray, s: int,
                  n: int) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """The variance of a crossed mean as two terms (`mean_squares`): the seeds' spread as nested sees it,
    MS_seed / (S N) = seed_var / S + noise_var / (S N), and the problems' shared part, (MS_problem -
    MS_noise) / (S N) = problem_var / N, at least 0, with Satterthwaite's degrees of freedom."""
    shared = np.maximum(ms_problem - ms_noise, 0.0)  # [...]
    with np.errstate(invalid="ignore", divide="ignore"):
        shared_df = shared ** 2 / (ms_problem ** 2 / (n - 1) + ms_noise ** 2 / ((s - 1) * (n - 1)))
    return [(1 / (s * n), ms_seed, np.asarray(s - 1.0)),
            (1 / (s * n), shared, np.where(shared > 0, shared_df, 1.0))]


def mean_squares(x: np.ndarray, problems: np.ndarray) -> list[tuple[float, np.ndarray, np.ndarray]]:
    """The terms (coefficient, mean square, degrees of freedom) whose sum estimates the variance of x's mean
    (x [S, N], or [..., S, N]: many studies of one layout at once), by `design`. Nested: the per-seed means'
    variance over S, with S - 1 degrees of freedom. Crossed: `crossed_terms`."""
    s, n = x.shape[-2:]
    if design(problems) == "nested":
        return [(1 / s, x.mean(axis=-1).var(axis=-1, ddof=1), np.asarray(s - 1.0))]
    return crossed_terms(*two_way(x, problems), s, n)


def t_half_width(terms: list[tuple]) -> np.ndarray:
    """The half width of a 95% t interval whose variance is the sum of `terms` (coefficient, mean square,
    degrees of freedom; arrays: one study each), with Satterthwaite's degrees of freedom."""
    var = sum(c * np.asarray(ms, dtype=float) for c, ms, _ in terms)
    with np.errstate(invalid="ignore", divide="ignore"):  # no spread at all: a width of 0
        df = var ** 2 / sum((c * np.asarray(ms, dtype=float)) ** 2 / df for c, ms, df in terms)
        return np.where(var > 0, sp.t.ppf(0.975, np.maximum(df, 1e-9)) * np.sqrt(var), 0.0)


def mean_interval(x: np.ndarray, problems: np.ndarray) -> dict:
    """x's mean (x [S, N], seeds x problems; `problems` the problem at each position) with its 95% interval
    by the study's design; one seed has none (NaN)."""
    mean = float(x.mean())
    if len(x) < 2:
        return {"mean": mean, "ci": [math.nan, math.nan], "half_width": math.nan, "design": design(problems)}
    half = float(t_half_width(mean_squares(x.astype(float), problems)))
    return {"mean": mean, "ci": [mean - half, mean + half], "half_width": half, "design": design(problems)}


def delta_interval(a: np.ndarray, b: np.ndarray, problems: np.ndarray) -> tuple:
    """The 95% interval (low, high) of Δ = mean(b) - mean(a), for a and b [S, N] (0/1) of two methods on the
    same seeds and problems (`problems` [S, N]: the problem at each position), paired, by the study's design.
    a and b [..., S, N]: many studies of one layout at once, low and high [...] each."""
    d = b.astype(float) - a.astype(float)  # [..., S, N]
    mean, half = d.mean(axis=(-2, -1)), t_half_width(mean_squares(d, problems))
    return mean - half, mean + half


def seed_interval(values: np.ndarray) -> dict:
    """The mean of one number per seed (values [S]: an ACR, a cost, a paired difference of them) with its 95%
    t interval over the seeds (S - 1 degrees of freedom): `mean_interval` of S seeds of one problem each."""
    values = np.asarray(values, dtype=float)
    out = mean_interval(values[:, None], np.arange(len(values))[:, None])
    del out["design"]
    return out


# ------------------------------------------------------------------------------ the verdict


def no_information(*per_seed: np.ndarray) -> str | None:
    """Why no interval over these runs can judge a claim, or None: the measure's inputs (each [S] or [S, N],
    one a seed) come from fewer than 2 seeds, or each sits at its floor or ceiling (0 or 1) in every run
    (every group all-wrong, accuracy 0 everywhere, a trigger that fired at every step), where a result holds
    by construction."""
    if any(len(values) < 2 for values in per_seed):
        return "fewer than 2 seeds: no spread between seeds to measure"
    if all(np.all(np.asarray(v) == 0) or np.all(np.asarray(v) == 1) for v in per_seed):
        return "at its floor or ceiling in every run: the result holds by construction"
    return None


RULE = ("Each claim names a region for the effect (at least +4 points; a cut of at least 58%; a fall; a "
        "match within ±2.5 points). Confirmed: the 95% interval lies inside the region; refuted: it lies "
        "wholly outside it; inconclusive: it holds the region's edge. No information, and no verdict: the "
        "measure sits at its floor or ceiling in every run, or fewer than 2 seeds ran.")


def verdict(ci: list[float], region: tuple[float, float]) -> str:
    """A claim that the effect lies in the open `region` (low, high), judged by the effect's 95% interval,
    as RULE says (its ends: math.inf). Check `no_information` first."""
    low, high = ci
    if region[0] < low and high < region[1]:
        return "confirmed"
    return "refuted" if high < region[0] or low > region[1] else "inconclusive"


# ------------------------------------------------------------------------------ a line


def line_fit(x: np.ndarray, y: np.ndarray, groups: np.ndarray | None = None) -> dict:
    """y = slope * x + intercept by least squares over the points, its R², and the slope's 95% t interval
    (n - 2 degrees of freedom). With `groups` (each point's level), also the fit within the groups: x and y
    less their group's mean, its slope with a t interval (n - groups - 1 degrees of freedom) and R², and the
    R² of the groups alone (the share of y's variance between the groups). No spread in x or y: no line."""
    x, y = np.asarray(x, dtype=float), np.asarray(y, dtype=float)
    nan = {"slope": math.nan, "slope_ci": [math.nan, math.nan], "intercept": math.nan, "r2": math.nan}
    if len(x) < 3 or np.ptp(x) == 0 or np.ptp(y) == 0:  # a flat y has R² undefined
        return nan if groups is None else {**nan, "within": dict(nan), "r2_groups": math.nan}
    fit = sp.linregress(x, y)
    half = sp.t.ppf(0.975, len(x) - 2) * fit.stderr
    out = {"slope": float(fit.slope), "slope_ci": [fit.slope - half, fit.slope + half],
           "intercept": float(fit.intercept), "r2": float(fit.rvalue ** 2)}
    if groups is None:
        return out
    names = np.unique(groups, return_inverse=True)[1]  # [n]: each point's group's index
    centred = [v - (np.bincount(names, v) / np.bincount(names))[names] for v in (x, y)]
    sxx, sxy, syy = (centred[0] ** 2).sum(), (centred[0] * centred[1]).sum(), (centred[1] ** 2).sum()
    df = len(x) - names.max() - 2
    if sxx == 0 or syy == 0 or df < 1:
        return {**out, "within": dict(nan), "r2_groups": float(1 - syy / ((y - y.mean()) ** 2).sum())}
    slope = sxy / sxx
    residual = syy - slope * sxy
    half = sp.t.ppf(0.975, df) * math.sqrt(residual / df / sxx)
    within = {"slope": float(slope), "slope_ci": [slope - half, slope + half], "intercept": math.nan,
              "r2": float(1 - residual / syy)}
    return {**out, "within": within, "r2_groups": float(1 - syy / ((y - y.mean()) ** 2).sum())}


# ------------------------------------------------------------------------------ the planner
# The planner draws studies of the model above from the variance parts (`variance_parts`) and runs the
# interval's own arithmetic on each (`t_half_width`): the mean is normal around the true Δ; each mean square
# is its expectation times a chi-square over its degrees of freedom. tests/test_stats.py checks its power
# against whole simulated studies of 0/1 answers.

PLAN_DRAWS = 20_000  # simulated studies per figure: the power's Monte Carlo error is at most 0.004 (1 sd)


def variance_parts(x: np.ndarray, problems: np.ndarray) -> dict:
    """The parts of x [S, N]'s variance (the paired differences, say), floored at 0: {"design", "seed_var",
    "problem_var", "noise_var"}. Nested, a problem's own part cannot be told from the noise: problem_var 0."""
    s, n = x.shape
    if design(problems) == "nested":
        noise = float(x.var(axis=1, ddof=1).mean()) if n > 1 else 0.0
        seed = float(x.mean(axis=1).var(ddof=1)) - noise / n if s > 1 else 0.0
        return {"design": "nested", "seed_var": max(0.0, seed), "problem_var": 0.0, "noise_var": noise}
    ms_seed, ms_problem, noise = (float(ms) for ms in two_way(x.astype(float), problems))
    return {"design": "crossed", "seed_var": max(0.0, (ms_seed - noise) / n),
            "problem_var": max(0.0, (ms_problem - noise) / s), "noise_var": noise}


def as_design(parts: dict, target: str) -> tuple[dict, str]:
    """Variance parts measured on one design, for a study of design `target`, and what was assumed. Nested
    data cannot tell a problem's shared part from its noise: for a crossed study all of it is taken as
    shared (the widest interval); crossed data's shared part is noise to a nested study."""
    if parts["design"] == target:
        return parts, ""
    if target == "crossed":
        return ({**parts, "design": target, "problem_var": parts["noise_var"], "noise_var": 0.0},
                "; measured on a nested design, its problems' noise is taken as shared by the seeds (the "
                "widest case): your own finished runs would measure the split")
    return {**parts, "design": target, "problem_var": 0.0,
            "noise_var": parts["noise_var"] + parts["problem_var"]}, ""


def simulated_intervals(seeds: int, problems: int, parts: dict,
                        true_delta: float = 0.0) -> tuple[np.ndarray, np.ndarray]:
    """(estimates, half widths), [PLAN_DRAWS] each: the intervals that studies of `seeds` seeds and
    `problems` problems of this design and variance would report (the model above). The same draws for
    every call: the planner's figures do not move between runs, and a count of seeds compares with the next
    on common draws."""
    rng, draws = np.random.default_rng(0), PLAN_DRAWS
    seed_var, problem_var, noise_var = parts["seed_var"], parts["problem_var"], parts["noise_var"]
    s, n = seeds, problems
    sd = math.sqrt(seed_var / s + problem_var / n + noise_var / (s * n))
    estimates = true_delta + sd * rng.standard_normal(draws)

    def square(expected: float, df: float) -> np.ndarray:
        return expected * rng.chisquare(df, draws) / df

    if parts["design"] == "nested":
        terms = [(1 / s, square(seed_var + (problem_var + noise_var) / n, s - 1), s - 1)]
    else:
        noise_df = (s - 1) * (n - 1)
        terms = crossed_terms(square(n * seed_var + noise_var, s - 1),
                              square(s * problem_var + noise_var, n - 1), square(noise_var, noise_df), s, n)
    return estimates, t_half_width(terms)


def expected_half_width(seeds: int, problems: int, parts: dict) -> float:
    """The mean 95% half width that studies of `seeds` seeds and `problems` problems would report."""
    return float(np.mean(simulated_intervals(seeds, problems, parts)[1]))


def decision_probability(seeds: int, margin: float, problems: int, parts: dict,
                         true_delta: float = 0.0) -> float:
    """The chance that a study of `seeds` seeds and `problems` problems decides "matches within ±margin"
    (`verdict` confirmed or refuted, not inconclusive) when Δ's true value is `true_delta`."""
    estimates, half = simulated_intervals(seeds, problems, parts, true_delta)
    inside = (np.abs(estimates) + half < margin)
    outside = (estimates - half > margin) | (estimates + half < -margin)
    return float(np.mean(inside | outside))


def seeds_to_decide(margin: float, problems: int, parts: dict, true_delta: float = 0.0,
                    power: float = 0.8, most: int = 200) -> int | None:
    """The fewest seeds (2 or more) that decide ±margin with probability `power` (`decision_probability`);
    None if `most` do not, or if no number of seeds can: crossed, the problems' shared part sets a floor
    on the width, problem_var / N, that seeds do not narrow."""
    floor = sp.norm.ppf(0.975) * math.sqrt(parts["problem_var"] / problems)  # the width at infinite seeds
    if abs(abs(true_delta) - margin) < floor:
        return None
    return next((s for s in range(2, most + 1)
                 if decision_probability(s, margin, problems, parts, true_delta) >= power), None)


def problems_to_decide(seeds: int, margin: float, problems: int, parts: dict, true_delta: float = 0.0,
                       power: float = 0.8, most: int = 1 << 16) -> int | None:
    """The fewest problems, `problems` doubled as often as needed, that decide ±margin over `seeds` seeds
    with probability `power`; None if `most` do not."""
    n = problems
    while n <= most:
        if decision_probability(seeds, margin, n, parts, true_delta) >= power:
            return n
        n *= 2
    return None

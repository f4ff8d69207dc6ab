"""study/stats.py, the study's statistics: the coverage of every interval report.md prints, measured on
simulated studies of both designs where the truth is known, and on the committed runs under a sign-flip null;
the verdict rule; the planner's power against the procedure it plans.

Coverage is counted over K simulated studies; a 95% interval's count has a Monte Carlo error of
sqrt(0.95 * 0.05 / K), and each test states its band."""

import math
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given
from hypothesis import strategies as st
from scipy import stats as sp

from loop.run_folder import read_jsonl
from study import stats

K = 2000  # simulated studies a cell
TOLERANCE = 2 * math.sqrt(0.95 * 0.05 / K)  # 0.0097: two Monte Carlo standard errors
BAND = (0.93 - TOLERANCE, 0.97 + TOLERANCE)  # the 93-97%, widened by the Monte Carlo error


def layout(design: str, seeds: int, problems: int) -> np.ndarray:
    """problems [S, N]: each position's problem, every seed the same ones (crossed) or its own (nested)."""
    if design == "crossed":
        return np.tile(np.arange(problems), (seeds, 1))
    return np.arange(seeds * problems).reshape(seeds, problems)


def simulated_studies(rng: np.random.Generator, studies: int, design: str, seeds: int, problems: int,
                      seed_mix: float, delta: float = 0.03) -> tuple[np.ndarray, np.ndarray, float, float]:
    """(a, b, true Δ, a's true accuracy): two methods' answers [K, S, N] (0/1). Problem i is right with
    probability pi_i ~ U(0.05, 0.9) under method a and rho_i = (pi_i + pi'_i) / 2 + delta under b (pi'_i
    another draw: the problems differ in what b gains on them, a part that crossed seeds share). A training
    seed pulls each method towards its own level, A_s, B_s ~ Beta(2, 2), by `seed_mix`: the seeds' share of
    the variance runs from nothing (0) to dominant (0.4 at N = 336). Every probability stays in [0, 1], so
    the truths are exact: Δ = (1 - mix) delta, a's accuracy (1 - mix) 0.475 + mix 0.5."""
    shape = (studies, 1 if design == "crossed" else seeds, problems)  # crossed: one draw of problems
    pi = rng.uniform(0.05, 0.9, shape)
    rho = (pi + rng.uniform(0.05, 0.9, shape)) / 2 + delta
    a_level, b_level = rng.beta(2, 2, (2, studies, seeds, 1))
    a = rng.random((studies, seeds, problems)) < (1 - seed_mix) * pi + seed_mix * a_level
    b = rng.random((studies, seeds, problems)) < (1 - seed_mix) * rho + seed_mix * b_level
    return a.astype(float), b.astype(float), (1 - seed_mix) * delta, (1 - seed_mix) * 0.475 + seed_mix * 0.5


def coverage(low: np.ndarray, high: np.ndarray, truth: float) -> float:
    return float(np.mean((low <= truth) & (truth <= high)))


def measured(design: str, seeds: int) -> dict[tuple[int, float], tuple[float, float]]:
    """(N, seed_mix) -> the coverage of Δ's interval and of a's accuracy's (`stats.delta_interval` against
    zeros: the same interval of one method's mean), over K studies each."""
    out = {}
    for problems in (13, 336):
        for mix in (0.0, 0.1, 0.4):
            rng = np.random.default_rng([seeds, problems, int(10 * mix)])
            a, b, delta, accuracy = simulated_studies(rng, K, design, seeds, problems, mix)
            where = layout(design, seeds, problems)
            out[problems, mix] = (coverage(*stats.delta_interval(a, b, where), delta),
                                  coverage(*stats.delta_interval(np.zeros_like(a), a, where), accuracy))
    return out


@pytest.mark.parametrize("design", ["nested", "crossed"])
@pytest.mark.parametrize("seeds", [3, 5, 10])
def test_the_accuracy_and_delta_intervals_cover_95_percent_on_either_design(design, seeds):
    """S = 3, 5, 10 seeds, N = 13 and 336 problems, the seeds' share from none to dominant: Δ's and an
    accuracy's 95% intervals cover the truth 93-97% of the time (within the Monte Carlo error). The
    per-level intervals are the same function on a level's columns."""
    cells = measured(design, seeds)
    outside = {cell: c for cell, c in cells.items() if not all(BAND[0] <= x <= BAND[1] for x in c)}
    assert not outside, f"{design}, S = {seeds}: coverage (Δ, accuracy) outside {BAND}: {outside}"


@pytest.mark.parametrize("design", ["nested", "crossed"])
def test_two_seeds_give_a_wide_interval_that_still_covers_most_studies(design):
    """S = 2: the t quantile of 1 degree of freedom (12.7) makes the interval wide; it covers 83-97% (the
    note's figure: per-seed means of 13 problems are far from normal), never under 80%."""
    cells = measured(design, 2)
    assert min(min(c) for c in cells.values()) >= 0.80, cells
    assert sp.t.ppf(0.975, 1) > 3 * sp.t.ppf(0.975, 4)


def test_a_nested_delta_interval_is_the_t_interval_over_the_per_seed_differences():
    """An outside check: scipy's one-sample t test over the S per-seed Δs gives the same interval."""
    rng = np.random.default_rng(0)
    a, b = (rng.random((2, 5, 40)) < 0.4).astype(float)
    per_seed = b.mean(axis=1) - a.mean(axis=1)  # [S]
    expected = sp.ttest_1samp(per_seed, 0).confidence_interval(0.95)
    assert stats.delta_interval(a, b, layout("nested", 5, 40)) == pytest.approx(tuple(expected))
    assert stats.seed_interval(per_seed)["ci"] == pytest.approx(list(expected))


def test_the_design_is_read_from_the_problems_identities():
    """The same problems in any order in every seed: crossed; one problem that differs, or one seed: nested.
    A crossed interval aligns each problem across the seeds, whatever the order it was evaluated in."""
    rng = np.random.default_rng(1)
    crossed = np.array([rng.permutation(["p1", "p2", "p3", "p4"]) for _ in range(3)])
    assert stats.design(crossed) == "crossed"
    other = crossed.copy()
    other[2, 0] = "p9"
    assert stats.design(other) == stats.design(crossed[:1]) == "nested"
    x = (rng.random((3, 4)) < 0.5).astype(float)
    order = np.argsort(crossed, axis=1)
    same = np.take_along_axis(x, order, axis=1)  # every seed's answers in p1..p4 order
    assert stats.mean_interval(x, crossed) == stats.mean_interval(same, layout("crossed", 3, 4))


def test_seed_level_intervals_cover_95_percent_on_skewed_per_seed_values():
    """A number per seed (a clipped share, an ACR, a late rise): values from Beta(2, 5) and their paired
    differences; the t interval over S = 3, 5, 10 seeds covers the mean 93-97% (4,000 studies)."""
    rng, studies = np.random.default_rng(2), 4000
    band = (0.93 - 2 * math.sqrt(0.95 * 0.05 / studies), 0.97 + 2 * math.sqrt(0.95 * 0.05 / studies))
    for seeds in (3, 5, 10):
        values = rng.beta(2, 5, (studies, seeds))
        mean, half = values.mean(axis=1), stats.t_half_width(
            stats.mean_squares(values[:, :, None], layout("nested", seeds, 1)))
        assert band[0] <= coverage(mean - half, mean + half, 2 / 7) <= band[1], seeds
        one = stats.seed_interval(values[0])
        assert one["ci"] == pytest.approx([mean[0] - half[0], mean[0] + half[0]])


# ------------------------------------------------------------------------------ on the committed runs

RUNS = Path(__file__).resolve().parent.parent / "runs" / "experiments"


def committed_differences() -> np.ndarray:
    """[U, N]: every committed paired difference against GRPO, a seed at a time (compare's four methods and
    the readings' five arms, 5 seeds each: 45 rows of 336 problems), from their final_eval.jsonl."""
    rows = []
    for part in ("compare", "readings"):
        for base in sorted((RUNS / part).glob("seed*-grpo")):
            seed = base.name.split("-")[0]
            grpo = [r["correct"] for r in read_jsonl(base / "final_eval.jsonl")]
            for other in sorted((RUNS / part).glob(f"{seed}-*")):
                if other != base:
                    rows.append(np.array([r["correct"] for r in read_jsonl(other / "final_eval.jsonl")],
                                         dtype=float) - grpo)
    return np.array(rows)


def test_the_intervals_cover_a_sign_flip_null_built_from_the_committed_runs():
    """The real paired differences, each seed's row and its negation, form a population whose Δ is exactly
    0: studies of S of its seeds, drawn at random, and each problem's sign flipped for the crossed reading
    (its problems shared), cover 0 93-97% of the time at S = 3, 5, 10."""
    rows = committed_differences()
    assert rows.shape == (45, 336)
    population = np.concatenate([rows, -rows])  # [2U, N]: mean exactly 0
    rng = np.random.default_rng(3)
    for seeds in (3, 5, 10):
        d = population[rng.integers(0, len(population), (K, seeds))]  # [K, S, N]
        for design in ("nested", "crossed"):
            if design == "crossed":
                d = d * rng.choice([-1.0, 1.0], (K, 1, d.shape[2]))  # a problem's part, shared by the seeds
            low, high = stats.delta_interval(np.zeros_like(d), d, layout(design, seeds, d.shape[2]))
            assert BAND[0] <= coverage(low, high, 0.0) <= BAND[1], (seeds, design)


# ------------------------------------------------------------------------------ the line


@pytest.mark.parametrize("groups", [None, 5])
def test_the_slope_interval_covers_95_percent_pooled_and_within_groups(groups):
    """25 points (5 groups of 5, as (seed, level) points), y = -0.3 x + the group's level + noise; the
    slope's 95% t interval covers -0.3 93-97% of 1,000 fits."""
    rng, covered, fits = np.random.default_rng(4), 0, 1000
    band = (0.93 - 2 * math.sqrt(0.95 * 0.05 / fits), 0.97 + 2 * math.sqrt(0.95 * 0.05 / fits))
    names = np.repeat(np.arange(5), 5)
    for _ in range(fits):
        x = rng.random(25) + (0.2 * names if groups else 0)
        y = -0.3 * x + (rng.normal(0, 0.3, 5)[names] if groups else 0) + rng.normal(0, 0.1, 25)
        fit = stats.line_fit(x, y, names if groups else None)
        low, high = (fit["within"] if groups else fit)["slope_ci"]
        covered += low <= -0.3 <= high
    assert band[0] <= covered / fits <= band[1]


def test_a_line_is_recovered_exactly_and_no_spread_is_no_line():
    x = np.linspace(0, 1, 9)
    fit = stats.line_fit(x, 0.9 - 0.5 * x)
    assert math.isclose(fit["slope"], -0.5) and math.isclose(fit["r2"], 1.0)
    assert fit["slope_ci"] == pytest.approx([-0.5, -0.5])
    flat = stats.line_fit(x, np.full(9, 0.3))
    assert math.isnan(flat["slope"]) and all(map(math.isnan, flat["slope_ci"]))


@pytest.mark.parametrize("points", [0, 1, 2])
def test_fewer_than_three_points_are_no_line_pooled_or_within_groups(points):
    """A study of one step, one seed and one method can give the early-ACR fit by level no point at all (no
    level both trained and held out; np.ptp of an empty array raises, issue 72 says). No line, no error."""
    x, names = np.linspace(0, 1, points), np.arange(points)
    fit = stats.line_fit(x, 1 - x, names)
    assert all(math.isnan(f["slope"]) and all(map(math.isnan, f["slope_ci"])) for f in (fit, fit["within"]))
    assert math.isnan(fit["r2_groups"])


def test_the_fit_within_groups_separates_what_the_groups_explain():
    """Points whose y is set by their group alone, and x too: the pooled fit is strong, the groups explain
    all of y, and within the groups there is no slope."""
    names = np.repeat(np.arange(3), 4)
    x = names + np.tile([0.0, 0.1, 0.2, 0.3], 3)
    y = -0.3 * names + np.tile([0.01, -0.01, -0.01, 0.01], 3)
    fit = stats.line_fit(x, y, names)
    assert fit["r2"] > 0.95 and fit["r2_groups"] > 0.99
    assert fit["within"]["slope"] == pytest.approx(0.0, abs=1e-12)
    assert fit["within"]["slope_ci"][0] < 0 < fit["within"]["slope_ci"][1]


# ------------------------------------------------------------------------------ the verdict


@pytest.mark.parametrize("ci, region, expected", [
    ([0.01, 0.05], (0.04, math.inf), "inconclusive"), ([-0.0985, 0.0235], (0.025, math.inf), "refuted"),
    ([0.05, 0.07], (0.04, math.inf), "confirmed"), ([0.181, 0.586], (0.58, math.inf), "inconclusive"),
    ([-0.30, -0.10], (-math.inf, 0.0), "confirmed"), ([0.01, 0.2], (-math.inf, 0.0), "refuted"),
    ([0.0, 0.1], (0.0, math.inf), "inconclusive"), ([-0.02, 0.01], (-0.025, 0.025), "confirmed"),
    ([-0.03, 0.01], (-0.025, 0.025), "inconclusive"), ([0.03, 0.05], (-0.025, 0.025), "refuted")])
def test_a_claim_is_confirmed_inside_its_region_refuted_outside_and_inconclusive_across_an_edge(ci, region,
                                                                                               expected):
    assert stats.verdict(ci, region) == expected


@given(st.floats(-1, 1), st.floats(0, 1), st.floats(0, 1), st.floats(-1, 1))
def test_moving_an_interval_into_the_claim_never_turns_the_verdict_against_it(low, width, shift, edge):
    """Raising the interval (more effect) towards a claim of at least `edge` moves its verdict only towards
    confirmed; a claim of a fall is the same claim mirrored; a narrower interval inside a decided one is
    decided the same way."""
    rank = {"refuted": 0, "inconclusive": 1, "confirmed": 2}
    before = stats.verdict([low, low + width], (edge, math.inf))
    assert rank[stats.verdict([low + shift, low + width + shift], (edge, math.inf))] >= rank[before]
    assert stats.verdict([-low - width, -low], (-math.inf, -edge)) == before
    if before != "inconclusive":
        assert stats.verdict([low + width / 4, low + 3 * width / 4], (edge, math.inf)) == before


def test_a_measure_at_its_floor_or_ceiling_in_every_run_or_one_seed_gives_no_information():
    """Every group all-wrong (GRPO's effective ACR 1) and a trigger that fired at every step (AVSPO's 0): the
    cut is 100% by construction; accuracy 0 in every run of both methods; one seed. Any spread informs."""
    assert "by construction" in stats.no_information(np.ones(2), np.zeros(2))
    assert "by construction" in stats.no_information(np.zeros((2, 13)), np.zeros((2, 13)))
    assert "fewer than 2 seeds" in stats.no_information(np.array([0.4]), np.array([0.5]))
    assert stats.no_information(np.zeros((2, 13)), np.eye(2, 13)) is None
    assert stats.no_information(np.array([0.5, 0.6]), np.ones(2)) is None


# ------------------------------------------------------------------------------ the planner


@pytest.mark.parametrize("design, seeds, problems, mix, delta", [("nested", 5, 336, 0.1, 0.0),
                                                                 ("nested", 10, 112, 0.0, 0.03),
                                                                 ("crossed", 5, 336, 0.1, 0.0),
                                                                 ("crossed", 3, 500, 0.0, 0.03)])
def test_the_planners_power_is_the_procedures_on_whole_simulated_studies(design, seeds, problems, mix, delta):
    """The chance that a study decides ±2.5 points, by `stats.decision_probability` from the true variance
    parts, against K whole studies of 0/1 answers run through `stats.delta_interval`: within 0.04 (the
    answers are not normal, and the parts are estimated from 8 studies' pooled answers)."""
    rng = np.random.default_rng([seeds, problems])
    where = layout(design, seeds, problems)
    a, b, true_delta, _ = simulated_studies(rng, K, design, seeds, problems, mix, delta)
    low, high = stats.delta_interval(a, b, where)
    decided = np.mean((np.maximum(-low, high) < 0.025) | (low > 0.025) | (high < -0.025))
    parts = [stats.variance_parts(b[k] - a[k], where) for k in range(8)]
    mean_parts = {"design": design, **{key: np.mean([p[key] for p in parts])
                                       for key in ("seed_var", "problem_var", "noise_var")}}
    predicted = stats.decision_probability(seeds, 0.025, problems, mean_parts, true_delta)
    assert predicted == pytest.approx(decided, abs=0.04)


def test_variance_parts_recover_the_model_and_identical_methods_have_none():
    rng = np.random.default_rng(5)
    problem_effect = rng.normal(0, 0.3, 400)  # [N]: crossed, shared by the seeds
    x = 0.2 + rng.normal(0, 0.1, (6, 1)) + problem_effect + rng.normal(0, 0.5, (6, 400))  # [S, N]
    parts = stats.variance_parts(x, layout("crossed", 6, 400))
    assert parts["noise_var"] == pytest.approx(0.25, rel=0.05)
    assert parts["problem_var"] == pytest.approx(problem_effect.var(), rel=0.2)
    assert stats.variance_parts(x, layout("nested", 6, 400))["problem_var"] == 0.0
    zero = stats.variance_parts(np.zeros((3, 20)), layout("nested", 3, 20))
    assert (zero["seed_var"], zero["noise_var"]) == (0.0, 0.0)


def test_where_the_problems_set_the_floor_no_number_of_seeds_is_advised_but_problems_are():
    """Crossed, a shared problem part of 0.03 over 13 problems: the width at infinite seeds is ±9 points,
    so no seeds decide ±2.5; the test set needs more problems. Nested, seeds do."""
    parts = {"design": "crossed", "seed_var": 0.0001, "problem_var": 0.03, "noise_var": 0.4}
    assert stats.seeds_to_decide(0.025, 13, parts) is None
    needed = stats.problems_to_decide(5, 0.025, 13, parts)
    assert needed is not None and needed > 13
    assert stats.decision_probability(5, 0.025, needed, parts) >= 0.8
    assert stats.decision_probability(5, 0.025, needed // 2, parts) < 0.8
    nested = {**parts, "design": "nested", "problem_var": 0.0}
    seeds = stats.seeds_to_decide(0.025, 336, nested)
    assert seeds is not None and stats.decision_probability(seeds, 0.025, 336, nested) >= 0.8
    assert stats.decision_probability(seeds - 1, 0.025, 336, nested) < 0.8

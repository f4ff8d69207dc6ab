"""stats.py, the study's statistics: properties (hypothesis), the bootstrap against known truths, and the
planner's interval width against the bootstrap on simulated studies."""

import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import stats

LEVELS = np.array(["easy"] * 20 + ["hard"] * 30)


def synthetic_correct(rng: np.random.Generator, methods: int, seeds: int, p_easy: float = 0.8,
                      p_hard: float = 0.3) -> np.ndarray:
    """correct [M, S, N]: independent 0/1 answers, easy problems right with p_easy, hard ones with p_hard."""
    p = np.where(LEVELS == "easy", p_easy, p_hard)
    return (rng.random((methods, seeds, len(LEVELS))) < p).astype(float)


def test_bootstrap_ci_covers_the_true_accuracy():
    """Over 100 synthetic experiments (5 seeds x 50 problems) the 95% CI covers the true accuracy >= 90% of
    the time (the two-stage bootstrap counts the problem noise twice, so it errs on the wide side)."""
    rng, truth, covered = np.random.default_rng(2), (20 * 0.8 + 30 * 0.3) / 50, 0
    for trial in range(100):
        boot = stats.bootstrap_accuracy(synthetic_correct(rng, 1, 5), LEVELS, resamples=300, seed=trial)
        low, high = np.percentile(boot["all"][:, 0], [2.5, 97.5])
        covered += low <= truth <= high
    assert covered >= 90


def test_bootstrap_is_deterministic_and_stratified():
    correct = synthetic_correct(np.random.default_rng(3), 2, 3)
    a, b = (stats.bootstrap_accuracy(correct, LEVELS, resamples=200) for _ in range(2))
    assert all(np.array_equal(a[k], b[k]) for k in a)
    assert set(a) == {"all", "easy", "hard"} and a["all"].shape == (200, 2)
    # stratified: the overall accuracy is the level accuracies weighted by the fixed level counts
    np.testing.assert_allclose(a["all"], (20 * a["easy"] + 30 * a["hard"]) / 50)


@settings(max_examples=40)
@given(st.integers(1, 3), st.integers(1, 4), st.lists(st.sampled_from("abc"), min_size=1, max_size=12),
       st.integers(0, 2**32 - 1))
def test_bootstrap_samples_are_accuracies_of_their_level_and_draw_within_it(methods, seeds, levels, seed):
    """Any shape: every sample lies in [0, 1]; a method right on the first level's problems alone stays 1
    there and 0 elsewhere (each level draws from its own problems), its whole the first level's share; and
    the whole is the levels weighted by their fixed counts."""
    levels = np.array(levels)
    rng = np.random.default_rng(seed)
    correct = (rng.random((methods, seeds, len(levels))) < 0.5).astype(float)
    correct[0] = levels == levels[0]
    boot = stats.bootstrap_accuracy(correct, levels, resamples=50, seed=seed)
    assert all(((0 <= v) & (v <= 1)).all() for v in boot.values())
    assert all((boot[lv][:, 0] == (lv == levels[0])).all() for lv in set(levels.tolist()))
    np.testing.assert_allclose(boot["all"][:, 0], np.mean(levels == levels[0]))
    counts = {lv: (levels == lv).sum() for lv in dict.fromkeys(levels)}
    weighted = sum(counts[lv] * boot[lv] for lv in counts) / len(levels)
    np.testing.assert_allclose(boot["all"], weighted)


@pytest.mark.parametrize("ci, expected", [([-0.02, 0.01], "confirmed"), ([-0.03, 0.01], "inconclusive"),
                                          ([-0.01, 0.03], "inconclusive"), ([-0.08, -0.03], "refuted"),
                                          ([0.03, 0.05], "refuted"), ([-0.05, 0.05], "inconclusive")])
def test_a_match_is_judged_by_the_margin_on_both_sides(ci, expected):
    """Confirmed: the interval excludes a difference of 2.5 points either way; refuted: it excludes every
    difference smaller; inconclusive: it holds both."""
    assert stats.verdict({"mean": sum(ci) / 2, "ci": ci}, 0.025) == expected


@given(st.floats(-1, 1), st.floats(0, 1), st.floats(0.001, 0.5))
def test_the_verdict_is_symmetric_and_a_narrower_interval_inside_never_turns_it_around(low, width, margin):
    """Δ and -Δ get the same verdict; an interval inside a confirmed one is confirmed, inside a refuted one
    refuted."""
    ci = [low, low + width]
    said = stats.verdict({"ci": ci}, margin)
    assert said == stats.verdict({"ci": [-ci[1], -ci[0]]}, margin)
    inner = [low + width / 4, low + 3 * width / 4]
    if said != "inconclusive":
        assert stats.verdict({"ci": inner}, margin) == said


def test_a_line_is_recovered_exactly_and_no_spread_is_no_line():
    x = np.linspace(0, 1, 9)
    fit = stats.line_fit(x, 0.9 - 0.5 * x, resamples=200)
    assert math.isclose(fit["slope"], -0.5) and math.isclose(fit["r2"], 1.0)
    assert fit["slope_ci"] == pytest.approx([-0.5, -0.5])
    flat = stats.line_fit(x, np.full(9, 0.3), resamples=10)
    assert math.isnan(flat["slope"]) and all(map(math.isnan, flat["slope_ci"]))


# ------------------------------------------------------------------------------ the planner's width


@given(st.integers(2, 200), st.integers(1, 5000), st.floats(0.0, 1.0), st.floats(0.0, 0.1))
def test_the_expected_width_shrinks_with_seeds_and_problems_and_grows_with_the_variances(seeds, problems,
                                                                                        problem_var, seed_var):
    width = stats.expected_half_width(seeds, problems, problem_var, seed_var)
    assert width >= 0
    assert stats.expected_half_width(seeds + 1, problems, problem_var, seed_var) <= width
    assert stats.expected_half_width(seeds, problems + 1, problem_var, seed_var) <= width
    assert stats.expected_half_width(seeds, problems, problem_var + 0.1, seed_var + 0.01) >= width


@pytest.mark.parametrize("true_delta", [0.0, 0.01, -0.02, 0.06])
def test_the_decision_probability_is_what_normal_draws_of_the_observed_delta_give(true_delta):
    """Against 200,000 draws of the observed Δ around its true value, with the model's standard error and
    width: within 0.005."""
    seeds, problems, problem_var, seed_var, margin = 7, 336, 0.14, 0.0002, 0.025
    width = stats.expected_half_width(seeds, problems, problem_var, seed_var)
    se = math.sqrt((seed_var + problem_var / problems) / seeds)
    observed = np.random.default_rng(0).normal(true_delta, se, 200_000)
    decided = (np.abs(observed) + width < margin) | (np.abs(observed) - width > margin)
    assert stats.decision_probability(seeds, margin, problems, problem_var, seed_var, true_delta) == \
        pytest.approx(decided.mean(), abs=0.005)


@given(st.floats(0.005, 0.1), st.integers(10, 2000), st.floats(0.01, 0.5), st.floats(0.0, 0.01),
       st.floats(-0.02, 0.02))
def test_seeds_to_decide_is_the_first_count_that_decides_with_the_power_asked(margin, problems, problem_var,
                                                                             seed_var, true_delta):
    seeds = stats.seeds_to_decide(margin, problems, problem_var, seed_var, true_delta)
    args = (margin, problems, problem_var, seed_var, true_delta)
    if seeds is None:
        assert stats.decision_probability(1000, *args) < 0.8
        return
    assert stats.decision_probability(seeds, *args) >= 0.8
    assert seeds == 2 or stats.decision_probability(seeds - 1, *args) < 0.8


def simulated_study(rng: np.random.Generator, seeds: int, problems: int, p: float, delta: float,
                    seed_sd: float) -> np.ndarray:
    """correct [2, S, N]: method a right with p on every problem; b with p + delta + u_s, u_s ~ N(0, seed_sd)
    a training seed's own shift; answers independent."""
    a = rng.random((seeds, problems)) < p
    shift = np.clip(p + delta + rng.normal(0, seed_sd, size=(seeds, 1)), 0, 1)
    b = rng.random((seeds, problems)) < shift
    return np.stack([a, b]).astype(float)


@pytest.mark.parametrize("seeds, problems, seed_sd", [(5, 112, 0.0), (5, 336, 0.03), (10, 100, 0.05),
                                                      (3, 336, 0.02)])
def test_the_width_rule_predicts_the_bootstraps_interval_on_simulated_studies(seeds, problems, seed_sd):
    """60 simulated studies each: the mean half width of the bootstrap's paired Δ interval against
    `expected_half_width` at the true variances (p = 0.4, Δ = 0.03, independent answers: problem_var =
    p(1-p) + q(1-q)), within 12%; and against the width predicted from each study's own `variance_parts`."""
    rng, p, delta = np.random.default_rng(seeds * problems), 0.4, 0.03
    levels = np.array(["one"] * problems)
    widths, parts = [], []
    for trial in range(60):
        correct = simulated_study(rng, seeds, problems, p, delta, seed_sd)
        boot = stats.bootstrap_accuracy(correct, levels, resamples=400, seed=trial)["all"]
        widths.append(stats.interval(0.0, boot[:, 1] - boot[:, 0])["half_width"])
        parts.append(stats.variance_parts(correct[0], correct[1]))
    q = p + delta
    true_problem_var, true_seed_var = p * (1 - p) + q * (1 - q), seed_sd ** 2
    expected = stats.expected_half_width(seeds, problems, true_problem_var, true_seed_var)
    assert np.mean(widths) == pytest.approx(expected, rel=0.12)
    assert np.mean(parts, axis=0)[0] == pytest.approx(true_problem_var, rel=0.05)
    # as the planner uses it: the variances estimated from a finished study (the seed part floored at 0,
    # so biased up where it is 0), the width predicted for a study like it
    predicted = [stats.expected_half_width(seeds, problems, *part) for part in parts]
    assert np.mean(predicted) == pytest.approx(np.mean(widths), rel=0.15)


def test_variance_parts_of_identical_methods_are_zero_and_one_seed_has_no_spread():
    correct = synthetic_correct(np.random.default_rng(0), 1, 4)[0]
    assert stats.variance_parts(correct, correct) == (0.0, 0.0)
    assert stats.variance_parts(correct[:1], 1 - correct[:1])[1] == 0.0


@pytest.mark.parametrize("ci, claimed, sign, expected", [
    ([0.01, 0.05], 0.04, 1, "confirmed"), ([-0.057, -0.017], 0.04, 1, "refuted"),  # the README's AVSPO row
    ([-0.079, 0.001], 0.025, 1, "refuted"), ([-0.01, 0.05], 0.04, 1, "inconclusive"),
    ([-0.30, -0.10], 0.0, -1, "confirmed"), ([0.01, 0.2], 0.0, -1, "refuted"),
    ([0.0, 0.1], 0.0, 1, "inconclusive"), ([0.27, 0.52], 0.58, 1, "refuted"),  # the README's cut of collapse
    ([0.54, 0.73], 0.58, 1, "confirmed")])
def test_a_claim_is_judged_by_its_interval_on_the_claimed_side(ci, claimed, sign, expected):
    assert stats.claim_verdict(ci, claimed, sign) == expected


@settings(max_examples=60, deadline=None)
@given(st.floats(-1, 1), st.floats(0, 1), st.floats(0, 1), st.floats(0, 1))
def test_raising_an_interval_never_turns_a_claim_against_it(low, width, shift, claimed):
    """Moving the interval up (more effect) moves a verdict only towards confirmed; a fall (sign -1) is the
    same claim mirrored."""
    rank = {"refuted": 0, "inconclusive": 1, "confirmed": 2}
    before = stats.claim_verdict([low, low + width], claimed)
    after = stats.claim_verdict([low + shift, low + width + shift], claimed)
    assert rank[after] >= rank[before]
    assert stats.claim_verdict([-low - width, -low], claimed, sign=-1) == before

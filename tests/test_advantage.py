"""Properties of the advantage estimators (hypothesis), exhaustive checks of K, hand-computed examples.

Hypothesis profiles ("ci": derandomized, "dev": random) are registered in tests/conftest.py.
"""

import dataclasses
import json
import math
import statistics

import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st

from advantage import (
    AdaptiveThreshold,
    AvspoInfo,
    aapo_advantages,
    aapo_margin,
    advantage_collapse_rate,
    avspo_advantages,
    collapsed_groups,
    effective_collapse_rate,
    grpo_advantages,
    num_virtual_samples,
    at_top,
    virtual_rewards,
)

FLOAT_DTYPES = [torch.float16, torch.bfloat16, torch.float32, torch.float64]
FINITE = dict(allow_nan=False, allow_infinity=False)
WIDTH = {torch.float16: 16, torch.bfloat16: 32, torch.float32: 32, torch.float64: 64}


@st.composite
def reward_groups(draw, binary: bool | None = None, min_b: int = 1, max_b: int = 6) -> torch.Tensor:
    """A [B, G] reward tensor: binary verifier rewards, or arbitrary values in [0, 1]."""
    b = draw(st.integers(min_b, max_b))
    g = draw(st.integers(2, 8))
    if binary is None:
        binary = draw(st.booleans())
    value = st.sampled_from([0.0, 1.0]) if binary else st.floats(0.0, 1.0, allow_nan=False, width=32)
    rows = draw(st.lists(st.lists(value, min_size=g, max_size=g), min_size=b, max_size=b))
    return torch.tensor(rows, dtype=torch.float32)


def naive_grpo(rewards: torch.Tensor, eps: float) -> torch.Tensor:
    """Loop version of GRPO in float64, written from the formula, to check the vectorised one against."""
    out = torch.zeros(rewards.shape, dtype=torch.float64)
    for b, row in enumerate(rewards.tolist()):
        mean = math.fsum(row) / len(row)
        std = math.sqrt(math.fsum((x - mean) ** 2 for x in row) / (len(row) - 1))
        for i, x in enumerate(row):
            out[b, i] = (x - mean) / (std + eps)
    return out


def batch(num_collapsed: int, num_groups: int) -> torch.Tensor:
    """[num_groups, 2] binary rewards: num_collapsed all-correct groups, the rest mixed."""
    return torch.tensor([[1.0, 1.0]] * num_collapsed + [[0.0, 1.0]] * (num_groups - num_collapsed))


# ---------------------------------------------------------------- GRPO


@given(reward_groups(), st.sampled_from([1e-4, 0.0, 0.5, 1.0]))
def test_grpo_matches_naive_loop(rewards, eps):
    assume(eps > 0 or not collapsed_groups(rewards).any())  # 0 / 0 with eps = 0
    torch.testing.assert_close(grpo_advantages(rewards, eps=eps).double(), naive_grpo(rewards, eps),
                               atol=1e-4, rtol=1e-4)


def test_grpo_is_exact_in_float64():
    rewards = torch.tensor([[0.1, 0.7, 0.3, 0.9], [1e6 + 0.1, 1e6, 1e6, 1e6 + 0.3]], dtype=torch.float64)
    torch.testing.assert_close(grpo_advantages(rewards), naive_grpo(rewards, 1e-4), atol=1e-9, rtol=1e-9)


@given(reward_groups(), st.booleans())
def test_grpo_group_means_are_zero(rewards, scale):
    means = grpo_advantages(rewards, scale=scale).mean(dim=1)
    assert means.abs().max() < 1e-4


@given(reward_groups(), st.randoms(use_true_random=False))
def test_grpo_is_permutation_equivariant(rewards, rng):
    perm = list(range(rewards.shape[1]))
    rng.shuffle(perm)
    torch.testing.assert_close(grpo_advantages(rewards[:, perm]), grpo_advantages(rewards)[:, perm])


@given(reward_groups(), st.floats(-5.0, 5.0))
def test_grpo_invariant_to_adding_a_constant(rewards, shift):
    torch.testing.assert_close(grpo_advantages(rewards + shift), grpo_advantages(rewards),
                               atol=2e-3, rtol=1e-3)


@given(reward_groups(binary=True))
def test_grpo_sign_follows_reward(rewards):
    adv = grpo_advantages(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    assert torch.all(adv[rewards > mean] > 0) and torch.all(adv[rewards < mean] < 0)


@given(reward_groups())
def test_all_outputs_finite(rewards):
    ref = rewards.flip(1)
    for adv in (grpo_advantages(rewards), avspo_advantages(rewards, acr_threshold=0.0),
                aapo_advantages(rewards, ref)):
        assert torch.isfinite(adv).all()


def test_dr_grpo_unscaled():
    torch.testing.assert_close(grpo_advantages(torch.tensor([[3.0, 1.0]]), scale=False),
                               torch.tensor([[1.0, -1.0]]))


def test_eps_is_added_to_the_std():
    # [1, 0]: centred +-0.5, unbiased std sqrt(1/2); eps = 1 makes sqrt(var + eps) or adding eps
    # outside visible
    torch.testing.assert_close(grpo_advantages(torch.tensor([[1.0, 0.0]]), eps=1.0)[0, 0],
                               torch.tensor(0.5 / (0.5**0.5 + 1)))


# ---------------------------------------------------------------- all-equal groups: exactly 0


@given(reward_groups(), st.data(), st.sampled_from(FLOAT_DTYPES), st.integers(0, 5))
def test_equal_groups_get_exactly_zero(rewards, data, dtype, row):
    value = data.draw(st.floats(width=WIDTH[dtype], **FINITE), label="value")
    rewards, row = rewards.to(dtype), row % rewards.shape[0]
    rewards[row] = value  # any float, rounded to the dtype: its group mean need not be representable
    assume(torch.isfinite(rewards[row]).all())
    for adv in (
        grpo_advantages(rewards),
        grpo_advantages(rewards, scale=False),
        avspo_advantages(rewards, acr_threshold=1.0),  # ACR <= 1 never exceeds 1.0: not triggered
        aapo_advantages(rewards, rewards),  # margin 0: the GRPO part alone
        aapo_advantages(rewards, torch.zeros_like(rewards)) - aapo_margin(rewards, torch.zeros_like(rewards)),
    ):
        assert torch.equal(adv[row], torch.zeros_like(adv[row]))
    assert collapsed_groups(rewards)[row]


@pytest.mark.parametrize("value", [0.3, 0.8287, 0.1, 1 / 3, 0.7, 1e-3, 12345.678])
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_equal_groups_of_unrepresentable_values_are_exactly_collapsed(value, dtype):
    for g in range(2, 17):  # the bug this guards against: mean(0.3 x G) != 0.3 in float32 for some G
        rewards = torch.full((3, g), value, dtype=dtype)
        assert torch.equal(grpo_advantages(rewards), torch.zeros_like(rewards))
        assert effective_collapse_rate(grpo_advantages(rewards)) == 1.0 == advantage_collapse_rate(rewards)


@given(st.integers(-(2**62), 2**62), st.sampled_from([torch.int64, torch.int32, torch.int16, torch.bool]))
def test_equal_integer_groups_get_exactly_zero(value, dtype):
    rewards = torch.tensor([[value, value, value], [0, 1, 1]]).to(dtype)  # wraps / saturates: still equal
    for adv in (grpo_advantages(rewards), avspo_advantages(rewards, acr_threshold=1.0),
                aapo_advantages(rewards, rewards)):
        assert torch.equal(adv[0], torch.zeros(3))


# ---------------------------------------------------------------- ACR


@given(reward_groups())
def test_acr_is_fraction_of_constant_groups(rewards):
    acr = advantage_collapse_rate(rewards)
    spreads = [statistics.pstdev(row) for row in rewards.tolist()]
    assume(all(not 5e-7 < s < 2e-6 for s in spreads))  # float32 vs float64 may disagree right at tau
    constant = sum(s < 1e-6 for s in spreads)
    assert acr == constant / rewards.shape[0]  # exactly: a count over B, not a float32 mean


@given(reward_groups(binary=True))
def test_effective_collapse_of_grpo_equals_acr_on_binary_rewards(rewards):
    # GRPO zeroes exactly the collapsed groups, so effective ACR under GRPO equals raw ACR.
    assert effective_collapse_rate(grpo_advantages(rewards)) == advantage_collapse_rate(rewards)


def test_collapse_uses_population_std_strictly_below_tau():
    rewards = torch.tensor([[0.0, 0.5]])  # population std 0.25 exactly, unbiased std 0.354
    assert not collapsed_groups(rewards, tau=0.25)  # std < tau is strict
    assert collapsed_groups(rewards, tau=0.3)  # population, not unbiased, std
    assert advantage_collapse_rate(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 1.0]])) == 1 / 3
    # |A| < tau, strict
    assert effective_collapse_rate(torch.tensor([[0.5, -0.5], [0.0, 0.0]]), tau=0.5) == 0.5


# ---------------------------------------------------------------- K: exhaustive against integer oracles


def ceil_sqrt(m: int) -> int:
    return 0 if m == 0 else math.isqrt(m - 1) + 1


ORACLES = {  # ceil(G * (c/n)^alpha), written with integer arithmetic only
    0.5: lambda g, c, n: ceil_sqrt(-(-g * g * c // n)),  # smallest k with k^2 >= G^2 c / n
    0.25: lambda g, c, n: ceil_sqrt(ceil_sqrt(-(-(g**4) * c // n))),  # smallest k with k^4 >= G^4 c / n
    1.0: lambda g, c, n: -(-g * c // n),
    2.0: lambda g, c, n: -(-g * c * c // (n * n)),
}


@pytest.mark.parametrize("alpha", ORACLES)
def test_num_virtual_samples_exact_for_all_small_cases(alpha):
    oracle = ORACLES[alpha]
    for g in range(1, 33):
        for n in range(1, 51):
            for c in range(n + 1):
                assert num_virtual_samples(g, c, n, alpha) == max(1, min(g, oracle(g, c, n))), (g, c, n)


@given(st.integers(1, 16), st.integers(1, 40), st.data(), st.sampled_from([0.3, 0.7, 1 / 3, 1.5, 0.123]))
def test_num_virtual_samples_matches_float_formula_away_from_integers(g, n, data, alpha):
    c = data.draw(st.integers(0, n), label="c")
    x = g * (c / n) ** alpha
    assume(abs(x - round(x)) > 1e-6)  # where float rounding cannot decide the ceiling
    assert num_virtual_samples(g, c, n, alpha) == max(1, min(g, math.ceil(x)))


def test_num_virtual_samples_hand_values_and_errors():
    assert num_virtual_samples(8, 2, 3) == 7  # ceil(8 * sqrt(2/3)) = ceil(6.53)
    assert num_virtual_samples(3, 1, 9) == 1  # 3 * sqrt(1/9) = 1 exactly (float32 ACR gave 2)
    assert num_virtual_samples(25, 7, 25, alpha=1.0) == 7  # 25 * 0.28 = 7 exactly (float64 gives 8)
    assert num_virtual_samples(8, 0, 5) == 1  # max(1, ...): at least one virtual reward
    for bad in [(8, 3, 2), (8, -1, 2), (8, 0, 0), (0, 1, 2)]:
        with pytest.raises(ValueError):
            num_virtual_samples(*bad)
    for alpha in (-0.5, math.inf, math.nan):
        with pytest.raises(ValueError):
            num_virtual_samples(8, 1, 2, alpha)


# ---------------------------------------------------------------- AVSPO


@given(reward_groups(), st.floats(0.0, 1.0))
def test_avspo_equals_grpo_at_or_below_threshold(rewards, threshold):
    adv, info = avspo_advantages(rewards, acr_threshold=threshold, return_info=True)
    assert info.triggered == (advantage_collapse_rate(rewards) > threshold)
    if not info.triggered:
        assert torch.equal(adv, grpo_advantages(rewards)) and info.num_virtual == 0


@pytest.mark.parametrize(
    "num_collapsed, num_groups, threshold",
    [(2, 4, 0.5), (3, 10, 0.3), (57, 100, 0.57), (1, 3, 1 / 3), (7, 25, 0.28)]
)
def test_avspo_trigger_boundary(num_collapsed, num_groups, threshold):
    rewards = batch(num_collapsed, num_groups)
    adv, info = avspo_advantages(rewards, acr_threshold=threshold, return_info=True)
    assert info == AvspoInfo(triggered=False, num_collapsed=num_collapsed, num_treated=0,
                             num_virtual=0)  # ACR == threshold
    assert torch.equal(adv, grpo_advantages(rewards))
    assert not avspo_advantages(rewards, acr_threshold=math.nextafter(threshold, 1.0),
                                return_info=True)[1].triggered
    _, info = avspo_advantages(rewards, acr_threshold=math.nextafter(threshold, 0.0), return_info=True)
    k = num_virtual_samples(2, num_collapsed, num_groups)
    assert info == AvspoInfo(True, num_collapsed, num_collapsed, k)


def test_avspo_info_reports_k_used():
    rewards = batch(2, 3).repeat(1, 4)  # G = 8, ACR 2/3: K = ceil(8 * sqrt(2/3)) = 7
    assert avspo_advantages(rewards, return_info=True)[1] == AvspoInfo(True, 2, 2, 7)
    assert avspo_advantages(rewards, num_virtual=3, return_info=True)[1] == AvspoInfo(True, 2, 2, 3)
    assert avspo_advantages(rewards, alpha=1.0, return_info=True)[1].num_virtual == 6
    with pytest.raises(ValueError):
        avspo_advantages(rewards, num_virtual=0)


@given(reward_groups())
def test_avspo_leaves_mixed_groups_alone(rewards):
    mixed = ~collapsed_groups(rewards)
    avspo = avspo_advantages(rewards, acr_threshold=0.0)
    torch.testing.assert_close(avspo[mixed], grpo_advantages(rewards)[mixed])


@given(reward_groups(binary=True), st.sampled_from([None, 1, 3]))
def test_avspo_all_correct_positive_all_wrong_negative(rewards, num_virtual):
    # G=2, both kinds
    rewards = torch.cat([rewards[:, :1].expand(-1, 2), torch.ones(1, 2), torch.zeros(1, 2)])
    adv = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual)
    all_correct, all_wrong = adv[-2], adv[-1]
    assert torch.all(all_correct > 0) and torch.all(all_correct == all_correct[0])
    assert torch.all(all_wrong < 0) and torch.all(all_wrong == all_wrong[0])
    assert effective_collapse_rate(adv) == 0.0


@given(reward_groups(binary=True, min_b=2), st.sampled_from(["all-wrong", "all-correct"]),
       st.sampled_from([None, 1, 3]))
def test_avspo_one_end_treats_only_that_end(rewards, end, num_virtual):
    """The ends ablation: the chosen end gets both-ends AVSPO's advantages, the other end stays at 0, mixed
    groups keep GRPO's; the trigger and K count every collapsed group."""
    both, info_both = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual, return_info=True)
    one, info = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual, ends=end,
                                 return_info=True)
    collapsed = collapsed_groups(rewards)
    chosen = collapsed & (at_top(rewards[:, 0], (0.0, 1.0)) == (end == "all-correct"))  # [B]
    assert torch.equal(one[chosen], both[chosen]) and torch.equal(one[~collapsed], both[~collapsed])
    assert torch.all(one[collapsed & ~chosen] == 0)
    assert (info.triggered, info.num_collapsed, info.num_virtual) == (
        info_both.triggered, info_both.num_collapsed, info_both.num_virtual)
    assert info.num_treated == int(chosen.sum()) and info_both.num_treated == info_both.num_collapsed


def test_avspo_ends_by_hand():
    rewards = torch.tensor([[1.0, 1.0], [0.0, 0.0], [0.0, 1.0]])  # all-correct, all-wrong, mixed
    wrong = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=1, ends="all-wrong")
    right = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=1, ends="all-correct")
    a = closed_form(2, 1)  # sqrt(1 * 2 / (2 * 3)); eps = 1e-4 moves it by under 1%
    torch.testing.assert_close(wrong[:2], torch.tensor([[0.0, 0.0], [-a, -a]]), rtol=0.01, atol=0.0)
    torch.testing.assert_close(right[:2], torch.tensor([[a, a], [0.0, 0.0]]), rtol=0.01, atol=0.0)
    with pytest.raises(ValueError, match="ends"):
        avspo_advantages(rewards, ends="neither")


def test_virtual_rewards_are_stratified():
    values = torch.tensor([1.0, 0.0, 0.75, 0.5, 0.25])
    virtual = virtual_rewards(values, 3, 0.1, (0.0, 1.0))  # [5, 3]
    expected = torch.tensor([0.9, 0.1, 0.65, 0.4, 0.35])  # below the top half, above the bottom half
    torch.testing.assert_close(virtual, expected[:, None].expand(-1, 3))
    torch.testing.assert_close(virtual_rewards(torch.tensor([3.0, 1.0]), 1, 0.5, (1.0, 3.0)),
                               torch.tensor([[2.5], [1.5]]))
    for delta in (0.0, -0.1, 1.5):
        with pytest.raises(ValueError):
            virtual_rewards(values, 1, delta, (0.0, 1.0))


def closed_form(g: int, k: int) -> float:
    """|A| of a collapsed group's real samples next to K virtual rewards at v -+ delta, eps = 0."""
    return math.sqrt(k * (g + k - 1) / (g * (g + k)))


@given(st.integers(2, 16), st.integers(1, 16), st.floats(0.01, 1.0), st.floats(0.01, 1.0))
def test_avspo_advantage_depends_on_k_not_on_delta(g, k, delta_a, delta_b):
    rewards = torch.tensor([[1.0] * g, [0.0] * g], dtype=torch.float64)  # all-correct, all-wrong
    a = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=k, delta=delta_a, eps=0.0)
    b = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=k, delta=delta_b, eps=0.0)
    torch.testing.assert_close(a, b)  # exact in float64 (float32 rounds v - delta, blurring it by ~1e-5)
    size = torch.full((g,), closed_form(g, k), dtype=torch.float64)
    torch.testing.assert_close(a, torch.stack([size, -size]))  # all-correct pushed up, all-wrong down
    default = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=k)  # delta = 0.1, eps = 1e-4
    torch.testing.assert_close(default, a, rtol=0.01, atol=0.0)  # eps << the std: it hardly counts


@given(reward_groups())
def test_avspo_is_permutation_equivariant(rewards):
    perm = list(reversed(range(rewards.shape[1])))
    kwargs = dict(acr_threshold=0.0)
    torch.testing.assert_close(avspo_advantages(rewards[:, perm], **kwargs),
                               avspo_advantages(rewards, **kwargs)[:, perm])


@pytest.mark.parametrize("num_virtual", [1, 3, 8])
def test_virtual_samples_get_no_advantage(num_virtual):
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    adv = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual)
    assert adv.shape == rewards.shape  # advantages only for the G real samples, whatever K is
    assert torch.all(adv[0] == adv[0, 0]) and adv[0, 0] > 0


# ---------------------------------------------------------------- AAPO


@given(reward_groups(), st.booleans())
def test_aapo_equals_grpo_when_policy_matches_reference(rewards, scale):
    assert torch.equal(aapo_advantages(rewards, rewards, scale=scale), grpo_advantages(rewards, scale=scale))


@given(reward_groups(), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.randoms(use_true_random=False))
def test_aapo_margin_is_bounded(rewards, delta_low, delta_high, rng):
    ref = rewards[:, torch.randperm(rewards.shape[1],
                                    generator=torch.Generator().manual_seed(rng.randint(0, 99)))]
    margin = (aapo_advantages(rewards, ref, delta_low=delta_low, delta_high=delta_high)
              - grpo_advantages(rewards))
    assert torch.all(margin >= -delta_low - 1e-6) and torch.all(margin <= delta_high + 1e-6)
    torch.testing.assert_close(margin, aapo_margin(rewards, ref, delta_low=delta_low, delta_high=delta_high))


def test_aapo_margin_hand_values():
    rewards, ref = torch.tensor([[1.0, 0.0, 0.5, 0.6]]), torch.tensor([[0.0, 1.0, 0.4, 0.6]])
    # clip(r - r_ref, -0.2, 0.28): above, below, inside, zero
    expected = torch.tensor([[0.28, -0.2, 0.1, 0.0]])
    torch.testing.assert_close(aapo_margin(rewards, ref), expected)
    with pytest.raises(ValueError, match="magnitudes"):
        aapo_margin(rewards, ref, delta_low=-0.2)


@given(reward_groups(binary=True))
def test_aapo_gives_signal_to_collapsed_groups_that_beat_the_reference(rewards):
    rewards[0] = 1.0
    ref = torch.zeros_like(rewards)
    assert torch.equal(aapo_advantages(rewards, ref)[0], torch.full((rewards.shape[1],), 0.28))


# ---------------------------------------------------------------- adaptive threshold


@given(st.lists(st.tuples(st.sampled_from([0.0, 0.125, 0.5, 1.0]), st.floats(0.0, 1.0)), max_size=50))
def test_adaptive_threshold_moves_one_step_by_the_rule(history):
    threshold = AdaptiveThreshold()
    for acr, reward in history:
        old, best = threshold.value, threshold.best_ema
        value = threshold.update(acr, reward)
        assert 0.1 <= value <= 0.9 and value == threshold.value
        if best is None or acr == 0:
            assert value == old  # the first update starts the average; no collapse, nothing to adapt
        elif threshold.reward_ema > best:  # a new best of the smoothed reward: training improves
            assert value == pytest.approx(min(0.9, old + 0.05))  # intervene less
        else:  # flat or falling
            assert value == pytest.approx(max(0.1, old - 0.05))  # intervene more


@given(st.lists(st.tuples(st.sampled_from([0.125, 0.5, 1.0]), st.floats(0.0, 1.0)), max_size=60))
@example([(0.5, 0.0)] + [(0.5, 0.1 * i) for i in range(1, 6)])  # five steps up: 0.75, not 0.7499999999999999
def test_adaptive_threshold_stays_exactly_on_its_grid(history):
    """After any updates the threshold is 0.5 + k * 0.05 exactly, so an ACR of exactly (10 + k) / 20 does not
    trigger AVSPO (strictly above) and one group more does. Floats stepped by 0.05 drift off the grid."""
    threshold = AdaptiveThreshold()
    for acr, reward in history:
        threshold.update(acr, reward)
    c = round(threshold.value * 20)  # the grid point it should be on, as collapsed groups out of B = 20
    assert threshold.value == c / 20
    assert not avspo_advantages(batch(c, 20), acr_threshold=threshold.value, return_info=True)[1].triggered
    assert avspo_advantages(batch(c + 1, 20), acr_threshold=threshold.value, return_info=True)[1].triggered


@given(st.floats(0.1, 0.9), st.lists(st.floats(0.001, 0.05), min_size=40, max_size=40))
def test_adaptive_threshold_rises_to_high_while_reward_improves(start, gains):
    threshold, reward = AdaptiveThreshold(start=start), 0.0
    for gain in gains[:17]:  # 16 updates cross [0.1, 0.9]; the first one only starts the average
        reward += gain
        threshold.update(0.5, reward)
    assert threshold.value == pytest.approx(0.9)


@given(st.floats(0.1, 0.9), st.lists(st.floats(0.0, 0.05), min_size=40, max_size=40), st.booleans())
@example(0.875, [0.0078125] + [0.0] * 39, False)  # flat after a drop: 0.8 ema + 0.2 ema rounds up
def test_adaptive_threshold_falls_to_low_while_reward_stalls(start, drops, flat):
    threshold, reward = AdaptiveThreshold(start=start), 0.9
    for drop in drops[:17]:
        reward -= 0.0 if flat else drop
        threshold.update(0.5, reward)
    assert threshold.value == pytest.approx(0.1)


def test_adaptive_threshold_fires_more_when_noisy_training_stalls():
    """Batch noise (B = 8: ACR in steps of 1/8, reward +- 0.08) does not hide the trend: at every ACR level
    the trigger fires on more steps of a flat or falling run than of a rising one (fixed seeds:
    deterministic)."""
    from benchmarks.trigger_table import fired_steps

    for mean_acr in (0.25, 0.35, 0.45, 0.55):
        rising, flat, falling = (fired_steps(AdaptiveThreshold, mean_acr, trend, runs=50)
                                 for trend in ("rising", "flat", "falling"))
        assert flat > rising + 10 and falling > rising + 10, (mean_acr, rising, flat, falling)


def test_adaptive_threshold_hand_values():
    t = AdaptiveThreshold(start=0.5, step=0.1, smoothing=0.5)
    assert t.update(0.5, 0.2) == 0.5 and t.reward_ema == t.best_ema == 0.2  # starts the average only
    assert t.update(0.5, 0.6) == pytest.approx(0.6)  # ema 0.4: a new best, up
    assert t.update(0.5, 0.4) == pytest.approx(0.5)  # ema 0.4: no new best (flat), down
    assert t.update(0.0, 0.0) == pytest.approx(0.5) and t.reward_ema == 0.2  # no collapse: stays
    assert t.update(1.0, 0.0) == pytest.approx(0.4)  # ema 0.1, falling: down
    t = AdaptiveThreshold(start=0.85, step=1.0, reward_ema=0.0, best_ema=0.0)
    assert t.update(1.0, 1.0) == 0.9  # clipped at high
    assert t.update(1.0, 0.0) == 0.85  # and back: start + moves * step, not the bound - step
    t = AdaptiveThreshold(start=0.15, step=1.0, reward_ema=1.0, best_ema=1.0)
    assert t.update(0.9, 0.0) == 0.1  # clipped at low


def test_adaptive_threshold_validates_and_round_trips():
    for bad in (dict(start=0.95), dict(start=0.3, low=0.4, high=0.9), dict(step=0.0), dict(smoothing=1.0),
                dict(step=math.nan), dict(high=math.inf)):
        with pytest.raises(ValueError):
            AdaptiveThreshold(**bad)
    t = AdaptiveThreshold()
    for acr, reward in [(0.7, 0.2), (0.8, 0.4), (0.6, 0.1)]:
        t.update(acr, reward)
    saved = json.loads(json.dumps(dataclasses.asdict(t)))  # what a checkpoint stores
    restored = AdaptiveThreshold(**saved)
    assert restored == t and restored.value == pytest.approx(0.5)
    assert restored.update(0.9, 0.5) == t.update(0.9, 0.5) != 0.5


# ---------------------------------------------------------------- hand-computed examples, dtypes and errors


def test_hand_computed_grpo_and_avspo():
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # mixed group: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected_mixed = torch.tensor([0.5, 0.5, -0.5, -0.5]) / (s + 1e-4)
    torch.testing.assert_close(grpo_advantages(rewards)[0], expected_mixed)
    assert advantage_collapse_rate(rewards) == 2 / 3
    # ACR 2/3 > 0.5; K = ceil(4 * sqrt(2/3)) = ceil(3.27) = 4 virtual rewards per collapsed group.
    assert num_virtual_samples(4, 2, 3) == 4
    adv = avspo_advantages(rewards)
    # all-correct: R u V = [1, 1, 1, 1, .9, .9, .9, .9]: mean 0.95, unbiased std sqrt(8 * 0.05^2 / 7)
    assert adv[1, 0].item() == pytest.approx(0.05 / (math.sqrt(8 * 0.05**2 / 7) + 1e-4), rel=1e-5)
    assert torch.all(adv[1] == adv[1, 0])
    # all-wrong is the mirror image: [0, 0, 0, 0, .1, .1, .1, .1]
    torch.testing.assert_close(adv[2], -adv[1])
    torch.testing.assert_close(adv[0], expected_mixed)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES + [torch.int64, torch.int32, torch.bool])
def test_dtypes_as_documented(dtype):
    """Floats come back in their dtype, ints and bools as float32; computed in at least float32."""
    rewards = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1], [0, 1, 1, 1]]).to(dtype)
    ref = torch.tensor([[0, 0, 1, 1]] * 3).to(dtype)
    out_dtype = dtype if dtype.is_floating_point else torch.float32
    wide = rewards.to(torch.promote_types(dtype, torch.float32))  # what the computation runs in
    pairs = [
        (grpo_advantages(rewards), grpo_advantages(wide)),
        (grpo_advantages(rewards, scale=False), grpo_advantages(wide, scale=False)),
        (avspo_advantages(rewards, acr_threshold=0.0), avspo_advantages(wide, acr_threshold=0.0)),
        (avspo_advantages(rewards, acr_threshold=0.9), avspo_advantages(wide, acr_threshold=0.9)),
        (aapo_advantages(rewards, ref), aapo_advantages(wide, ref)),
        (aapo_margin(rewards, ref), aapo_margin(wide, ref)),
    ]
    for got, computed in pairs:
        assert got.dtype == out_dtype and computed.dtype == wide.dtype
        assert torch.equal(got, computed.to(out_dtype))  # one rounding, at the end
    assert avspo_advantages(rewards, acr_threshold=0.0)[1].float().min() > 0


@pytest.mark.parametrize("shape", [(4, 1), (4,), (0, 3, 2), (0, 3)])
def test_bad_shapes_raise_clear_errors(shape):
    with pytest.raises(ValueError, match="G|shape"):
        grpo_advantages(torch.zeros(shape))
    with pytest.raises(ValueError):
        avspo_advantages(torch.zeros(shape))


def test_mismatched_reference_raises():
    with pytest.raises(ValueError, match="differ"):
        aapo_advantages(torch.zeros(2, 4), torch.zeros(2, 3))

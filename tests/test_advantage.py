"""Properties of the advantage estimators (hypothesis) plus hand-computed examples."""

import math
import statistics

import pytest
import torch
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from advantage import (
    AdaptiveThreshold,
    aapo_advantages,
    aapo_margin,
    advantage_collapse_rate,
    avspo_advantages,
    collapsed_groups,
    effective_collapse_rate,
    grpo_advantages,
    num_virtual_samples,
    virtual_rewards,
)

settings.register_profile("ci", deadline=None, max_examples=60)
settings.load_profile("ci")


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
    """Loop version of GRPO, written from the formula, to check the vectorised one against."""
    out = torch.zeros_like(rewards)
    for b, row in enumerate(rewards.tolist()):
        mean = sum(row) / len(row)
        std = math.sqrt(sum((x - mean) ** 2 for x in row) / (len(row) - 1))
        for i, x in enumerate(row):
            out[b, i] = (x - mean) / (std + eps)
    return out


# ---------------------------------------------------------------- GRPO


@given(reward_groups())
def test_grpo_matches_naive_loop(rewards):
    torch.testing.assert_close(grpo_advantages(rewards), naive_grpo(rewards, 1e-4), atol=1e-4, rtol=1e-4)


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
    torch.testing.assert_close(grpo_advantages(rewards + shift), grpo_advantages(rewards), atol=2e-3, rtol=1e-3)


@given(reward_groups(), st.sampled_from([0.0, 1.0, 0.25, -2.0, 3.5]), st.floats(-3.0, 3.0))
def test_collapsed_groups_get_zero_under_grpo(rewards, exact_value, any_value):
    rewards[0] = exact_value  # verifier-like values: the group mean is exact, so the advantage is exactly 0
    assert torch.all(grpo_advantages(rewards)[0] == 0)
    assert collapsed_groups(rewards)[0]
    rewards[0] = any_value  # arbitrary floats: the mean may be off by one ulp, the advantage stays ~0
    assert grpo_advantages(rewards)[0].abs().max() < 1e-2


@given(reward_groups(binary=True))
def test_grpo_sign_follows_reward(rewards):
    adv = grpo_advantages(rewards)
    mean = rewards.mean(dim=1, keepdim=True)
    assert torch.all(adv[rewards > mean] > 0) and torch.all(adv[rewards < mean] < 0)


@given(reward_groups())
def test_all_outputs_finite(rewards):
    ref = rewards.flip(1)
    for adv in (grpo_advantages(rewards), avspo_advantages(rewards, acr_threshold=0.0), aapo_advantages(rewards, ref)):
        assert torch.isfinite(adv).all()


# ---------------------------------------------------------------- ACR


@given(reward_groups())
def test_acr_is_fraction_of_constant_groups(rewards):
    acr = advantage_collapse_rate(rewards)
    spreads = [statistics.pstdev(row) for row in rewards.tolist()]
    assume(all(not 5e-7 < s < 2e-6 for s in spreads))  # float32 vs float64 may disagree right at tau
    constant = sum(s < 1e-6 for s in spreads)  # ACR's tau: [0, 1e-19] counts as collapsed
    assert 0.0 <= acr <= 1.0
    assert acr == pytest.approx(constant / rewards.shape[0])


@given(reward_groups(binary=True))
def test_effective_collapse_of_grpo_equals_acr_on_binary_rewards(rewards):
    # GRPO zeroes exactly the collapsed groups, so effective ACR under GRPO equals raw ACR.
    assert effective_collapse_rate(grpo_advantages(rewards)) == advantage_collapse_rate(rewards)


# ---------------------------------------------------------------- AVSPO


@given(reward_groups(), st.floats(0.0, 1.0))
def test_avspo_equals_grpo_at_or_below_threshold(rewards, threshold):
    if advantage_collapse_rate(rewards) <= threshold:
        torch.testing.assert_close(avspo_advantages(rewards, acr_threshold=threshold), grpo_advantages(rewards))


@given(reward_groups())
def test_avspo_leaves_mixed_groups_alone(rewards):
    mixed = ~collapsed_groups(rewards)
    avspo = avspo_advantages(rewards, acr_threshold=0.0)
    torch.testing.assert_close(avspo[mixed], grpo_advantages(rewards)[mixed])


@given(reward_groups(binary=True), st.sampled_from([None, 1, 3]))
def test_avspo_all_correct_positive_all_wrong_negative(rewards, num_virtual):
    rewards = torch.cat([rewards[:, :1].expand(-1, 2), torch.ones(1, 2), torch.zeros(1, 2)])  # G=2, both kinds
    adv = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual)
    all_correct, all_wrong = adv[-2], adv[-1]
    assert torch.all(all_correct > 0) and torch.all(all_correct == all_correct[0])
    assert torch.all(all_wrong < 0) and torch.all(all_wrong == all_wrong[0])
    assert effective_collapse_rate(adv) == 0.0


@given(st.lists(st.sampled_from([0.0, 1.0]), min_size=1, max_size=6), st.integers(2, 8), st.floats(0.0, 1.0))
def test_num_virtual_in_range(values, g, acr):
    k = num_virtual_samples(g, acr)
    assert 1 <= k <= g
    v = virtual_rewards(torch.tensor(values), k, (0.0, 1.0))
    assert v.shape == (len(values), k)
    assert torch.all((v >= 0.0) & (v <= 1.0))
    assert torch.all(v != torch.tensor(values)[:, None])  # every virtual reward differs from the real one


@given(reward_groups())
def test_avspo_is_permutation_equivariant(rewards):
    perm = list(reversed(range(rewards.shape[1])))
    kwargs = dict(acr_threshold=0.0)
    torch.testing.assert_close(avspo_advantages(rewards[:, perm], **kwargs), avspo_advantages(rewards, **kwargs)[:, perm])


@pytest.mark.parametrize("num_virtual", [1, 3, 8])
def test_virtual_samples_get_no_advantage(num_virtual):
    rewards = torch.tensor([[1.0, 1.0, 1.0, 1.0], [0.0, 1.0, 0.0, 1.0]])
    adv = avspo_advantages(rewards, acr_threshold=0.0, num_virtual=num_virtual)
    assert adv.shape == rewards.shape  # advantages only for the G real samples, whatever K is
    assert torch.all(adv[0] == adv[0, 0]) and adv[0, 0] > 0


# ---------------------------------------------------------------- AAPO


@given(reward_groups(), st.booleans())
def test_aapo_equals_grpo_when_policy_matches_reference(rewards, scale):
    torch.testing.assert_close(aapo_advantages(rewards, rewards, scale=scale), grpo_advantages(rewards, scale=scale))


@given(reward_groups(), st.floats(0.0, 0.5), st.floats(0.0, 0.5), st.randoms(use_true_random=False))
def test_aapo_margin_is_bounded(rewards, delta_low, delta_high, rng):
    ref = rewards[:, torch.randperm(rewards.shape[1], generator=torch.Generator().manual_seed(rng.randint(0, 99)))]
    margin = aapo_advantages(rewards, ref, delta_low=delta_low, delta_high=delta_high) - grpo_advantages(rewards)
    assert torch.all(margin >= -delta_low - 1e-6) and torch.all(margin <= delta_high + 1e-6)
    torch.testing.assert_close(margin, aapo_margin(rewards, ref, delta_low=delta_low, delta_high=delta_high))


@given(reward_groups(binary=True))
def test_aapo_gives_signal_to_collapsed_groups_that_beat_the_reference(rewards):
    rewards[0] = 1.0
    ref = torch.zeros_like(rewards)
    torch.testing.assert_close(aapo_advantages(rewards, ref)[0], torch.full((rewards.shape[1],), 0.28))


# ---------------------------------------------------------------- adaptive threshold


@given(st.lists(st.tuples(st.floats(0.0, 1.0), st.floats(-1.0, 1.0)), max_size=50))
def test_adaptive_threshold_stays_in_bounds(history):
    threshold = AdaptiveThreshold()
    for acr, delta in history:
        value = threshold.update(acr, delta)
        assert 0.1 <= value <= 0.9 and value == threshold.value


def test_adaptive_threshold_hand_values():
    t = AdaptiveThreshold(init=0.5, lr=0.1)
    assert t.update(0.9, +0.2) == pytest.approx(0.54)  # reward rose: move towards ACR
    assert t.update(0.9, -0.2) == pytest.approx(0.504)  # reward fell: move away from ACR
    assert t.update(0.9, 0.0) == pytest.approx(0.504)  # no change in reward: stay
    t = AdaptiveThreshold(init=0.85, lr=1.0)
    assert t.update(1.0, 1.0) == 0.9  # clipped at high


# ---------------------------------------------------------------- hand-computed examples and errors


def test_hand_computed_grpo_and_avspo():
    rewards = torch.tensor([[1.0, 1.0, 0.0, 0.0], [1.0, 1.0, 1.0, 1.0], [0.0, 0.0, 0.0, 0.0]])
    # mixed group: mean 0.5, unbiased std sqrt(1/3)
    s = math.sqrt(1 / 3)
    expected_mixed = torch.tensor([0.5, 0.5, -0.5, -0.5]) / (s + 1e-4)
    torch.testing.assert_close(grpo_advantages(rewards)[0], expected_mixed)
    assert advantage_collapse_rate(rewards) == pytest.approx(2 / 3)
    # ACR 2/3 > 0.5; K = ceil(4 * sqrt(2/3)) = ceil(3.27) = 4 virtual rewards per collapsed group.
    assert num_virtual_samples(4, 2 / 3) == 4
    adv = avspo_advantages(rewards)
    # all-correct: R u V = [1,1,1,1, .75,.5,.25,0]: mean 0.6875, unbiased std sqrt(1.09375 / 7) = 0.395285
    aug = torch.tensor([1, 1, 1, 1, 0.75, 0.5, 0.25, 0.0])
    torch.testing.assert_close(adv[1], (1 - aug.mean()).expand(4) / (aug.std() + 1e-4))
    assert adv[1, 0].item() == pytest.approx(0.3125 / (0.395285 + 1e-4), rel=1e-4)
    # all-wrong is the mirror image
    torch.testing.assert_close(adv[2], -adv[1])
    torch.testing.assert_close(adv[0], expected_mixed)


def test_released_code_setting_adds_one_opposite_reward():
    rewards = torch.tensor([[0.0, 0.0, 0.0], [1.0, 1.0, 1.0], [1.0, 0.0, 1.0]])
    adv = avspo_advantages(rewards, num_virtual=1, acr_threshold=0.0)
    # all-wrong group + virtual 1.0: [0,0,0,1] mean .25, unbiased std .5 -> -.25 / .5
    torch.testing.assert_close(adv[0], torch.full((3,), -0.25 / (0.5 + 1e-4)))
    torch.testing.assert_close(adv[1], torch.full((3,), 0.25 / (0.5 + 1e-4)))


def test_dr_grpo_unscaled():
    torch.testing.assert_close(grpo_advantages(torch.tensor([[3.0, 1.0]]), scale=False), torch.tensor([[1.0, -1.0]]))


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16, torch.int64])
def test_other_dtypes(dtype):
    rewards = torch.tensor([[1, 0, 0, 1], [1, 1, 1, 1]]).to(dtype)
    ref = torch.zeros_like(rewards)
    for adv in (grpo_advantages(rewards), avspo_advantages(rewards, acr_threshold=0.0), aapo_advantages(rewards, ref)):
        assert adv.dtype == (dtype if dtype.is_floating_point else torch.float32)
        assert torch.isfinite(adv.float()).all()
    assert avspo_advantages(rewards, acr_threshold=0.0)[1].float().min() > 0


@pytest.mark.parametrize("shape", [(4, 1), (4,), (0, 3, 2)])
def test_bad_shapes_raise_clear_errors(shape):
    with pytest.raises(ValueError, match="G|shape"):
        grpo_advantages(torch.zeros(shape))
    with pytest.raises(ValueError):
        avspo_advantages(torch.zeros(shape))


def test_mismatched_reference_raises():
    with pytest.raises(ValueError, match="must match"):
        aapo_advantages(torch.zeros(2, 4), torch.zeros(2, 3))

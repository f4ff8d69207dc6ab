"""Group-relative advantage estimators: GRPO, AVSPO and AAPO, plus the collapse diagnostics.

Pure functions on reward tensors shaped [B, G]: B prompts, G sampled completions per prompt.
No model, no I/O: this file can be read, tested and reused on its own.

    GRPO   A_i = (r_i - mean_G) / (std_G + eps)                       Shao et al., arXiv 2402.03300
    ACR    fraction of the B groups whose rewards are all equal        He et al., arXiv 2605.21125
    AVSPO  GRPO, but while ACR exceeds an adaptive threshold, collapsed
           groups are normalised together with K virtual rewards       He et al., arXiv 2605.21125
    AAPO   GRPO + clip(r_i - r_ref_i, -delta_low, delta_high)          Xiong et al., arXiv 2505.14264

Sources (../shared/papers/ has summaries of both papers and facts from their released code; neither
gives equation numbers, so none are cited here). From the papers: the GRPO advantage; ACR as the
share of groups with reward std below tau; AVSPO's virtual rewards, which enter the mean and std of a
collapsed group but get no advantage, lie slightly below the maximum for an all-correct group and are a
small positive anchor for an all-wrong one, and are used only when ACR is above a threshold that adapts
during training; K = max(1, min(G, ceil(G * ACR^alpha))), alpha = 0.5; the AAPO advantage A*.
From the released code: unbiased std, eps = 1e-4, tau = 1e-6, one virtual reward (0.0 or 1.0) per
collapsed group, threshold start 0.5, step 0.01, bounds [0.1, 0.9], AAPO's clamp(-0.2, 0.28) and
pairing r_ref_i with r_i by sample index. Ours: the virtual-reward ladder (`virtual_rewards`), the
threshold update rule (`AdaptiveThreshold`), the strict `ACR > threshold` trigger.

Exactness: a group whose rewards are all equal gets advantage exactly 0 from GRPO, from AVSPO when it
does not intervene and from AAPO's GRPO part, for any value and dtype (the rewards are centred on the
group's first element before averaging). ACR, the trigger and K are computed from integer counts.

Dtypes: float16 and bfloat16 rewards are computed in float32, float32 in float32, float64 in float64;
advantages (and the AAPO margin) come back in the input's float dtype; int and bool rewards give float32.
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch


def _as_float_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Check the [B, G] shape and return the rewards in a dtype at least as precise as float32."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be shaped [B, G] (prompts, samples); got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G must be >= 2 to compare samples within a group; got G={rewards.shape[1]}")
    if rewards.shape[0] < 1:
        raise ValueError(f"rewards must hold at least one group (B >= 1); got shape {tuple(rewards.shape)}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32))


def _output_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def grpo_advantages(rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_G) / (std_G + eps); with scale=False, A_i = r_i - mean_G (Dr. GRPO).

    >>> grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    tensor([[ 1.5000, -0.5000, -0.5000, -0.5000]])
    """
    r = _as_float_groups(rewards)  # [B, G]
    d = r - r[:, :1]  # shift by the first reward (r_i - mean is shift invariant): equal groups become exact 0
    centred = d - d.mean(dim=1, keepdim=True)  # r_i - mean_G, [B, G]
    if scale:
        centred = centred / (centred.std(dim=1, keepdim=True) + eps)  # GRPO (Shao et al.), unbiased std [B, 1]
    return centred.to(_output_dtype(rewards))


def collapsed_groups(rewards: torch.Tensor, *, tau: float = 1e-6) -> torch.Tensor:
    """Bool [B]: True where a group's rewards are all (nearly) equal, population std < tau."""
    r = _as_float_groups(rewards)
    return (r - r[:, :1]).std(dim=1, correction=0) < tau  # AVSPO (He et al.): sigma_R < tau


def advantage_collapse_rate(rewards: torch.Tensor, *, tau: float = 1e-6) -> float:
    """ACR = fraction of the B groups whose reward std is below tau (AVSPO, He et al.), as count / B.

    >>> advantage_collapse_rate(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    0.5
    """
    return int(collapsed_groups(rewards, tau=tau).sum()) / rewards.shape[0]


def effective_collapse_rate(advantages: torch.Tensor, *, tau: float = 1e-6) -> float:
    """Fraction of groups whose advantages are all ~0 after the estimator: groups that teach nothing."""
    return int((advantages.abs().amax(dim=1) < tau).sum()) / advantages.shape[0]


def num_virtual_samples(group_size: int, num_collapsed: int, num_groups: int, alpha: float = 0.5) -> int:
    """K = max(1, min(G, ceil(G * ACR^alpha))), ACR = num_collapsed / num_groups (AVSPO's adaptive K).

    Exact, in integers: alpha is read as the fraction p/q (q <= 1000) it stands for (0.5 -> 1/2,
    0.3 -> 3/10; any other alpha is moved by < 1e-6), and ceil(G * (c/n)^(p/q)) is the smallest k with
    k^q * n^p >= G^q * c^p. (In floats, 25 * (7/25)^1.0 = 7.000000000000001 would give K = 8.)

    >>> num_virtual_samples(8, 1, 4), num_virtual_samples(8, 0, 4), num_virtual_samples(8, 4, 4)
    (4, 1, 8)
    """
    if group_size < 1 or num_groups < 1 or not 0 <= num_collapsed <= num_groups:
        raise ValueError(f"need G >= 1 and 0 <= num_collapsed <= num_groups >= 1; got "
                         f"G={group_size}, num_collapsed={num_collapsed}, num_groups={num_groups}")
    if not 0 <= alpha < math.inf:
        raise ValueError(f"alpha must be a finite number >= 0; got {alpha}")
    a = Fraction(alpha).limit_denominator(1000)
    p, q, g, c, n = a.numerator, a.denominator, group_size, num_collapsed, num_groups
    target = g**q * c**p  # G^q * c^p; k = G always satisfies k^q * n^p >= target, as c <= n
    ceil_k = next(k for k in range(g + 1) if k**q * n**p >= target)  # = ceil(G * (c/n)^(p/q))
    return max(1, min(g, ceil_k))  # AVSPO (He et al.): K = max(1, min(G, ceil(G * ACR^alpha)))


def virtual_rewards(values: torch.Tensor, num_virtual: int, reward_range: tuple[float, float]) -> torch.Tensor:
    """K virtual rewards [C, K] for C collapsed groups whose common reward is values [C].

    From the paper (as summarised): an all-correct group gets virtual rewards slightly below the
    maximum, an all-wrong group a small positive anchor; it gives no formula we could check. From the
    released code: K = 1, 0.0 for an all-correct group and 1.0 for an all-wrong one. Ours: a ladder from
    v towards the far end of [lo, hi], v + (target - v) * k / K for k = 1..K, target = lo if
    v - lo >= hi - v else hi; with K = 1 it is the released code.

    >>> virtual_rewards(torch.tensor([1.0, 0.0]), 2, (0.0, 1.0))
    tensor([[0.5000, 0.0000],
            [0.5000, 1.0000]])
    """
    lo, hi = reward_range
    if not lo < hi:
        raise ValueError(f"reward_range must be (lo, hi) with lo < hi; got {reward_range}")
    target = torch.where(values - lo >= hi - values, lo, hi)  # [C], ours: the far end of the range
    steps = torch.arange(1, num_virtual + 1, dtype=values.dtype, device=values.device) / num_virtual  # [K]
    return values[:, None] + (target - values)[:, None] * steps[None, :]  # [C, K], ours: the ladder


class AvspoInfo(NamedTuple):
    """What `avspo_advantages(..., return_info=True)` did, for the training log."""

    triggered: bool  # ACR > acr_threshold, so collapsed groups got virtual rewards
    num_collapsed: int  # collapsed groups in the batch: ACR = num_collapsed / B
    num_virtual: int  # K virtual rewards added to each collapsed group; 0 when not triggered


def avspo_advantages(
    rewards: torch.Tensor,
    *,
    acr_threshold: float = 0.5,
    alpha: float = 0.5,
    num_virtual: int | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
    tau: float = 1e-6,
    eps: float = 1e-4,
    return_info: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, AvspoInfo]:
    """AVSPO: GRPO advantages, except that when ACR > acr_threshold every collapsed group is normalised
    together with K virtual rewards V: A_i = (r_i - mean(R u V)) / (std(R u V) + eps).

    Virtual samples only shift the statistics: they get no advantage and carry no gradient. K is
    `num_virtual` if given, else `num_virtual_samples`. `num_virtual=1, acr_threshold=0.0` reproduces
    the released code. With return_info=True, returns (advantages, AvspoInfo).

    The trigger compares ACR = c / B, a correctly rounded Python float, with the threshold: an ACR equal
    to a threshold written as a fraction (0.5, 0.3, 0.57) rounds to the same float and does not
    trigger, and distinct fractions never round to the same float. (Not `c > threshold * B`:
    0.57 * 100 = 56.99999999999999 would trigger at ACR = 0.57.)

    >>> avspo_advantages(torch.tensor([[1.0, 1.0, 1.0]]), num_virtual=1, eps=0.0, return_info=True)
    (tensor([[0.5000, 0.5000, 0.5000]]), AvspoInfo(triggered=True, num_collapsed=1, num_virtual=1))
    """
    if num_virtual is not None and num_virtual < 1:
        raise ValueError(f"num_virtual must be >= 1 (or None for the adaptive K); got {num_virtual}")
    r = _as_float_groups(rewards)  # [B, G]
    advantages = grpo_advantages(r, eps=eps)  # [B, G]
    collapsed = collapsed_groups(r, tau=tau)  # [B]
    (num_groups, group_size), num_collapsed = r.shape, int(collapsed.sum())
    triggered = num_collapsed / num_groups > acr_threshold  # ours: strict ACR > threshold (see above)
    k = 0
    if triggered:
        k = num_virtual if num_virtual is not None else num_virtual_samples(group_size, num_collapsed, num_groups, alpha)
        real = r[collapsed]  # [C, G]
        virtual = virtual_rewards(real[:, 0], k, reward_range)  # [C, K]
        augmented = torch.cat([real, virtual], dim=1)  # [C, G + K]
        mean = augmented.mean(dim=1, keepdim=True)  # [C, 1]
        std = augmented.std(dim=1, keepdim=True)  # [C, 1], unbiased over G + K values
        advantages[collapsed] = (real - mean) / (std + eps)  # AVSPO (He et al.): real samples only, [C, G]
    advantages = advantages.to(_output_dtype(rewards))
    return (advantages, AvspoInfo(triggered, num_collapsed, k)) if return_info else advantages


@dataclass
class AdaptiveThreshold:
    """The ACR level above which AVSPO intervenes, adapted every step. The paper adapts it to ACR and
    training progress; its constants (value 0.5, lr 0.01, bounds [0.1, 0.9]) are the released code's.
    The update rule is ours (the sources give none):

        tau <- clip(tau + lr * sign(reward_mean - prev_reward) * (acr - tau), low, high)

    While the batch mean reward rises the threshold follows the live ACR, while it falls it moves away.
    The first update only records the reward. A checkpoint saves `dataclasses.asdict(threshold)` and
    restores `AdaptiveThreshold(**saved)`.
    """

    value: float = 0.5
    lr: float = 0.01
    low: float = 0.1
    high: float = 0.9
    prev_reward: float | None = None  # batch mean reward at the previous update; None before the first

    def __post_init__(self) -> None:
        if not self.low <= self.value <= self.high:
            raise ValueError(f"value={self.value} must lie in [low, high] = [{self.low}, {self.high}]")

    def update(self, acr: float, reward_mean: float) -> float:
        """Record this step's batch mean reward; from the second call on, move the threshold. Returns it."""
        if self.prev_reward is not None:
            delta = reward_mean - self.prev_reward
            sign = (delta > 0) - (delta < 0)
            moved = self.value + self.lr * sign * (acr - self.value)  # ours, see the class docstring
            self.value = min(self.high, max(self.low, moved))
        self.prev_reward = reward_mean
        return self.value


def aapo_margin(
    rewards: torch.Tensor, ref_rewards: torch.Tensor, *, delta_low: float = 0.2, delta_high: float = 0.28
) -> torch.Tensor:
    """Advantage margin clip(r_i - r_ref_i, -delta_low, delta_high), paired by sample index as in the
    AAPO code; r_ref_i is the reward of the i-th of G completions from the frozen reference model."""
    if rewards.shape != ref_rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and ref_rewards {tuple(ref_rewards.shape)} must match")
    if delta_low < 0 or delta_high < 0:
        raise ValueError(f"delta_low, delta_high are magnitudes >= 0 (clip to [-delta_low, delta_high]); "
                         f"got {delta_low}, {delta_high}")
    r, r_ref = _as_float_groups(rewards), _as_float_groups(ref_rewards)
    margin = (r - r_ref).clamp(-delta_low, delta_high)  # AAPO (Xiong et al.): the margin in A*, [B, G]
    return margin.to(_output_dtype(rewards))


def aapo_advantages(
    rewards: torch.Tensor,
    ref_rewards: torch.Tensor,
    *,
    delta_low: float = 0.2,
    delta_high: float = 0.28,
    scale: bool = True,
    eps: float = 1e-4,
) -> torch.Tensor:
    """AAPO: A*_i = GRPO advantage + advantage margin (Xiong et al., arXiv 2505.14264, the A* equation).

    A homogeneous group still gets signal as long as the policy beats (or trails) the reference.

    >>> aapo_advantages(torch.tensor([[1.0, 1.0]]), torch.tensor([[0.0, 1.0]]))
    tensor([[0.2800, 0.0000]])
    """
    r = _as_float_groups(rewards)  # both terms in >= float32, rounded to the output dtype once
    margin = aapo_margin(r, ref_rewards, delta_low=delta_low, delta_high=delta_high)  # [B, G]
    advantages = grpo_advantages(r, scale=scale, eps=eps) + margin  # AAPO (Xiong et al.): A* = A_GRPO + margin
    return advantages.to(_output_dtype(rewards))

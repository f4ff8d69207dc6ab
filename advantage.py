"""Group-relative advantage estimators: GRPO, AVSPO and AAPO, plus the collapse diagnostics.

Pure functions on reward tensors shaped [B, G]: B prompts, G sampled completions per prompt.
No model, no I/O: this file can be read, tested and reused on its own.

    GRPO   A_i = (r_i - mean_G) / (std_G + eps)                       Shao et al., arXiv 2402.03300
    ACR    fraction of groups whose rewards are all equal              He et al., arXiv 2605.21125 Eq. 4/11
    AVSPO  GRPO, but collapsed groups are normalised together with K
           virtual rewards when the batch ACR exceeds a threshold      He et al., Eq. 9, 10, 12
    AAPO   GRPO + clip(r_i - r_ref_i, -delta_low, delta_high)          Xiong et al., arXiv 2505.14264

Where this departs from (or chooses between readings of) the papers:
  1. std is the unbiased (N-1) estimate everywhere, as in TRL and both papers' released code.
  2. AVSPO's virtual rewards are an evenly spaced ladder from the group's common value towards the
     far end of the reward range (see `virtual_rewards`), which fixes the all-wrong case of Eq. 10.
"""

import math

import torch


def _as_float_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Check the [B, G] shape and return the rewards in a dtype at least as precise as float32."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be shaped [B, G] (prompts, samples); got shape {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G must be >= 2 to compare samples within a group; got G={rewards.shape[1]}")
    return rewards.to(torch.promote_types(rewards.dtype, torch.float32))


def _output_dtype(rewards: torch.Tensor) -> torch.dtype:
    return rewards.dtype if rewards.is_floating_point() else torch.float32


def grpo_advantages(rewards: torch.Tensor, *, scale: bool = True, eps: float = 1e-4) -> torch.Tensor:
    """GRPO: A_i = (r_i - mean_G) / (std_G + eps); with scale=False, A_i = r_i - mean_G (Dr. GRPO).

    >>> grpo_advantages(torch.tensor([[1.0, 0.0, 0.0, 0.0]]), eps=0.0)
    tensor([[ 1.5000, -0.5000, -0.5000, -0.5000]])
    """
    r = _as_float_groups(rewards)  # [B, G]
    centred = r - r.mean(dim=1, keepdim=True)  # [B, G]
    if scale:
        centred = centred / (r.std(dim=1, keepdim=True) + eps)  # unbiased std, [B, 1]
    return centred.to(_output_dtype(rewards))


def collapsed_groups(rewards: torch.Tensor, *, tau: float = 1e-6) -> torch.Tensor:
    """Bool [B]: True where a group's rewards are all (nearly) equal, population std < tau."""
    return _as_float_groups(rewards).std(dim=1, correction=0) < tau


def advantage_collapse_rate(rewards: torch.Tensor, *, tau: float = 1e-6) -> float:
    """ACR = fraction of the B groups whose reward std is below tau (AVSPO Eq. 4/11).

    >>> advantage_collapse_rate(torch.tensor([[1.0, 1.0], [0.0, 1.0], [0.0, 0.0], [1.0, 0.0]]))
    0.5
    """
    return collapsed_groups(rewards, tau=tau).float().mean().item()


def effective_collapse_rate(advantages: torch.Tensor, *, tau: float = 1e-6) -> float:
    """Fraction of groups whose advantages are all ~0 after the estimator: groups that teach nothing."""
    return (advantages.abs().amax(dim=1) < tau).float().mean().item()


def num_virtual_samples(group_size: int, acr: float, alpha: float = 0.5) -> int:
    """K = max(1, min(G, ceil(G * ACR^alpha))) virtual rewards per collapsed group (AVSPO Eq. 9)."""
    return max(1, min(group_size, math.ceil(group_size * acr**alpha)))


def virtual_rewards(values: torch.Tensor, num_virtual: int, reward_range: tuple[float, float]) -> torch.Tensor:
    """K virtual rewards [C, K] for C collapsed groups whose common reward is values [C].

    AVSPO Eq. 10 places virtual rewards just below the group's r_max, which leaves an all-wrong group
    (r_max = 0) with zero variance; the paper's text says all-correct groups get a value slightly below
    the maximum and all-wrong groups a small positive anchor. We read it as a ladder from v towards the
    far end of [lo, hi]: v + (target - v) * k / K for k = 1..K, target = lo if v - lo >= hi - v else hi.
    With K = 1 this is exactly the released code: 0.0 for an all-correct group, 1.0 for an all-wrong one.

    >>> virtual_rewards(torch.tensor([1.0, 0.0]), 2, (0.0, 1.0))
    tensor([[0.5000, 0.0000],
            [0.5000, 1.0000]])
    """
    lo, hi = reward_range
    if not lo < hi:
        raise ValueError(f"reward_range must be (lo, hi) with lo < hi; got {reward_range}")
    target = torch.where(values - lo >= hi - values, lo, hi)  # [C]
    steps = torch.arange(1, num_virtual + 1, dtype=values.dtype, device=values.device) / num_virtual  # [K]
    return values[:, None] + (target - values)[:, None] * steps[None, :]  # [C, K]


def avspo_advantages(
    rewards: torch.Tensor,
    *,
    acr_threshold: float = 0.5,
    alpha: float = 0.5,
    num_virtual: int | None = None,
    reward_range: tuple[float, float] = (0.0, 1.0),
    tau: float = 1e-6,
    eps: float = 1e-4,
) -> torch.Tensor:
    """AVSPO: GRPO advantages, except that when ACR > acr_threshold every collapsed group is normalised
    together with K virtual rewards: A_i = (r_i - mean(R u V)) / (std(R u V) + eps) (AVSPO Eq. 10).

    Virtual samples only shift the statistics: they get no advantage and carry no gradient. K is
    `num_virtual` if given, else the adaptive Eq. 9. `num_virtual=1, acr_threshold=0.0` reproduces the
    released code.

    >>> avspo_advantages(torch.tensor([[1.0, 1.0, 1.0]]), num_virtual=1, eps=0.0)
    tensor([[0.5000, 0.5000, 0.5000]])
    """
    r = _as_float_groups(rewards)  # [B, G]
    advantages = grpo_advantages(r, eps=eps)  # [B, G]
    collapsed = collapsed_groups(r, tau=tau)  # [B]
    acr = collapsed.float().mean().item()
    if acr <= acr_threshold:
        return advantages.to(_output_dtype(rewards))
    group_size = r.shape[1]
    k = num_virtual if num_virtual is not None else num_virtual_samples(group_size, acr, alpha)
    real = r[collapsed]  # [C, G]
    virtual = virtual_rewards(real[:, 0], k, reward_range)  # [C, K]
    augmented = torch.cat([real, virtual], dim=1)  # [C, G + K]
    mean = augmented.mean(dim=1, keepdim=True)  # [C, 1]
    std = augmented.std(dim=1, keepdim=True)  # [C, 1], unbiased over G + K values
    advantages[collapsed] = (real - mean) / (std + eps)  # [C, G]
    return advantages.to(_output_dtype(rewards))


class AdaptiveThreshold:
    """The ACR level above which AVSPO intervenes, adapted every step (AVSPO Eq. 12):

        tau <- clip(tau + lr * sign(reward_delta) * (acr - tau), low, high)

    reward_delta is the change of the batch mean reward since the previous step: while reward rises
    the threshold follows the live ACR, while it falls the threshold moves away from it.
    """

    def __init__(self, init: float = 0.5, lr: float = 0.01, low: float = 0.1, high: float = 0.9):
        if not low <= init <= high:
            raise ValueError(f"init={init} must lie in [low, high] = [{low}, {high}]")
        self.value, self.lr, self.low, self.high = init, lr, low, high

    def update(self, acr: float, reward_delta: float) -> float:
        sign = (reward_delta > 0) - (reward_delta < 0)
        self.value = min(self.high, max(self.low, self.value + self.lr * sign * (acr - self.value)))
        return self.value


def aapo_margin(
    rewards: torch.Tensor, ref_rewards: torch.Tensor, *, delta_low: float = 0.2, delta_high: float = 0.28
) -> torch.Tensor:
    """Advantage margin clip(r_i - r_ref_i, -delta_low, delta_high), paired by sample index as in the
    AAPO code; r_ref_i is the reward of the i-th of G completions from the frozen reference model."""
    if rewards.shape != ref_rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and ref_rewards {tuple(ref_rewards.shape)} must match")
    r, r_ref = _as_float_groups(rewards), _as_float_groups(ref_rewards)
    return (r - r_ref).clamp(-delta_low, delta_high)  # [B, G]


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
    margin = aapo_margin(rewards, ref_rewards, delta_low=delta_low, delta_high=delta_high)  # [B, G]
    advantages = grpo_advantages(rewards, scale=scale, eps=eps).to(margin.dtype) + margin
    return advantages.to(_output_dtype(rewards))

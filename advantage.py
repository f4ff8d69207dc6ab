"""Group-relative advantage estimators: GRPO, AVSPO and AAPO, plus the collapse diagnostics.

Pure functions on reward tensors shaped [B, G]: B prompts, G sampled completions per prompt.
No model, no I/O: this file can be read, tested and reused on its own.

    GRPO   A_i = (r_i - mean_G) / (std_G + eps)                       Shao et al., arXiv 2402.03300
    ACR    fraction of the B groups whose rewards are all equal        He et al., arXiv 2605.21125
    AVSPO  GRPO, but while ACR exceeds an adaptive threshold, collapsed
           groups are normalised together with K virtual rewards       He et al., arXiv 2605.21125
    AAPO   GRPO + clip(r_i - r_ref_i, -delta_low, delta_high)          Xiong et al., arXiv 2505.14264

Sources. AVSPO has no released code (its repository holds a licence and an empty README); a summary of
its paper (arXiv 2605.21125) gives no equation numbers, so none are cited. Each choice is one of four kinds:
  paper (via the summary): the GRPO advantage; ACR as the share of groups with reward std below tau;
      virtual rewards that join a collapsed group's mean and std but get no advantage ("stratified":
      slightly below the maximum for an all-correct group, a small positive anchor for an all-wrong
      one); a trigger from the live ACR and training progress whose threshold adapts so that stable
      phases are not over-corrected; AAPO's A* = GRPO advantage + clipped margin.
  code (TRL's GRPOTrainer, AAPO's released trainers): unbiased std, eps = 1e-4, AAPO's
      clamp(-0.2, 0.28), r_ref_i paired with r_i by sample index.
  ours: delta = 0.1 (`virtual_rewards`); the threshold's rule and constants (`AdaptiveThreshold`);
      the strict `ACR > threshold` trigger; ACR per step's batch.
  unverified (in an earlier version of our notes, in no source we can check): tau = 1e-6 and
      K = max(1, min(G, ceil(G * ACR^alpha))) with alpha = 0.5 (`num_virtual_samples`).

AAPO's code departs from its paper three times; we follow the paper: it divides by the std only with
`scale_rewards` on (we divide), its vLLM path samples r_ref from the current policy (we sample the frozen
reference), and its configs set a KL `beta` its loss never uses (ours is train.py's --beta, 0 by default).

Exactness: an all-equal group gets advantage exactly 0 from GRPO, from AVSPO when it does not intervene
and from AAPO's GRPO part, in any dtype (rewards are centred on the group's first one before averaging);
ACR, the trigger and K come from integer counts. Dtypes: computed in at least float32, returned in the
input's float dtype (int and bool rewards give float32).
"""

import math
from dataclasses import dataclass
from fractions import Fraction
from typing import NamedTuple

import torch


def _as_float_groups(rewards: torch.Tensor) -> torch.Tensor:
    """Check the [B, G] shape and return the rewards in a dtype at least as precise as float32."""
    if rewards.ndim != 2:
        raise ValueError(f"rewards must be shaped [B, G] (prompts, samples); got {tuple(rewards.shape)}")
    if rewards.shape[1] < 2:
        raise ValueError(f"group size G must be >= 2 to compare samples in a group; got G={rewards.shape[1]}")
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
        centred = centred / (centred.std(dim=1, keepdim=True) + eps)  # GRPO (Shao et al.), unbiased std
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
    """K = max(1, min(G, ceil(G * ACR^alpha))), ACR = num_collapsed / num_groups: more virtual rewards
    (larger advantages, see `avspo_advantages`) the more of the batch has collapsed. Unverified: the
    formula and alpha = 0.5 are in no source we can check; `num_virtual=` in `avspo_advantages` fixes K.

    Exact, in integers: alpha read as the fraction p/q (q <= 1000) it stands for, ceil(G * (c/n)^(p/q)) is
    the smallest k with k^q * n^p >= G^q * c^p (in floats, 25 * (7/25)^1.0 = 7.000000000000001: K = 8).

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
    return max(1, min(g, ceil_k))  # unverified: K = max(1, min(G, ceil(G * ACR^alpha)))


def virtual_rewards(values: torch.Tensor, num_virtual: int, delta: float,
                    reward_range: tuple[float, float]) -> torch.Tensor:
    """K virtual rewards [C, K] for C collapsed groups whose common reward is values [C].

    Stratified assignment (AVSPO, He et al., as summarised): an all-correct group gets K values
    slightly below its reward, v - delta; an all-wrong group a small positive anchor, v + delta. A
    collapsed group at another value goes down if it lies in the upper half of reward_range, else up.
    delta = 0.1 is ours (see `avspo_advantages` for why its size hardly matters).

    >>> virtual_rewards(torch.tensor([1.0, 0.0]), 2, 0.1, (0.0, 1.0))
    tensor([[0.9000, 0.9000],
            [0.1000, 0.1000]])
    """
    lo, hi = reward_range
    if not 0 < delta <= hi - lo:
        raise ValueError(f"delta must lie in (0, hi - lo] = (0, {hi - lo}]; got {delta}")
    virtual = torch.where(at_top(values, reward_range), values - delta, values + delta)  # [C], stratified
    return virtual[:, None].expand(-1, num_virtual)  # [C, K]


def at_top(values: torch.Tensor, reward_range: tuple[float, float]) -> torch.Tensor:
    """Bool [C]: True where a collapsed group's common reward lies in the upper half of reward_range, the
    all-correct end; False at the all-wrong end."""
    lo, hi = reward_range
    if not lo < hi:
        raise ValueError(f"reward_range must be (lo, hi) with lo < hi; got {reward_range}")
    return values - lo >= hi - values


AVSPO_ENDS = ("both", "all-wrong", "all-correct")  # which collapsed groups AVSPO treats (`avspo_advantages`)


class AvspoInfo(NamedTuple):
    """What `avspo_advantages(..., return_info=True)` did, for the training log."""

    triggered: bool  # ACR > acr_threshold, so collapsed groups got virtual rewards
    num_collapsed: int  # collapsed groups in the batch: ACR = num_collapsed / B
    num_treated: int  # collapsed groups given virtual rewards (those at `ends`); 0 when not triggered
    num_virtual: int  # K virtual rewards added to each treated group; 0 when not triggered


def avspo_advantages(
    rewards: torch.Tensor,
    *,
    acr_threshold: float = 0.5,
    alpha: float = 0.5,
    num_virtual: int | None = None,
    delta: float = 0.1,
    reward_range: tuple[float, float] = (0.0, 1.0),
    ends: str = "both",
    tau: float = 1e-6,
    eps: float = 1e-4,
    return_info: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, AvspoInfo]:
    """AVSPO: GRPO advantages, except that when ACR > acr_threshold every collapsed group is normalised
    together with K virtual rewards V: A_i = (r_i - mean(R u V)) / (std(R u V) + eps).

    Virtual samples only shift the statistics: they get no advantage and carry no gradient. K is
    `num_virtual` if given, else `num_virtual_samples`; V is `virtual_rewards`. `ends` picks the collapsed
    groups treated: "both" (AVSPO), or only the "all-wrong" or "all-correct" ones (the paper's ablation of
    the two ends); the trigger and K count every collapsed group. return_info=True adds an AvspoInfo.

    Only K sets the size; V's side sets the sign. The G real rewards all equal v and the K virtual ones
    v -+ delta, so each real reward lies K delta / (G + K) from the mean of the G + K, away from V, and
    their unbiased std is delta sqrt(K G / ((G + K)(G + K - 1))). Hence, for any delta >> eps,

        A_i = +-sqrt(K (G + K - 1) / (G (G + K)))     (+ all-correct, - all-wrong)

    With G = 8: K = 1 gives 1/3, K = 8 gives 0.97. Under this z-score a virtual reward's value cannot matter
    beyond its side: the paper's stratified vs fixed partial-credit ablation can only differ under another
    normalisation (the summary gives none).

    ACR = c / B, correctly rounded: an ACR equal to the threshold does not trigger (c > threshold * B can).

    >>> advantages, info = avspo_advantages(torch.ones(1, 3), num_virtual=1, eps=0.0, return_info=True)
    >>> advantages, info.triggered, info.num_treated, info.num_virtual
    (tensor([[0.5000, 0.5000, 0.5000]]), True, 1, 1)
    """
    if num_virtual is not None and num_virtual < 1:
        raise ValueError(f"num_virtual must be >= 1 (or None for the adaptive K); got {num_virtual}")
    if ends not in AVSPO_ENDS:
        raise ValueError(f"ends must be one of {', '.join(AVSPO_ENDS)}; got {ends!r}")
    r = _as_float_groups(rewards)  # [B, G]
    advantages = grpo_advantages(r, eps=eps)  # [B, G]
    collapsed = collapsed_groups(r, tau=tau)  # [B]
    (num_groups, group_size), num_collapsed = r.shape, int(collapsed.sum())
    triggered = num_collapsed / num_groups > acr_threshold  # ours: strict ACR > threshold (see above)
    k, treated = 0, torch.zeros_like(collapsed)  # [B]
    if triggered:
        k = num_virtual or num_virtual_samples(group_size, num_collapsed, num_groups, alpha)
        treated = collapsed if ends == "both" else collapsed & (at_top(r[:, 0], reward_range)
                                                                == (ends == "all-correct"))  # [B]
    if treated.any():
        real = r[treated]  # [C, G]
        virtual = virtual_rewards(real[:, 0], k, delta, reward_range)  # [C, K]
        augmented = torch.cat([real, virtual], dim=1)  # [C, G + K]
        mean = augmented.mean(dim=1, keepdim=True)  # [C, 1]
        std = augmented.std(dim=1, keepdim=True)  # [C, 1], unbiased over G + K values
        advantages[treated] = (real - mean) / (std + eps)  # AVSPO (He et al.): real samples only, [C, G]
    advantages = advantages.to(_output_dtype(rewards))
    info = AvspoInfo(triggered, num_collapsed, int(treated.sum()), k)
    return (advantages, info) if return_info else advantages


@dataclass
class AdaptiveThreshold:
    """The ACR above which AVSPO intervenes: it falls while training stalls and rises while it improves.

    The paper (as summarised) triggers from the live ACR and training progress, adapting the threshold so
    that stable phases are not over-corrected; it gives no rule. Ours reads progress as a new best of the
    smoothed batch reward, and moves one `step` per update, so one noisy batch cannot move it far:

        ema   <- ema + (1 - smoothing) * (reward_mean - ema)
        moves <- moves + 1 if ema > best else moves - 1,  best <- max(best, ema)
        value  = clip(start + moves * step, low, high)     (no move past a bound: it turns back at once)

    From the middle, 8 steps reach a bound, 16 cross the range. A step with no collapsed group (acr = 0)
    leaves the value: there was nothing to intervene on. The first update only starts the average. All
    constants are ours; `benchmarks/trigger_table.py` simulates how often it fires. A checkpoint saves
    `dataclasses.asdict(threshold)` and restores `AdaptiveThreshold(**saved)`.

    The count of moves is an integer and the value is computed from it in exact decimals (start and step
    as written), rounded to a float once: 0.5 + 5 x 0.05 is the float 0.75, the same float as an ACR of
    6/8. Adding 0.05 step by step in floats drifts to 0.7499999999999999, and that ACR would then trigger.
    """

    start: float = 0.5
    step: float = 0.05
    low: float = 0.1
    high: float = 0.9
    smoothing: float = 0.8  # weight of the past in the reward average: about the last 5 steps count
    moves: int = 0  # steps up minus steps down so far
    reward_ema: float | None = None  # smoothed batch mean reward; None before the first update
    best_ema: float | None = None  # the highest reward_ema so far

    def __post_init__(self) -> None:
        if not all(math.isfinite(x) for x in (self.start, self.step, self.low, self.high)):
            raise ValueError(f"start, step, low and high must be finite; got {self}")
        if not self.low <= self.start <= self.high:
            raise ValueError(f"start={self.start} must lie in [low, high] = [{self.low}, {self.high}]")
        if not (self.step > 0 and 0 <= self.smoothing < 1):
            raise ValueError(f"need step > 0 and 0 <= smoothing < 1; got {self.step}, {self.smoothing}")

    @property
    def value(self) -> float:
        """clip(start + moves * step, low, high), exact in decimals, then one rounding to a float."""
        exact = Fraction(repr(self.start)) + self.moves * Fraction(repr(self.step))
        return float(min(Fraction(repr(self.high)), max(Fraction(repr(self.low)), exact)))

    def update(self, acr: float, reward_mean: float) -> float:
        """Fold this step's ACR and batch mean reward in; returns the threshold for the next step."""
        if self.reward_ema is None:
            self.reward_ema = self.best_ema = reward_mean
            return self.value
        # ema + (1 - s)(r - ema), not s ema + (1 - s) r: a reward equal to the average leaves it exactly where
        # it is, where the other form can round up one ulp, a "new best" that moves the threshold up
        self.reward_ema = self.reward_ema + (1 - self.smoothing) * (reward_mean - self.reward_ema)
        improving = self.reward_ema > self.best_ema
        self.best_ema = max(self.best_ema, self.reward_ema)
        if acr > 0:  # ours: the threshold adapts on the steps it could act on
            if improving and self.value < self.high:
                self.moves += 1
            elif not improving and self.value > self.low:
                self.moves -= 1
        return self.value


def aapo_margin(
    rewards: torch.Tensor, ref_rewards: torch.Tensor, *, delta_low: float = 0.2, delta_high: float = 0.28
) -> torch.Tensor:
    """Advantage margin clip(r_i - r_ref_i, -delta_low, delta_high), paired by sample index as in the
    AAPO code; r_ref_i is the reward of the i-th of G completions from the frozen reference model."""
    if rewards.shape != ref_rewards.shape:
        raise ValueError(f"rewards {tuple(rewards.shape)} and ref_rewards {tuple(ref_rewards.shape)} differ")
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
    advantages = grpo_advantages(r, scale=scale, eps=eps) + margin  # AAPO (Xiong et al.): A* = A + margin
    return advantages.to(_output_dtype(rewards))

"""How often AVSPO's trigger fires over a simulated 40-step run, for the previous threshold rule and \
the current one.

    python benchmarks/trigger_table.py            # the README's table: 200 runs per cell, a few seconds

Each run has B = 8 groups per step. The batch ACR is drawn binomially (each group collapsed with probability
`mean_acr`, so it moves in steps of 1/8) and the batch mean reward follows a trend (rising 0.2 -> 0.8, flat at
0.5, falling 0.8 -> 0.2) plus Gaussian noise of std 0.08, clipped to [0, 1]. The trigger fires on a step when
its ACR exceeds the threshold; the threshold then updates, as in train.py. A cell is the mean number of fired
steps out of 40, and the range of thresholds seen. Seeds are fixed: the table is the same on every run.
"""

import random
import sys
from dataclasses import dataclass
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from advantage import AdaptiveThreshold  # noqa: E402
from infra.flags import FlagParser, at_least  # noqa: E402

TRENDS = ("rising", "flat", "falling")
MEAN_ACRS = (0.25, 0.35, 0.45, 0.55)


@dataclass
class PreviousThreshold:
    """The rule before this one (commit 081436f):
    tau <- clip(tau + 0.01 sign(reward - prev) (acr - tau), 0.1, 0.9)."""

    value: float = 0.5
    prev_reward: float | None = None

    def update(self, acr: float, reward_mean: float) -> float:
        if self.prev_reward is not None:
            delta = reward_mean - self.prev_reward
            sign = (delta > 0) - (delta < 0)
            self.value = min(0.9, max(0.1, self.value + 0.01 * sign * (acr - self.value)))
        self.prev_reward = reward_mean
        return self.value


def trend_reward(trend: str, step: int, steps: int) -> float:
    progress = step / (steps - 1)
    return {"rising": 0.2 + 0.6 * progress, "flat": 0.5, "falling": 0.8 - 0.6 * progress}[trend]


def simulate(rule, mean_acr: float, trend: str, runs: int, steps: int = 40, groups: int = 8,
             noise: float = 0.08) -> tuple[float, float, float]:
    """(mean fired steps per run, lowest and highest threshold seen) over `runs` seeded runs of `rule()`."""
    fired, seen = 0, []
    for seed in range(runs):
        rng, threshold = random.Random(seed), rule()
        for step in range(steps):
            acr = sum(rng.random() < mean_acr for _ in range(groups)) / groups
            reward = min(1.0, max(0.0, trend_reward(trend, step, steps) + rng.gauss(0.0, noise)))
            fired += acr > threshold.value  # as avspo_advantages: strictly above
            seen.append(threshold.update(acr, reward))
    return fired / runs, min(seen), max(seen)


def fired_steps(rule, mean_acr: float, trend: str, runs: int) -> float:
    """Mean steps out of 40 on which the trigger fired."""
    return simulate(rule, mean_acr, trend, runs)[0]


def main(argv: list[str] | None = None) -> str:
    parser = FlagParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=at_least(1), default=200, help="simulated runs per cell")
    args = parser.parse_args(argv)
    lines = ["| mean ACR | rule | rising reward | flat | falling | thresholds seen |",
             "|---|---|---|---|---|---|"]
    for mean_acr in MEAN_ACRS:
        for name, rule in (("previous", PreviousThreshold), ("current", AdaptiveThreshold)):
            cells = [simulate(rule, mean_acr, trend, args.runs) for trend in TRENDS]
            low, high = min(c[1] for c in cells), max(c[2] for c in cells)
            lines.append(f"| {mean_acr:.2f} | {name} | " + " | ".join(f"{c[0]:.1f} / 40" for c in cells)
                         + f" | {low:.2f}-{high:.2f} |")
    table = "\n".join(lines)
    print(table)
    return table


if __name__ == "__main__":
    main()

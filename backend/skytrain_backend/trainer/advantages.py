"""GRPO advantages: how much better each rollout did than its siblings of the same scenario."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Rewards whose spread is below this fraction of their size (or of 1, for small rewards) are
# equal up to float noise: such a group says nothing about which behaviour is better.
RELATIVE_NOISE = 1e-6
# Added to the standard deviation before dividing by it (ART's epsilon), so a group whose
# rewards barely differ gets small advantages, not full-size ones.
STD_EPSILON = 1e-6


def group_advantages(rewards: Sequence[float], *, scale: bool) -> list[float] | None:
    """Reward minus the group mean, divided by the group's standard deviation (plus
    ``STD_EPSILON``) when ``scale``.

    Returns None when the rewards are all equal up to float noise: such a group is skipped
    rather than trained with zero advantages. The standard deviation is the population one
    (rewards 0 and 1 get -1 and +1, less a millionth).
    """
    if not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((reward - mean) ** 2 for reward in rewards) / len(rewards))
    if std <= RELATIVE_NOISE * max(1.0, max(abs(reward) for reward in rewards)):
        return None
    return [(reward - mean) / (std + STD_EPSILON) if scale else reward - mean for reward in rewards]


def balance_advantages(advantages: Sequence[float], *, balance: float) -> list[float]:
    """ART's ``advantage_balance`` in [-1, 1]: above 0 negative advantages are scaled by
    ``1 - balance`` (1: only positive ones are trained), below 0 positive ones by
    ``1 + balance`` (-1: only negative ones)."""
    if balance > 0:
        return [a if a > 0 else a * (1 - balance) for a in advantages]
    if balance < 0:
        return [a if a < 0 else a * (1 + balance) for a in advantages]
    return list(advantages)

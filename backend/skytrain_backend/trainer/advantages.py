"""GRPO advantages: how much better each rollout did than its siblings of the same scenario."""

from __future__ import annotations

import math
from collections.abc import Sequence

# Rewards closer than this are treated as equal: float noise is not a learning signal.
_ZERO_VARIANCE_STD = 1e-8


def group_advantages(rewards: Sequence[float], *, scale: bool) -> list[float] | None:
    """Reward minus the group mean, divided by the group's standard deviation when ``scale``.

    Returns None when every reward is the same: such a group says nothing about which
    behaviour is better, so it is skipped rather than trained with zero advantages. The
    standard deviation is the population one (a group of two rewards 0 and 1 gets -1 and +1).
    """
    if not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((reward - mean) ** 2 for reward in rewards) / len(rewards))
    if std <= _ZERO_VARIANCE_STD:
        return None
    return [(reward - mean) / std if scale else reward - mean for reward in rewards]

"""GRPO advantages: how much better each rollout did than its siblings of the same scenario.

Two rules for when a group's rewards are "all equal" (no signal): skytrain's, relative to the
rewards' size (float noise), and ART's, absolute (``art_equal_rewards``). And ART's
aggregation of a job (``art_weights``): each trajectory weighs the same, and the advantages are
rescaled to mean magnitude 1.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

# Rewards whose spread is below this fraction of their size (or of 1, for small rewards) are
# equal up to float noise: such a group says nothing about which behaviour is better.
RELATIVE_NOISE = 1e-6
# ART's rule instead: rewards within this of the group's first one are equal, whatever their
# size (art/utils/grpo.py), so [1e6, 1e6 + 0.5] is a signal.
ART_EQUAL_REWARDS = 1e-12
# Added to the standard deviation before dividing by it (ART's epsilon), so a group whose
# rewards barely differ gets small advantages, not full-size ones.
STD_EPSILON = 1e-6
# Added to a trajectory's trained token count before taking its inverse (ART's).
WEIGHT_EPSILON = 1e-6


def art_equal_rewards(rewards: Sequence[float]) -> bool:
    """ART's zero-variance rule: one reward, or every reward within 1e-12 of the first."""
    return len(rewards) <= 1 or all(
        abs(reward - rewards[0]) <= ART_EQUAL_REWARDS for reward in rewards[1:]
    )


def group_advantages(
    rewards: Sequence[float], *, scale: bool, art_rule: bool = False
) -> list[float] | None:
    """Reward minus the group mean, divided by the group's standard deviation (plus
    ``STD_EPSILON``) when ``scale``.

    Returns None when the rewards are all equal (to float noise, or with ``art_rule`` by
    ART's absolute rule): such a group is skipped rather than trained with zero advantages.
    The standard deviation is the population one (rewards 0 and 1 get -1 and +1, less a
    millionth).
    """
    if not rewards:
        return None
    mean = sum(rewards) / len(rewards)
    std = math.sqrt(sum((reward - mean) ** 2 for reward in rewards) / len(rewards))
    if art_rule:
        if art_equal_rewards(rewards):
            return None
    elif std <= RELATIVE_NOISE * max(1.0, max(abs(reward) for reward in rewards)):
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


def art_weights(
    token_counts: Sequence[int], advantages: Sequence[float], site_counts: Sequence[int]
) -> tuple[list[float], list[float]]:
    """ART's per-trajectory token weights and rescaled advantages for one job.

    Trajectory ``i`` has ``token_counts[i]`` trained tokens in all (its histories together),
    of which ``site_counts[i]`` are trained in this job (the rest were cut by truncation), and
    advantage ``advantages[i]``. Each of its tokens weighs 1 / (its token count + 1e-6),
    normalized so the job's tokens weigh 1 on average: a step's loss, the weighted sum over
    its tokens divided by their number, then averages trajectories rather than tokens. The
    advantages are divided by the job's weighted mean |advantage| (mean over trajectories of
    |A|), so their scale does not depend on the rewards'. As art/preprocessing/pack.py.
    """
    raw = [1 / (count + WEIGHT_EPSILON) for count in token_counts]
    sites = sum(site_counts)
    if not sites:
        return raw, list(advantages)
    mean_weight = sum(w * n for w, n in zip(raw, site_counts, strict=True)) / sites
    weights = [w / mean_weight for w in raw] if mean_weight > 0 else raw
    mean_magnitude = (
        sum(abs(a) * w * n for a, w, n in zip(advantages, weights, site_counts, strict=True))
        / sites
    )
    if mean_magnitude > 0:
        return weights, [a / mean_magnitude for a in advantages]
    return weights, list(advantages)

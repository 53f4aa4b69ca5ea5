"""GRPO advantages and ART's advantage_balance."""

from __future__ import annotations

import pytest

from skytrain_backend.trainer.advantages import (
    art_weights,
    balance_advantages,
    group_advantages,
)


def test_rewards_equal_up_to_float_noise_carry_no_advantage() -> None:
    # Before: [-0.58, 1.73, -0.58, -0.58] for a difference of 1e-7.
    assert group_advantages([1.0, 1.0 + 1e-7, 1.0, 1.0], scale=True) is None
    assert group_advantages([1000.0, 1000.0 + 1e-4], scale=True) is None  # relative to size
    assert group_advantages([2.0, 2.0], scale=False) is None


def test_scaled_advantages_divide_by_the_std_plus_arts_epsilon() -> None:
    assert group_advantages([0.0, 1.0], scale=True) == pytest.approx([-1.0, 1.0], abs=1e-5)
    # A spread barely above the noise threshold gets small advantages, not unit-sized ones.
    small = group_advantages([0.0, 4e-6], scale=True)
    assert small is not None and max(abs(a) for a in small) < 0.7
    assert group_advantages([0.0, 1.0, 2.0], scale=False) == [-1.0, 0.0, 1.0]


def test_advantage_balance_scales_one_side_as_art_does() -> None:
    advantages = [-1.0, -0.5, 0.5, 1.0]
    assert balance_advantages(advantages, balance=0.0) == advantages
    assert balance_advantages(advantages, balance=0.5) == [-0.5, -0.25, 0.5, 1.0]
    assert balance_advantages(advantages, balance=1.0) == [-0.0, -0.0, 0.5, 1.0]
    assert balance_advantages(advantages, balance=-0.5) == [-1.0, -0.5, 0.25, 0.5]
    assert balance_advantages(advantages, balance=-1.0) == [-1.0, -0.5, 0.0, 0.0]


def test_arts_rule_for_equal_rewards_is_absolute() -> None:
    # skytrain's rule calls half a point at 1e6 float noise; ART's trains it.
    assert group_advantages([1e6, 1e6 + 0.5], scale=True) is None
    art = group_advantages([1e6, 1e6 + 0.5], scale=True, art_rule=True)
    assert art == pytest.approx([-1.0, 1.0], abs=1e-5)
    assert group_advantages([1.0, 1.0 + 1e-13], scale=True, art_rule=True) is None
    assert group_advantages([1.0, 1.0 + 1e-7], scale=False, art_rule=True) is not None


def test_art_weights_average_trajectories_and_rescale_advantages() -> None:
    # A 1-token and a 3-token trajectory: each gets half of the loss, not a quarter / three.
    weights, advantages = art_weights([1, 3], [2.0, -1.0], [1, 3])
    per_trajectory = [w * n for w, n in zip(weights, [1, 3], strict=True)]
    assert per_trajectory == pytest.approx([2.0, 2.0])  # the 4 tokens' mean weight is 1
    # Divided by the mean |A| over trajectories (1.5), as ART's weighted token mean gives.
    assert advantages == pytest.approx([2.0 / 1.5, -1.0 / 1.5])
    # Tokens cut by truncation keep their trajectory's weight but leave the means.
    weights, _ = art_weights([4, 4], [1.0, -1.0], [4, 2])
    assert weights[0] == pytest.approx(weights[1])

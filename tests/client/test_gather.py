"""gather_trajectory_groups: concurrency, the exception budget, and the progress bar."""

from __future__ import annotations

import asyncio

import pytest

import skytrain


def trajectory(reward: float) -> skytrain.Trajectory:
    return skytrain.Trajectory(
        messages_and_choices=[{"role": "user", "content": f"r={reward}"}], reward=reward
    )


async def rollout(reward: float, *, fail: str | None = None) -> skytrain.Trajectory:
    await asyncio.sleep(0)
    if fail is not None:
        raise RuntimeError(fail)
    return trajectory(reward)


async def test_gather_runs_every_rollout_and_keeps_group_and_trajectory_order() -> None:
    groups = await skytrain.gather_trajectory_groups(
        (skytrain.TrajectoryGroup(rollout(g + t / 10) for t in range(3)) for g in range(4)),
        pbar_desc=None,
    )
    assert [[t.reward for t in group.trajectories] for group in groups] == [
        [g + t / 10 for t in range(3)] for g in range(4)
    ]


async def test_rollouts_run_concurrently() -> None:
    """Every rollout waits until all have started: only a concurrent gather can finish."""
    started = 0
    all_started = asyncio.Event()

    async def waits_for_the_others() -> skytrain.Trajectory:
        nonlocal started
        started += 1
        if started == 6:
            all_started.set()
        await asyncio.wait_for(all_started.wait(), timeout=30)
        return trajectory(1.0)

    groups = await skytrain.gather_trajectory_groups(
        [skytrain.TrajectoryGroup(waits_for_the_others() for _ in range(3)) for _ in range(2)],
        pbar_desc=None,
    )
    assert sum(len(group) for group in groups) == 6


async def test_failed_rollout_is_recorded_in_its_group_and_dropped() -> None:
    groups = await skytrain.gather_trajectory_groups(
        [
            skytrain.TrajectoryGroup(
                [rollout(1.0), rollout(0.0, fail="env crashed"), rollout(0.5)]
            ),
            skytrain.TrajectoryGroup([rollout(0.25)]),
        ],
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [[t.reward for t in g.trajectories] for g in groups] == [[1.0, 0.5], [0.25]]
    (failure,) = groups[0].exceptions
    assert failure.type == "builtins.RuntimeError"
    assert failure.message == "env crashed"
    assert "RuntimeError: env crashed" in failure.traceback
    assert groups[1].exceptions == []


async def test_too_many_failures_raise_the_first_and_cancel_the_rest() -> None:
    never_finishes = asyncio.Event()
    cancelled = []

    async def slow() -> skytrain.Trajectory:
        try:
            await never_finishes.wait()
        except asyncio.CancelledError:
            cancelled.append(True)
            raise
        return trajectory(1.0)

    async def fails_after(delay_steps: int, message: str) -> skytrain.Trajectory:
        for _ in range(delay_steps):
            await asyncio.sleep(0)
        raise RuntimeError(message)

    with pytest.raises(RuntimeError, match="first failure"):
        await skytrain.gather_trajectory_groups(
            [
                skytrain.TrajectoryGroup([fails_after(1, "first failure"), slow()]),
                skytrain.TrajectoryGroup([fails_after(5, "second failure"), slow()]),
            ],
            pbar_desc=None,
            max_exceptions=1,
        )
    assert cancelled == [True, True]


async def test_fractional_max_exceptions_counts_against_all_rollouts() -> None:
    def groups(failures: int) -> list[skytrain.TrajectoryGroup]:
        rollouts = [rollout(1.0, fail="x" if i < failures else None) for i in range(10)]
        return [skytrain.TrajectoryGroup(rollouts[:5]), skytrain.TrajectoryGroup(rollouts[5:])]

    kept = await skytrain.gather_trajectory_groups(groups(2), pbar_desc=None, max_exceptions=0.2)
    assert sum(len(g) for g in kept) == 8
    with pytest.raises(RuntimeError):
        await skytrain.gather_trajectory_groups(groups(3), pbar_desc=None, max_exceptions=0.2)


async def test_group_whose_rollouts_all_failed_is_dropped() -> None:
    groups = await skytrain.gather_trajectory_groups(
        [
            skytrain.TrajectoryGroup([rollout(0.0, fail="a"), rollout(0.0, fail="b")]),
            skytrain.TrajectoryGroup([rollout(1.0)]),
        ],
        pbar_desc=None,
        max_exceptions=2,
    )
    assert [[t.reward for t in g.trajectories] for g in groups] == [[1.0]]


async def test_gather_accepts_the_users_own_coroutines_returning_groups() -> None:
    """ART style: ``async def make_group(): return await TrajectoryGroup(...)``."""

    async def make_group(base: float) -> skytrain.TrajectoryGroup:
        return await skytrain.TrajectoryGroup(rollout(base + i) for i in range(2))

    async def fails() -> skytrain.TrajectoryGroup:
        raise ValueError("no scenario")

    groups = await skytrain.gather_trajectory_groups(
        [make_group(0.0), fails(), make_group(10.0), skytrain.TrajectoryGroup([trajectory(5.0)])],
        pbar_desc=None,
        max_exceptions=1,
    )
    assert [[t.reward for t in g.trajectories] for g in groups] == [[0.0, 1.0], [10.0, 11.0], [5.0]]


@pytest.mark.parametrize("bad", [-1, 1.5, -0.1])
async def test_max_exceptions_must_be_a_count_or_a_fraction(bad: float) -> None:
    with pytest.raises(ValueError, match="max_exceptions"):
        await skytrain.gather_trajectory_groups([], max_exceptions=bad)


async def test_progress_bar_shows_rollouts_and_live_mean_reward(
    capsys: pytest.CaptureFixture[str],
) -> None:
    rewards = [0.0, 1.0, 1.0, 0.0, 0.5, 1.0]  # mean 0.5833
    await skytrain.gather_trajectory_groups(
        [
            skytrain.TrajectoryGroup(rollout(r) for r in rewards[:3]),
            skytrain.TrajectoryGroup(rollout(r) for r in rewards[3:]),
            skytrain.TrajectoryGroup([rollout(0.0, fail="boom")]),
        ],
        pbar_desc="rollouts step 3",
        max_exceptions=1,
    )
    err = capsys.readouterr().err
    final = err.replace("\r", "\n").strip().splitlines()[-1]
    assert final.startswith("rollouts step 3: 100%")
    assert "7/7" in final
    assert "reward=0.5833" in final
    assert "exceptions=1" in final


async def test_progress_bar_can_be_turned_off(capsys: pytest.CaptureFixture[str]) -> None:
    await skytrain.gather_trajectory_groups(
        [skytrain.TrajectoryGroup([rollout(1.0)])], pbar_desc=None
    )
    assert capsys.readouterr().err == ""

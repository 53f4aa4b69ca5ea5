"""Run every rollout of many groups at once, behind one progress bar with the live mean reward."""

from __future__ import annotations

from collections.abc import Awaitable, Iterable

from skytrain._progress import _current_tally, _progress_bar, _RolloutTally
from skytrain._trajectories import Trajectory, TrajectoryGroup, _gather_or_cancel


def _check_max_exceptions(max_exceptions: int | float) -> None:
    if isinstance(max_exceptions, bool) or not isinstance(max_exceptions, int | float):
        raise TypeError("max_exceptions must be an int (a count) or a float (a fraction)")
    if isinstance(max_exceptions, float) and not 0.0 <= max_exceptions <= 1.0:
        raise ValueError(
            f"max_exceptions={max_exceptions}: a float is the fraction of all rollouts allowed "
            "to fail, between 0.0 and 1.0; pass an int for a count"
        )
    if max_exceptions < 0:
        raise ValueError(f"max_exceptions={max_exceptions} must not be negative")


async def _run_group(
    group: TrajectoryGroup, pending: list[Awaitable[Trajectory]], tally: _RolloutTally
) -> TrajectoryGroup:
    await group._run_rollouts(pending, tally)
    return group


async def _run_awaitable(
    awaitable: Awaitable[TrajectoryGroup], tally: _RolloutTally
) -> TrajectoryGroup | None:
    """A group from the user's own coroutine: it counts as one rollout until it returns.

    Groups awaited inside it report their rollouts to this gather as they finish; any
    trajectory not reported that way is counted when the group comes back.
    """
    try:
        group = await awaitable
    except Exception as exc:
        if tally.exceeded:
            raise
        tally.rollout_failed(exc)
        return None
    if not isinstance(group, TrajectoryGroup):
        raise TypeError(
            f"an awaitable given to gather_trajectory_groups returned a {type(group).__name__}, "
            "not a skytrain.TrajectoryGroup"
        )
    unreported = [t for t in group.trajectories if not tally.is_counted(id(t))]
    tally.expect(len(unreported) - 1)
    for trajectory in unreported:
        tally.trajectory_done(id(trajectory), trajectory.reward)
    return group


async def gather_trajectory_groups(
    groups: Iterable[Awaitable[TrajectoryGroup]],
    *,
    pbar_desc: str | None = "gather",
    max_exceptions: int | float = 0,
) -> list[TrajectoryGroup]:
    """Run all rollouts of ``groups`` concurrently and return the groups, in order.

    ``groups`` are ``TrajectoryGroup`` objects (built from rollout coroutines or finished
    trajectories) or any awaitables returning one. A rollout that raises is recorded in its
    group's ``exceptions`` and left out; once more than ``max_exceptions`` rollouts have
    failed (a count, or a float fraction of all rollouts) the first failure is raised and the
    remaining rollouts are cancelled. Groups left with no trajectory are dropped, since there
    is nothing in them to train on. ``pbar_desc=None`` hides the progress bar.
    """
    _check_max_exceptions(max_exceptions)
    groups = list(groups)
    tally = _RolloutTally(bar=None, max_exceptions=max_exceptions)
    # Take every group's rollouts before any runs, so the bar's total and a fractional
    # max_exceptions count all of them from the first failure on.
    pending = [
        group._take_pending() if isinstance(group, TrajectoryGroup) else [] for group in groups
    ]
    for group, rollouts in zip(groups, pending, strict=True):
        if isinstance(group, TrajectoryGroup):
            tally.expect(len(rollouts) + len(group.trajectories))
        else:
            tally.expect(1)
    if pbar_desc is not None:
        tally.bar = _progress_bar(desc=pbar_desc, total=tally.total, unit="rollout")
    for group in groups:
        if isinstance(group, TrajectoryGroup):
            for trajectory in group.trajectories:
                tally.trajectory_done(id(trajectory), trajectory.reward)

    token = _current_tally.set(tally)
    try:
        results = await _gather_or_cancel(
            _run_group(group, rollouts, tally)
            if isinstance(group, TrajectoryGroup)
            else _run_awaitable(group, tally)
            for group, rollouts in zip(groups, pending, strict=True)
        )
    finally:
        _current_tally.reset(token)
        if tally.bar is not None:
            tally.bar.close()
    return [group for group in results if group is not None and group.trajectories]

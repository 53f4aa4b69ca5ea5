"""Progress bars and status lines, and the tally of rollouts behind the gather bar.

Bars are tqdm's (``tqdm.auto``: a text bar on stderr in a terminal, a widget in a notebook).
The rollout tally lives in a context variable so that a ``TrajectoryGroup`` awaited anywhere
inside ``gather_trajectory_groups`` (even deep in the user's own coroutine) reports to the one
bar and obeys the one ``max_exceptions`` budget of that gather.
"""

from __future__ import annotations

from collections.abc import Mapping
from contextvars import ContextVar

from tqdm.auto import tqdm


def _progress_bar(*, desc: str, total: int | None, unit: str) -> tqdm:
    return tqdm(desc=desc, total=total, unit=unit, dynamic_ncols=True)


def _format_metrics(metrics: Mapping[str, float]) -> dict[str, str]:
    return {key: f"{value:.4g}" for key, value in metrics.items()}


class _StatusLine:
    """One line that shows what a wait is waiting for, with the time spent so far."""

    def __init__(self, prefix: str, *, enabled: bool) -> None:
        self._prefix = prefix
        self._message: str | None = None
        self._bar = (
            tqdm(desc=prefix, total=None, bar_format="{desc} [{elapsed}]", dynamic_ncols=True)
            if enabled
            else None
        )

    def show(self, message: str) -> None:
        if message == self._message:
            return
        self._message = message
        if self._bar is not None:
            self._bar.set_description_str(f"{self._prefix}: {message}")

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()


class _RolloutTally:
    """Counts the rollouts of one gather: drives its bar and enforces ``max_exceptions``.

    ``max_exceptions`` is an absolute count (int) or a fraction of all rollouts (float); the
    first failure beyond it is answered by raising the first failure of the gather, which is
    the one most likely to explain the rest.
    """

    def __init__(self, *, bar: tqdm | None, max_exceptions: int | float) -> None:
        self.bar = bar
        self.max_exceptions = max_exceptions
        self.total = 0
        self.failures: list[BaseException] = []
        self.exceeded = False
        self._reward_sum = 0.0
        self._num_rewards = 0
        self._counted: set[int] = set()

    def expect(self, count: int) -> None:
        """More rollouts will report (a group started resolving, or a placeholder resolved)."""
        self.total += count
        if self.bar is not None:
            self.bar.total = self.total
            self.bar.refresh()

    def is_counted(self, key: int) -> bool:
        return key in self._counted

    def trajectory_done(self, key: int, reward: float) -> None:
        self._counted.add(key)
        self._reward_sum += reward
        self._num_rewards += 1
        self._advance()

    def rollout_failed(self, exception: BaseException) -> None:
        """Record a failed rollout; raise the gather's first failure once there are too many."""
        self.failures.append(exception)
        self._advance()
        if self.exceeded or len(self.failures) > self._allowed_failures():
            self.exceeded = True
            raise self.failures[0]

    def _allowed_failures(self) -> float:
        if isinstance(self.max_exceptions, float):
            return self.max_exceptions * self.total
        return self.max_exceptions

    def _advance(self) -> None:
        if self.bar is None:
            return
        postfix: dict[str, str] = {}
        if self._num_rewards:
            postfix["reward"] = f"{self._reward_sum / self._num_rewards:.4g}"
        if self.failures:
            postfix["exceptions"] = str(len(self.failures))
        self.bar.set_postfix(postfix, refresh=False)
        self.bar.update(1)


_current_tally: ContextVar[_RolloutTally | None] = ContextVar("skytrain_gather", default=None)

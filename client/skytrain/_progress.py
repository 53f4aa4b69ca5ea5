"""Progress bars and status lines, and the tally of rollouts behind the gather bar.

Bars are tqdm's (``tqdm.auto``: a text bar on stderr in a terminal, a widget in a notebook).
With stderr redirected to a file or a pipe, a bar that redraws itself with ``\r`` would fill the
log with overwritten lines: there each bar prints a plain line when it starts, at most every
``PLAIN_INTERVAL_S`` while it runs, and when it ends.
The rollout tally lives in a context variable so that a ``TrajectoryGroup`` awaited anywhere
inside ``gather_trajectory_groups`` (even deep in the user's own coroutine) reports to the one
bar and obeys the one ``max_exceptions`` budget of that gather.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Mapping
from contextvars import ContextVar
from typing import Any

from tqdm.auto import tqdm

PLAIN_INTERVAL_S = 10.0
# tqdm.auto's bar is a notebook widget in a notebook (whose stderr is no terminal either).
_NOTEBOOK = any(cls.__module__ == "tqdm.notebook" for cls in tqdm.__mro__)
# What tqdm writes to redraw a bar in place: carriage returns and cursor moves.
_REDRAW = re.compile(r"\r|\x1b\[[0-9;]*[A-Za-z]")


class _PlainLines:
    """A file for tqdm that turns each redraw into one plain line."""

    def __init__(self, target: Any) -> None:
        self._target = target

    def write(self, text: str) -> None:
        line = _REDRAW.sub("", text).strip()
        if line:
            self._target.write(line + "\n")

    def flush(self) -> None:
        self._target.flush()


def _bar(**options: Any) -> tqdm:
    """A live bar in a terminal or a notebook; plain periodic lines into a file or a pipe."""
    stderr = sys.stderr
    if not _NOTEBOOK and not (hasattr(stderr, "isatty") and stderr.isatty()):
        options.pop("dynamic_ncols", None)
        return tqdm(**options, file=_PlainLines(stderr), mininterval=PLAIN_INTERVAL_S, ascii=True)
    return tqdm(**options)


def _progress_bar(*, desc: str, total: int | None, unit: str) -> tqdm:
    return _bar(desc=desc, total=total, unit=unit, dynamic_ncols=True)


def _format_metrics(metrics: Mapping[str, float]) -> dict[str, str]:
    return {key: f"{value:.4g}" for key, value in metrics.items()}


class _StatusLine:
    """One line that shows what a wait is waiting for, with the time spent so far."""

    def __init__(self, prefix: str, *, enabled: bool) -> None:
        self._prefix = prefix
        self._message: str | None = None
        self._bar = (
            _bar(desc=prefix, total=None, bar_format="{desc} [{elapsed}]", dynamic_ncols=True)
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

"""What a batch says about itself at submission: its reward and metric summaries, and its
sequences longer than a job's row."""

from __future__ import annotations

import math
import statistics
from collections.abc import Iterable, Sequence
from typing import Any

from skytrain_backend.api import trajectory_structs as structs
from skytrain_backend.api.ingest.body import Group
from skytrain_backend.protocol import (
    Choice,
    TrajectoryGroup,
)


class LongSequences:
    """Sequences longer than a job's row (``row_tokens``), counted at submission where their
    length is known: a conversation's last sampled turn carries ``prompt_token_ids`` and its
    sampled ids (a skytrain endpoint gives both), and the sequence the trainer makes of it is
    that prompt and those ids. The trainer cuts such a sequence to the row (or, under ART's
    rules, leaves it out), so the job says so when it is created; sequences of unknown length
    are not counted."""

    def __init__(self, *, row_tokens: int) -> None:
        self.row_tokens = row_tokens
        self.count = 0
        self.longest = 0

    def add(self, group: Group) -> None:
        for trajectory in group.trajectories:
            for history in trajectory.histories():
                length = _known_length(history.messages_and_choices)
                if length is not None and length > self.row_tokens:
                    self.count += 1
                    self.longest = max(self.longest, length)

    def report(self) -> dict[str, int] | None:
        """``{sequences, longest_tokens, row_tokens}``; None when none is longer."""
        if not self.count:
            return None
        return {
            "sequences": self.count,
            "longest_tokens": self.longest,
            "row_tokens": self.row_tokens,
        }


def _known_length(turns: Sequence[Any]) -> int | None:
    """The tokens of the sequence up to the last sampled turn: its prompt's ids and its
    sampled ids, when the turn has both (None otherwise)."""
    for turn in reversed(turns):
        if isinstance(turn, structs.Turn):
            if not turn.is_choice:
                continue
            prompt = turn.prompt_token_ids if isinstance(turn.prompt_token_ids, list) else None
            sampled: int | None = None
            if isinstance(turn.token_ids, list) and turn.token_ids:
                sampled = len(turn.token_ids)
            elif isinstance(turn.logprobs, structs.ChoiceLogprobs) and turn.logprobs.content:
                sampled = len(turn.logprobs.content)
        elif isinstance(turn, Choice):
            prompt = turn.prompt_token_ids
            ids = turn.sampled_token_ids()
            sampled = None if ids is None else len(ids)
        else:
            continue
        return None if prompt is None or sampled is None else len(prompt) + sampled
    return None


class Summary:
    """Summary metrics of a batch, gathered a group at a time: reward statistics, counts,
    and the mean of each trajectory metric.

    ``reward`` and ``reward_std_dev`` are named as ART names them, so checkpoint metrics read
    ``val/reward`` for ``delete_checkpoints(best_checkpoint_metric="val/reward")``.
    """

    def __init__(self) -> None:
        self.rewards: list[float] = []
        self.values: dict[str, list[float]] = {}
        self.num_groups = 0

    def add(self, group: Group) -> None:
        self.num_groups += 1
        for trajectory in group.trajectories:
            self.rewards.append(trajectory.reward)
            for key, value in trajectory.metrics.items():
                self.values.setdefault(key, []).append(float(value))

    def result(self) -> dict[str, float]:
        rewards = self.rewards
        summary = {key: statistics.fmean(series) for key, series in sorted(self.values.items())}
        summary.update(
            {
                "reward": statistics.fmean(rewards),
                "reward_std_dev": statistics.pstdev(rewards),
                "reward/min": min(rewards),
                "reward/max": max(rewards),
                "num_trajectories": float(len(rewards)),
                "num_groups": float(self.num_groups),
            }
        )
        return summary


def summarize(groups: Iterable[TrajectoryGroup]) -> dict[str, float]:
    summary = Summary()
    for group in groups:
        summary.add(group)
    return summary.result()


def combine(summaries: Sequence[dict[str, float]]) -> dict[str, float]:
    """Summaries of several batches (same step and split) as if they were one batch.

    Means are weighted by trajectory count; the reward's standard deviation is pooled from
    each batch's mean and variance.
    """
    if len(summaries) == 1:
        return dict(summaries[0])
    weights = [s["num_trajectories"] for s in summaries]
    total = sum(weights)
    combined: dict[str, float] = {}
    for key in sorted({key for s in summaries for key in s}):
        pairs = [(s[key], w) for s, w in zip(summaries, weights, strict=True) if key in s]
        if key in ("num_trajectories", "num_groups"):
            combined[key] = sum(value for value, _ in pairs)
        elif key == "reward/min":
            combined[key] = min(value for value, _ in pairs)
        elif key == "reward/max":
            combined[key] = max(value for value, _ in pairs)
        else:
            combined[key] = sum(value * w for value, w in pairs) / sum(w for _, w in pairs)
    second_moment = (
        sum(
            (s["reward_std_dev"] ** 2 + s["reward"] ** 2) * w
            for s, w in zip(summaries, weights, strict=True)
        )
        / total
    )
    combined["reward_std_dev"] = math.sqrt(max(second_moment - combined["reward"] ** 2, 0.0))
    return combined

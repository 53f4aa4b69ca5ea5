"""Taking trajectories in: validate, summarise, serialise, store.

A batch is stored atomically from the client's point of view: everything is validated before
anything is written; then the JSONL object is written, then the rows are inserted in one
transaction; if the transaction fails the object is deleted again. A rejected request leaves
no row and no object behind.
"""

from __future__ import annotations

import json
import logging
import math
import statistics
from collections.abc import Callable, Iterable, Sequence
from typing import Any, TypeVar

from pydantic import ValidationError
from sqlalchemy.orm import Session

from skytrain_backend.errors import InvalidRequest, PayloadTooLarge
from skytrain_backend.protocol import (
    Message,
    Trajectory,
    TrajectoryGroup,
    format_validation_error,
)
from skytrain_backend.storage import ObjectStore

logger = logging.getLogger(__name__)
T = TypeVar("T")


def check_count(num_trajectories: int, *, limit: int) -> None:
    if num_trajectories > limit:
        raise PayloadTooLarge(
            f"the request holds {num_trajectories} trajectories, more than the limit of {limit} "
            "(SKYTRAIN_MAX_TRAJECTORIES_PER_REQUEST): split it into several requests"
        )


def count_trajectories(groups: Sequence[TrajectoryGroup]) -> int:
    return sum(len(group.trajectories) for group in groups)


def to_jsonl(items: Iterable[TrajectoryGroup | Trajectory]) -> bytes:
    """One JSON document per line, exactly as validated (``model_dump(mode="json")``)."""
    return b"".join(item.model_dump_json().encode() + b"\n" for item in items)


def groups_from_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def parse_trajectories(raw: Sequence[Any], *, field: str = "trajectories") -> list[Trajectory]:
    """Validate SFT trajectories; each must hold an assistant turn to learn from."""
    if not raw:
        raise InvalidRequest(f"{field} is empty: send at least one trajectory")
    trajectories = []
    for index, item in enumerate(raw):
        where = f"{field}[{index}]"
        try:
            trajectory = Trajectory.model_validate(item)
        except ValidationError as exc:
            raise InvalidRequest(format_validation_error(exc, root=where)) from exc
        trajectories.append(_with_assistant_turn(trajectory, where))
    return trajectories


def parse_trajectory_lines(data: bytes) -> list[Trajectory]:
    """Validate a JSONL upload: one trajectory per line; errors name the line."""
    trajectories = []
    for number, line in enumerate(data.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            trajectory = Trajectory.model_validate_json(line)
        except ValidationError as exc:
            raise InvalidRequest(format_validation_error(exc, root=f"line {number}")) from exc
        trajectories.append(_with_assistant_turn(trajectory, f"line {number}"))
    if not trajectories:
        raise InvalidRequest("the file holds no trajectories: send one JSON trajectory per line")
    return trajectories


def _with_assistant_turn(trajectory: Trajectory, where: str) -> Trajectory:
    for item in trajectory.messages_and_choices:
        if not isinstance(item, Message) or item.role == "assistant":
            return trajectory
    raise InvalidRequest(
        f"{where}: messages_and_choices has no assistant turn, so there is nothing to learn: "
        "end the conversation with the assistant's answer"
    )


def summarize(groups: Sequence[TrajectoryGroup]) -> dict[str, float]:
    """Summary metrics of a batch: reward statistics, counts, and the mean of each metric.

    ``reward`` and ``reward_std_dev`` are named as ART names them, so checkpoint metrics read
    ``val/reward`` for ``delete_checkpoints(best_checkpoint_metric="val/reward")``.
    """
    rewards = [t.reward for group in groups for t in group.trajectories]
    values: dict[str, list[float]] = {}
    for group in groups:
        for trajectory in group.trajectories:
            for key, value in trajectory.metrics.items():
                values.setdefault(key, []).append(float(value))
    summary = {key: statistics.fmean(series) for key, series in sorted(values.items())}
    summary.update(
        {
            "reward": statistics.fmean(rewards),
            "reward_std_dev": statistics.pstdev(rewards),
            "reward/min": min(rewards),
            "reward/max": max(rewards),
            "num_trajectories": float(len(rewards)),
            "num_groups": float(len(groups)),
        }
    )
    return summary


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


def store_then_commit(
    store: ObjectStore, session: Session, *, key: str, data: bytes, insert: Callable[[str], T]
) -> T:
    """Write ``data`` at ``key``, then run ``insert(uri)`` and commit; undo the write on failure."""
    store.put_bytes(key, data)
    try:
        result = insert(store.uri(key))
        session.commit()
    except BaseException:
        session.rollback()
        try:
            store.delete(key)
        except Exception:
            logger.exception("could not delete %s after a failed insert; it is orphaned", key)
        raise
    return result

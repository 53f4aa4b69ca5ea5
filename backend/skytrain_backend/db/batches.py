"""Logged trajectory batches: the rows that point at JSONL objects, with summary metrics."""

from __future__ import annotations

from sqlalchemy import Select, select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import TrajectoryBatch
from skytrain_backend.db.pages import PageRequest, list_page, where_given
from skytrain_backend.db.session import staged
from skytrain_backend.errors import NotFound


def add_batch(
    session: Session,
    *,
    batch_id: str,
    model_id: str,
    split: str,
    step: int,
    uri: str,
    num_groups: int,
    num_trajectories: int,
    metrics: dict[str, float],
    size_bytes: int = 0,
) -> TrajectoryBatch:
    """Stage the row; the caller commits once the object is in the store."""
    return staged(
        session,
        TrajectoryBatch(
            id=batch_id,
            model_id=model_id,
            split=split,
            step=step,
            uri=uri,
            num_groups=num_groups,
            num_trajectories=num_trajectories,
            metrics=metrics,
            size_bytes=size_bytes,
        ),
    )


def _model_batches(
    model_id: str, *, split: str | None, step: int | None
) -> Select[TrajectoryBatch]:
    """The model's batches, of one split and at one step when given."""
    return where_given(
        select(TrajectoryBatch).where(TrajectoryBatch.model_id == model_id),
        (TrajectoryBatch.split, split),
        (TrajectoryBatch.step, step),
    )


def list_batches(
    session: Session,
    *,
    model_id: str,
    split: str | None = None,
    step: int | None = None,
    page: PageRequest,
) -> tuple[list[TrajectoryBatch], bool]:
    keys = (TrajectoryBatch.created_at, TrajectoryBatch.id)
    return list_page(
        session,
        _model_batches(model_id, split=split, step=step),
        keys=keys,
        page=page,
        anchor=select(*keys).where(
            TrajectoryBatch.id == page.after, TrajectoryBatch.model_id == model_id
        ),
        missing="the id of a log batch of this model",
    )


def get_batch(session: Session, *, model_id: str, batch_id: str) -> TrajectoryBatch:
    batch = session.scalar(
        select(TrajectoryBatch).where(
            TrajectoryBatch.id == batch_id, TrajectoryBatch.model_id == model_id
        )
    )
    if batch is None:
        raise NotFound(f"model {model_id} has no log batch {batch_id!r}")
    return batch


def batches_by_step(
    session: Session, *, model_id: str, split: str | None = None, step: int | None = None
) -> list[TrajectoryBatch]:
    """The model's batches (of one split, at one step, when given) in (step, split,
    created_at) order, for metrics history."""
    statement = _model_batches(model_id, split=split, step=step)
    return list(
        session.scalars(
            statement.order_by(
                TrajectoryBatch.step, TrajectoryBatch.split, TrajectoryBatch.created_at
            )
        )
    )

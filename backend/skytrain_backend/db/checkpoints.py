"""Checkpoints of a model: list, find, soft-delete, and metrics merged in from logged batches.

Callers pass a model they already fetched for the tenant, so these functions never need the
tenant themselves.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Checkpoint, utcnow
from skytrain_backend.db.pages import Order, fetch_page
from skytrain_backend.errors import InvalidRequest, NotFound


def list_checkpoints(
    session: Session,
    *,
    model_id: str,
    after: str | None = None,
    limit: int,
    order: Order,
    include_deleted: bool = False,
) -> tuple[list[Checkpoint], bool]:
    """Checkpoints by step (with the deleted ones, whose rows keep their metrics, when
    ``include_deleted``); ``after`` is a checkpoint id (the page cursor)."""
    cursor = None
    if after is not None:
        anchor = session.scalar(
            select(Checkpoint.step).where(Checkpoint.id == after, Checkpoint.model_id == model_id)
        )
        if anchor is None:
            raise InvalidRequest(f"after={after!r} is not the id of a checkpoint of this model")
        cursor = (anchor,)
    statement = select(Checkpoint).where(Checkpoint.model_id == model_id)
    if not include_deleted:
        statement = statement.where(Checkpoint.deleted_at.is_(None))
    return fetch_page(
        session, statement, keys=(Checkpoint.step,), after=cursor, limit=limit, order=order
    )


def get_checkpoint(session: Session, *, model_id: str, step: int) -> Checkpoint:
    checkpoint = session.scalar(
        select(Checkpoint).where(Checkpoint.model_id == model_id, Checkpoint.step == step)
    )
    if checkpoint is None:
        raise NotFound(f"model {model_id} has no checkpoint at step {step}")
    if checkpoint.deleted_at is not None:
        raise NotFound(
            f"the checkpoint at step {step} of model {model_id} was deleted "
            f"on {checkpoint.deleted_at:%Y-%m-%d %H:%M} UTC"
        )
    return checkpoint


def live_checkpoints(session: Session, *, model_id: str, steps: list[int]) -> list[Checkpoint]:
    """The checkpoints at ``steps`` that exist and are not deleted."""
    return list(
        session.scalars(
            select(Checkpoint)
            .where(
                Checkpoint.model_id == model_id,
                Checkpoint.step.in_(steps),
                Checkpoint.deleted_at.is_(None),
            )
            .order_by(Checkpoint.step)
        )
    )


def mark_deleted(session: Session, *, checkpoints: list[Checkpoint]) -> None:
    """Keep the rows with deleted_at set, so a pinned step can say it was deleted."""
    now = utcnow()
    for checkpoint in checkpoints:
        checkpoint.deleted_at = now
        checkpoint.size_bytes = 0
    session.commit()


def lock_live_checkpoint(session: Session, *, model_id: str, step: int) -> Checkpoint | None:
    """The checkpoint at ``step`` if it exists and is not deleted, locked until the
    transaction ends (a concurrent writer of its metrics waits, then reads what this one
    wrote)."""
    return session.scalar(
        select(Checkpoint)
        .where(
            Checkpoint.model_id == model_id,
            Checkpoint.step == step,
            Checkpoint.deleted_at.is_(None),
        )
        .with_for_update()
    )


def merge_metrics(*, checkpoint: Checkpoint, metrics: dict[str, Any]) -> None:
    """Add ``metrics`` to the checkpoint's (no commit)."""
    # A new dict: the JSON column only notices assignment, not in-place mutation.
    checkpoint.metrics = {**checkpoint.metrics, **metrics}

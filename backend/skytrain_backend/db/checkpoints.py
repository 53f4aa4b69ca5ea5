"""Checkpoints of a model: list, find, soft-delete, and metrics merged in from logged batches.

Callers pass a model they already fetched for the tenant, so these functions never need the
tenant themselves.
"""

from __future__ import annotations

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from skytrain_backend.db import tenants
from skytrain_backend.db.models import Checkpoint, Model, utcnow
from skytrain_backend.db.pages import PageRequest, list_page
from skytrain_backend.errors import Conflict, NotFound


def list_checkpoints(
    session: Session,
    *,
    model_id: str,
    page: PageRequest,
    include_deleted: bool = False,
) -> tuple[list[Checkpoint], bool]:
    """Checkpoints by step (with the deleted ones, whose rows keep their metrics, when
    ``include_deleted``); ``page.after`` is a checkpoint id."""
    statement = select(Checkpoint).where(Checkpoint.model_id == model_id)
    if not include_deleted:
        statement = statement.where(Checkpoint.deleted_at.is_(None))
    return list_page(
        session,
        statement,
        keys=(Checkpoint.step,),
        page=page,
        anchor=select(Checkpoint.step).where(
            Checkpoint.id == page.after, Checkpoint.model_id == model_id
        ),
        missing="the id of a checkpoint of this model",
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


def live_checkpoint_by_id(
    session: Session, *, model_id: str, checkpoint_id: str
) -> Checkpoint | None:
    """The checkpoint ``checkpoint_id`` of model ``model_id`` with its files, else None."""
    return session.scalar(
        select(Checkpoint).where(
            Checkpoint.id == checkpoint_id,
            Checkpoint.model_id == model_id,
            Checkpoint.deleted_at.is_(None),
        )
    )


def mark_deleted(session: Session, *, model_id: str, steps: list[int]) -> list[Checkpoint]:
    """Mark the live checkpoints at ``steps`` deleted, all in one transaction; returns them.

    Rows are kept (``deleted_at`` set) so a pinned request can be told the step was deleted.
    This commit clears their ``uri`` and marks them ``purge_pending``; their files are removed
    afterwards (``scheduler.garbage``). So no row, live or deleted, ever points at files that
    may be gone, whatever the store does and whenever another transaction reads. A model
    keeps at least one live checkpoint, so step 0 cannot be deleted while it is the only one.
    """
    found = list(
        session.scalars(
            select(Checkpoint)
            .where(
                Checkpoint.model_id == model_id,
                Checkpoint.step.in_(steps),
                Checkpoint.deleted_at.is_(None),
            )
            .order_by(Checkpoint.step)
            .with_for_update()
        )
    )
    live = session.scalar(
        select(func.count(Checkpoint.id)).where(
            Checkpoint.model_id == model_id, Checkpoint.deleted_at.is_(None)
        )
    )
    if found and len(found) >= (live or 0):
        session.rollback()
        listed = ", ".join(str(checkpoint.step) for checkpoint in found)
        raise Conflict(
            f"deleting step(s) {listed} would leave model {model_id} with no checkpoint: a "
            "model keeps at least one (step 0, the base model, when it was never trained); "
            f"delete the model instead with DELETE /v1/models/{model_id}"
        )
    now = utcnow()
    if found:
        tenants.release_storage(
            session,
            tenant_id=session.get_one(Model, model_id).tenant_id,
            freed=sum(checkpoint.size_bytes for checkpoint in found),
        )
    for checkpoint in found:
        checkpoint.deleted_at = now
        checkpoint.size_bytes = 0
        checkpoint.files = None
        checkpoint.purge_pending = checkpoint.uri is not None
        checkpoint.uri = None
    session.commit()
    return found


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


def merge_metrics(*, checkpoint: Checkpoint, metrics: dict[str, float]) -> None:
    """Add ``metrics`` to the checkpoint's (no commit)."""
    # A new dict: the JSON column only notices assignment, not in-place mutation.
    checkpoint.metrics = {**checkpoint.metrics, **metrics}

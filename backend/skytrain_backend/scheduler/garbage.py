"""Objects the database no longer refers to: removed, and retried until they are gone.

- Deleted checkpoints: ``DELETE .../checkpoints`` marks the rows deleted first and removes the
  files after; a row keeps its ``uri`` until its files are gone, so files the store failed
  to delete are deleted again by the scheduler's next sweep (``purge_deleted_checkpoints``).
"""

from __future__ import annotations

import logging

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Checkpoint, Model
from skytrain_backend.errors import StorageError
from skytrain_backend.storage import ObjectStore, keys

logger = logging.getLogger(__name__)


def purge_deleted_checkpoints(
    session: Session, *, store: ObjectStore, model_id: str | None = None
) -> int:
    """Delete the files of deleted checkpoints that still have some; how many were purged.

    A checkpoint whose files the store fails to delete keeps its ``uri`` and is tried again
    at the next call; the failure is logged for the operator, never shown to a tenant.
    """
    statement = (
        select(Checkpoint, Model.tenant_id)
        .join(Model, Model.id == Checkpoint.model_id)
        .where(Checkpoint.deleted_at.is_not(None), Checkpoint.uri.is_not(None))
        .order_by(Checkpoint.deleted_at)
    )
    if model_id is not None:
        statement = statement.where(Checkpoint.model_id == model_id)
    purged = 0
    for checkpoint, tenant_id in session.execute(statement).all():
        prefix = keys.checkpoint_prefix(
            tenant_id=tenant_id, model_id=checkpoint.model_id, step=checkpoint.step
        )
        try:
            store.delete_prefix(prefix)
        except StorageError as exc:
            logger.warning(
                "could not delete the files of step %d of model %s (retried at the next sweep): %s",
                checkpoint.step,
                checkpoint.model_id,
                exc.message,
            )
            continue
        checkpoint.uri = None
        session.commit()
        purged += 1
    session.rollback()
    return purged

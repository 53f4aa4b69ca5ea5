"""Objects the database no longer refers to: removed, and retried until they are gone.

- Deleted checkpoints: ``DELETE .../checkpoints`` commits the rows first (deleted, ``uri``
  cleared, ``purge_pending`` set) and removes the files after, so no reader ever finds a row
  that points at files already gone. A row stays ``purge_pending`` until its files are gone:
  files the store failed to delete are deleted again by the scheduler's next sweep
  (``purge_deleted_checkpoints``).
- Everything else (``collect_garbage``): an object under a model that no row refers to, last
  written before a grace period, is deleted. Such objects are what a crash leaves between
  writing an object and committing its row (a checkpoint copied but never committed, a job's
  input whose row never came, files staged by an attempt that is over and whose state the job
  does not resume from, a Tinker operation's body whose row never came), or what a failed
  delete left. The grace period spares objects whose row is about to be committed. Uploaded
  files (``tenants/{id}/files/``) have no rows and are kept.
- Base models' configs read from the Hub (``hub/configs/``, ``scheduler.model_configs``):
  any tenant may name any Hub repository, so the store keeps the configs of the base models
  that models name, and the sweep deletes the others once past the grace period (one a
  later model names again is read from the Hub again).
- Model events (``prune_model_events``): each decision about a model's replicas is a row;
  the newest ``model_events_kept`` of each model stay (what ``skytrain models show`` and
  ``GET /v1/models/{id}/events`` read), older ones are deleted at each sweep.
- Writes that never finished (``abort_stale_uploads``): an S3 multipart upload or a local
  temporary file that a process killed mid-write left, once a day old (no request's upload
  runs that long). S3 would otherwise keep, and bill, their parts for ever.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from datetime import datetime, timedelta

from sqlalchemy import delete, func, select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    ModelEvent,
    TinkerRequest,
    TinkerRun,
    TrainingJob,
    TrajectoryBatch,
)
from skytrain_backend.errors import StorageError
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES
from skytrain_backend.storage import ObjectStore, keys

logger = logging.getLogger(__name__)

# An unfinished write older than this is abandoned: its process is gone.
STALE_UPLOAD_AGE = timedelta(days=1)


def purge_deleted_checkpoints(
    session: Session, *, store: ObjectStore, model_id: str | None = None
) -> int:
    """Delete the files of deleted checkpoints still ``purge_pending``; how many were purged.

    A checkpoint whose files the store fails to delete stays pending and is tried again at
    the next call; the failure is logged for the operator, never shown to a tenant.
    """
    statement = (
        select(Checkpoint, Model.tenant_id)
        .join(Model, Model.id == Checkpoint.model_id)
        .where(Checkpoint.purge_pending.is_(True))
        .order_by(Checkpoint.deleted_at)
    )
    if model_id is not None:
        statement = statement.where(Checkpoint.model_id == model_id)
    purged = 0
    for checkpoint, tenant_id in session.execute(statement).all():
        try:
            for prefix in _step_prefixes(
                store, tenant_id=tenant_id, model_id=checkpoint.model_id, step=checkpoint.step
            ):
                store.delete_prefix(prefix)
        except StorageError as exc:
            logger.warning(
                "could not delete the files of step %d of model %s (retried at the next sweep): %s",
                checkpoint.step,
                checkpoint.model_id,
                exc.message,
            )
            continue
        checkpoint.purge_pending = False
        session.commit()
        purged += 1
    session.rollback()
    return purged


def prune_model_events(session: Session, *, keep: int) -> int:
    """Delete every model's events but its newest ``keep`` (committed); how many went."""
    ranked = select(
        ModelEvent.id,
        func.row_number()
        .over(partition_by=ModelEvent.model_id, order_by=ModelEvent.id.desc())
        .label("rank"),
    ).subquery()
    older = select(ranked.c.id).where(ranked.c.rank > keep)
    deleted = session.execute(
        delete(ModelEvent)
        .where(ModelEvent.id.in_(older))
        .execution_options(synchronize_session=False)
    )
    pruned = deleted.rowcount  # type: ignore[attr-defined]
    session.commit()
    if pruned:
        logger.info("pruned %d model events (the newest %d of each model are kept)", pruned, keep)
    return int(pruned or 0)


def _step_prefixes(store: ObjectStore, *, tenant_id: str, model_id: str, step: int) -> list[str]:
    """Every directory of the step: ``checkpoints/{step}/`` and each ``{step}-{writer}/``
    (a deleted row no longer records which one it committed)."""
    root = keys.model_prefix(tenant_id=tenant_id, model_id=model_id) + "checkpoints/"
    directories = {
        info.key.removeprefix(root).partition("/")[0] for info in store.list(f"{root}{step}")
    }
    return [
        f"{root}{directory}/"
        for directory in sorted(directories)
        if keys.checkpoint_step(directory) == step
    ]


@dataclass
class _ModelRows:
    """What the rows of one model refer to in the store."""

    exists: bool
    # The directories under checkpoints/ that live rows record (``3``, ``3-{writer}``).
    checkpoint_dirs: set[str] = field(default_factory=set)
    # id -> (status, attempts, the attempt whose staged files hold its saved state)
    jobs: dict[str, tuple[str, int, int | None]] = field(default_factory=dict)
    batches: set[str] = field(default_factory=set)
    # The seq_ids of the Tinker operations of the model's run (``tinker/ops/{seq_id}/``).
    tinker_ops: set[str] = field(default_factory=set)


def collect_garbage(
    session: Session,
    *,
    store: ObjectStore,
    written_before: datetime,
    hub_endpoint: str | None = None,
) -> int:
    """Delete the objects under models that no row refers to and that were last written
    before ``written_before``, and with ``hub_endpoint`` (the Hub the configs were read
    from) the Hub configs of base models no model names; how many were deleted."""
    known: dict[tuple[str, str], _ModelRows] = {}
    deleted = 0
    for info in store.list("tenants/"):
        if info.modified >= written_before:
            continue
        parts = info.key.split("/")
        # tenants/{tenant}/models/{model}/...: other layouts (uploaded files) are kept.
        if len(parts) < 6 or parts[2] != "models":
            continue
        tenant_id, model_id, rest = parts[1], parts[3], parts[4:]
        if (tenant_id, model_id) not in known:
            known[tenant_id, model_id] = _model_rows(
                session, tenant_id=tenant_id, model_id=model_id
            )
        if _referenced(known[tenant_id, model_id], rest):
            continue
        deleted += _deleted(store, info.key, what="unreferenced object")
    if hub_endpoint is not None:
        deleted += _collect_hub_configs(
            session, store=store, written_before=written_before, endpoint=hub_endpoint
        )
    session.rollback()
    if deleted:
        logger.info("deleted %d objects no row referred to", deleted)
    return deleted


def _collect_hub_configs(
    session: Session, *, store: ObjectStore, written_before: datetime, endpoint: str
) -> int:
    named = {
        keys.hub_config_key(endpoint=endpoint, base_model=base_model)
        for base_model in session.scalars(select(Model.base_model).distinct())
    }
    deleted = 0
    for info in store.list(keys.HUB_CONFIGS_PREFIX):
        if info.modified >= written_before or info.key in named:
            continue
        deleted += _deleted(store, info.key, what="unused Hub config")
    return deleted


def _deleted(store: ObjectStore, key: str, *, what: str) -> int:
    """Delete ``key``: 1, or 0 when the store failed (logged; the next sweep tries again)."""
    try:
        store.delete(key)
    except StorageError as exc:
        logger.warning("could not delete %s %s: %s", what, key, exc.message)
        return 0
    return 1


def _model_rows(session: Session, *, tenant_id: str, model_id: str) -> _ModelRows:
    found = session.scalar(
        select(Model.id).where(Model.id == model_id, Model.tenant_id == tenant_id)
    )
    if found is None:
        return _ModelRows(exists=False)
    uris = session.scalars(
        select(Checkpoint.uri).where(Checkpoint.model_id == model_id, Checkpoint.uri.is_not(None))
    )
    jobs = session.execute(
        select(
            TrainingJob.id, TrainingJob.status, TrainingJob.attempts, TrainingJob.saved_attempt
        ).where(TrainingJob.model_id == model_id)
    )
    batches = session.scalars(
        select(TrajectoryBatch.id).where(TrajectoryBatch.model_id == model_id)
    )
    tinker_ops = session.scalars(
        select(TinkerRequest.seq_id)
        .join(TinkerRun, TinkerRun.id == TinkerRequest.run_id)
        .where(TinkerRun.model_id == model_id)
    )
    return _ModelRows(
        exists=True,
        checkpoint_dirs={keys.checkpoint_directory(uri) for uri in uris if uri},
        jobs={job_id: (status, attempts, saved) for job_id, status, attempts, saved in jobs},
        batches=set(batches),
        tinker_ops={str(seq_id) for seq_id in tinker_ops},
    )


def _referenced(rows: _ModelRows, rest: list[str]) -> bool:
    """Whether a row refers to the object at ``models/{id}/`` + ``rest``."""
    if not rows.exists:
        return False
    kind = rest[0]
    if kind == "checkpoints":
        return rest[1] in rows.checkpoint_dirs
    if kind == "logs":
        return rest[1].removesuffix(".jsonl") in rows.batches
    if kind == "tinker" and len(rest) >= 3 and rest[1] == "ops":
        return rest[2] in rows.tinker_ops
    if kind == "jobs" and rest[1] in rows.jobs:
        if len(rest) == 3:
            return True  # the job's input
        status, attempts, saved = rows.jobs[rest[1]]
        if rest[2] != "attempts":
            return False
        # Files staged by an attempt: the attempt that runs now needs them, and so does every
        # attempt to come while they hold the state the job resumes from.
        running = status == "running" and rest[3] == str(attempts)
        resumed = status not in TERMINAL_JOB_STATUSES and rest[3] == str(saved)
        return running or resumed
    return kind not in ("checkpoints", "logs", "jobs")  # a layout of the future: kept


def abort_stale_uploads(store: ObjectStore, *, started_before: datetime) -> int:
    """Remove the unfinished writes started before ``started_before``; how many. A store
    failing is logged for the operator and tried again at the next sweep."""
    try:
        aborted = store.abort_stale_uploads(started_before=started_before)
    except StorageError as exc:
        logger.warning("could not remove unfinished uploads (retried later): %s", exc.message)
        return 0
    if aborted:
        logger.info("removed %d unfinished uploads that a stopped process left", aborted)
    return aborted

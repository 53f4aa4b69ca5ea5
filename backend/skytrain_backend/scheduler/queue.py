"""The training-job queue: leases, renewals, results, retries.

A worker leases one queued job of a model placed on it; the lease lasts ``lease_s`` and the
worker renews it while it trains. Every call from the worker names the *attempt* it holds
(the job's ``attempts`` counter when it was leased), so a worker that lost its lease (it went
silent, the job was leased again) cannot touch the job any more: its calls get 409.

Exactly-once steps: a job's result is committed by ``complete_job`` in one transaction that
checks the lease, inserts the checkpoint row (unique per model and step) and finishes the job.
Its files were uploaded under the attempt's own staging prefix and are copied into place
before that transaction, so a stale attempt can never overwrite a committed checkpoint.

PostgreSQL leases with ``FOR UPDATE SKIP LOCKED`` so concurrent workers never take the same
job; SQLite serializes writers, and a process lock keeps its read-then-write atomic.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import exists, func, select
from sqlalchemy.orm import Session, aliased

from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import registry
from skytrain_backend.db.models import Checkpoint, Model, TrainingJob, Worker, utcnow
from skytrain_backend.errors import InvalidRequest, LeaseLost, NotFound, StorageError
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES, ModelConfig
from skytrain_backend.storage import keys
from skytrain_backend.storage.base import ObjectStore

logger = logging.getLogger(__name__)

_SQLITE_LEASE_LOCK = threading.Lock()

# What a worker reports during a job: the end events are the control plane's own.
WORKER_EVENT_TYPES = frozenset({"training_started", "gradient_step", "job_timeline"})
# The jobs a worker's training loop leases; ``tinker`` jobs (a Tinker training run's lease on
# its model) are leased by the worker's Tinker executor.
TRAINING_JOB_KINDS = ("rl", "sft")


def lease_job(
    session: Session,
    *,
    worker: Worker,
    lease_s: float,
    kinds: Sequence[str] = TRAINING_JOB_KINDS,
) -> TrainingJob | None:
    """Give ``worker`` a queued job (of ``kinds``) of a model placed on it, if any.

    Tenants take turns: the job goes to the tenant whose last job started longest ago (one
    that never had a job first), and within a tenant to its oldest queued job. So one
    tenant's thirty queued jobs do not all run before another tenant's one. A model never
    has two running jobs: its next job waits until the running one ends.
    """
    if session.get_bind().dialect.name == "sqlite":
        with _SQLITE_LEASE_LOCK:
            return _lease(session, worker=worker, lease_s=lease_s, kinds=kinds, skip_locked=False)
    return _lease(session, worker=worker, lease_s=lease_s, kinds=kinds, skip_locked=True)


def _lease(
    session: Session, *, worker: Worker, lease_s: float, kinds: Sequence[str], skip_locked: bool
) -> TrainingJob | None:
    running = aliased(TrainingJob)
    started, owned = aliased(TrainingJob), aliased(Model)
    tenant_last_started = (
        select(func.max(started.started_at))
        .join(owned, owned.id == started.model_id)
        .where(owned.tenant_id == Model.tenant_id)
        .scalar_subquery()
    )
    statement = (
        select(TrainingJob)
        .join(Model, Model.id == TrainingJob.model_id)
        .where(
            TrainingJob.status == "queued",
            TrainingJob.kind.in_(kinds),
            Model.worker_id == worker.id,
            ~exists().where(running.model_id == TrainingJob.model_id, running.status == "running"),
        )
        .order_by(tenant_last_started.asc().nulls_first(), TrainingJob.created_at, TrainingJob.id)
        .limit(1)
    )
    if skip_locked:
        statement = statement.with_for_update(skip_locked=True, of=TrainingJob)
    job = session.scalar(statement)
    if job is None:
        session.rollback()
        return None
    now = utcnow()
    job.status = "running"
    job.worker_id = worker.id
    job.attempts += 1
    job.base_step = registry.latest_step(session, model_id=job.model_id)
    job.lease_expires_at = now + timedelta(seconds=lease_s)
    job.started_at = job.started_at or now
    session.commit()
    return job


def leased_job(session: Session, *, worker: Worker, job_id: str, attempt: int) -> TrainingJob:
    """The job ``worker`` holds as ``attempt``, locked for update; LeaseLost otherwise."""
    job = _locked_job(session, job_id=job_id)
    if job is None:
        raise NotFound(f"training job {job_id!r} not found")
    if not _held(job, worker_id=worker.id, attempt=attempt):
        raise LeaseLost(
            f"training job {job_id} attempt {attempt} is no longer held by this worker "
            f"(status {job.status}, attempt {job.attempts})"
        )
    return job


def _locked_job(session: Session, *, job_id: str) -> TrainingJob | None:
    return session.scalar(select(TrainingJob).where(TrainingJob.id == job_id).with_for_update())


def _held(job: TrainingJob, *, worker_id: str, attempt: int) -> bool:
    """Whether the job runs under the lease ``worker_id`` took as ``attempt``."""
    return job.status == "running" and job.worker_id == worker_id and job.attempts == attempt


def unlease(session: Session, *, worker_id: str, job_id: str, attempt: int) -> None:
    """Hand back a job leased as ``attempt`` to a worker that hung up before it got the
    answer: queued again, that attempt uncounted, as if never leased; cancelled if a cancel
    came meanwhile, as ``release_jobs`` does (a job no longer held that way is left alone)."""
    job = _locked_job(session, job_id=job_id)
    if job is None or not _held(job, worker_id=worker_id, attempt=attempt):
        session.rollback()
        return
    job.attempts -= 1
    if job.attempts == 0:
        job.started_at = None  # the tenant's turn is not used up by a lease nobody received
    # A job is queued only with attempts to spare, so with that attempt taken back it has
    # some again: it is never failed here, and has no reason to give.
    _cancel_or_requeue(session, job)
    session.commit()


def renew_lease(
    session: Session, *, worker: Worker, job_id: str, attempt: int, lease_s: float
) -> TrainingJob:
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    job.lease_expires_at = utcnow() + timedelta(seconds=lease_s)
    session.commit()
    return job


def record_event(
    session: Session,
    *,
    worker: Worker,
    job_id: str,
    attempt: int,
    type: str,
    data: dict[str, Any],
) -> None:
    if type not in WORKER_EVENT_TYPES:
        raise InvalidRequest(
            f"workers report {sorted(WORKER_EVENT_TYPES)} events; {type!r} is not one of them"
        )
    leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    job_rows.add_event(session, job_id=job_id, type=type, data=data)  # type: ignore[arg-type]
    session.commit()


def staged_file_key(job: TrainingJob, *, tenant_id: str, attempt: int, name: str) -> str:
    prefix = keys.model_prefix(tenant_id=tenant_id, model_id=job.model_id)
    return f"{prefix}jobs/{job.id}/attempts/{attempt}/{name}"


def complete_job(
    session: Session,
    *,
    store: ObjectStore,
    worker: Worker,
    job_id: str,
    attempt: int,
    step: int,
    metrics: dict[str, float],
    files: list[str],
) -> Checkpoint:
    """Commit the attempt's checkpoint and finish the job, once."""
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    model = session.get_one(Model, job.model_id)
    expected = registry.next_step(session, model_id=model.id)
    if step != expected:
        raise InvalidRequest(f"job {job_id} trains step {expected}, not step {step}")
    if not files:
        raise InvalidRequest("a checkpoint needs its files")
    prefix = keys.checkpoint_prefix(tenant_id=model.tenant_id, model_id=model.id, step=step)
    staged = keys.model_prefix(tenant_id=model.tenant_id, model_id=model.id) + f"jobs/{job.id}/"
    total = 0
    try:
        for name in files:
            source = staged_file_key(job, tenant_id=model.tenant_id, attempt=attempt, name=name)
            total += store.copy(source, prefix + name)
    except StorageError as exc:
        _fail_commit(session, store=store, job=job, step=step, prefixes=(prefix, staged), exc=exc)
        raise StorageError(
            f"the object store failed while committing step {step} of job {job.id}; the job "
            "has failed and its files were removed"
        ) from exc
    checkpoint = Checkpoint(
        model_id=model.id,
        step=step,
        uri=store.uri(prefix.rstrip("/")),
        metrics=metrics,
        size_bytes=total,
    )
    session.add(checkpoint)
    # The worker loaded and verified the new adapter before completing: it serves it now, so
    # the request that follows training_ended goes to the new step.
    served = [item for item in worker.served or [] if item.get("model_id") != model.id]
    worker.served = [*served, {"model_id": model.id, "step": step}]
    now = utcnow()
    job.status = "succeeded"
    job.result_step = step
    job.finished_at = now
    job.lease_expires_at = None
    job_rows.add_event(
        session, job_id=job.id, type="training_ended", data={"step": step, **metrics}
    )
    session.commit()
    _delete_quietly(store, staged + "attempts/")
    return checkpoint


def _fail_commit(
    session: Session,
    *,
    store: ObjectStore,
    job: TrainingJob,
    step: int,
    prefixes: tuple[str, str],
    exc: StorageError,
) -> None:
    """End a job whose checkpoint the store could not take. ``prefixes``: the checkpoint's
    (files copied so far) and the job's (files staged by its attempts); both are deleted,
    and the sweep collects what the store refuses now."""
    logger.error("committing step %d of job %s failed: %s", step, job.id, exc.message)
    checkpoint_prefix, job_prefix = prefixes
    _delete_quietly(store, checkpoint_prefix)
    _delete_quietly(store, job_prefix + "attempts/")
    _finish(
        session,
        job,
        status="failed",
        error=f"the object store failed while saving the checkpoint of step {step}, so "
        "nothing was committed: submit the job again (the operator's log has the store's "
        "error)",
    )
    session.commit()


def _delete_quietly(store: ObjectStore, prefix: str) -> None:
    try:
        store.delete_prefix(prefix)
    except StorageError as exc:
        logger.warning("could not delete %s (left to the sweep): %s", prefix, exc.message)


def fail_job(
    session: Session,
    *,
    worker: Worker,
    job_id: str,
    attempt: int,
    error_message: str,
    retryable: bool,
    cancelled: bool,
) -> TrainingJob:
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    if cancelled:
        _finish(session, job, status="cancelled", error="the job was cancelled")
    elif retryable and job.attempts < job.max_attempts:
        _requeue(job)
    else:
        _finish(session, job, status="failed", error=error_message)
    session.commit()
    return job


def _requeue(job: TrainingJob) -> None:
    job.status = "queued"
    job.worker_id = None
    job.lease_expires_at = None


def _finish(session: Session, job: TrainingJob, *, status: str, error: str) -> None:
    job.status = status
    job.error = error
    job.finished_at = utcnow()
    job.lease_expires_at = None
    job_rows.add_event(
        session, job_id=job.id, type="training_failed", data={"error_message": error}
    )


def release_jobs(session: Session, *, jobs: list[TrainingJob], reason: str) -> None:
    """Jobs whose worker is gone, for ``reason``: cancelled if a cancel came for them, else
    back to the queue, or failed with ``reason`` once out of attempts."""
    for job in jobs:
        if job.status in TERMINAL_JOB_STATUSES:
            continue
        if job.cancel_requested or job.attempts < job.max_attempts:
            _cancel_or_requeue(session, job)
        else:
            _finish(
                session,
                job,
                status="failed",
                error=f"gave up after {job.attempts} attempts; the last one: {reason}",
            )
    session.commit()


def _cancel_or_requeue(session: Session, job: TrainingJob) -> None:
    """A running job its worker no longer runs: cancelled if a cancel came for it, else
    queued again."""
    if job.cancel_requested:
        _finish(session, job, status="cancelled", error="the job was cancelled")
    else:
        _requeue(job)


def expire_leases(session: Session) -> int:
    """Release running jobs whose lease ran out (their worker stopped renewing)."""
    jobs = list(
        session.scalars(
            select(TrainingJob)
            .where(TrainingJob.status == "running", TrainingJob.lease_expires_at < utcnow())
            .with_for_update(skip_locked=True)
        )
    )
    release_jobs(session, jobs=jobs, reason="the worker stopped renewing its lease")
    return len(jobs)


def job_for_worker(session: Session, job: TrainingJob) -> dict[str, Any]:
    """What a worker needs to run a leased job."""
    model = session.get_one(Model, job.model_id)
    return {
        "id": job.id,
        "kind": job.kind,
        "model_id": job.model_id,
        "base_model": model.base_model,
        "config": job.config,
        "model_config": ModelConfig.model_validate(model.config or {}).model_dump(),
        "base_step": job.base_step,
        # Usually base_step + 1; higher when newer steps were deleted (never reused).
        "step": registry.next_step(session, model_id=job.model_id),
        "attempt": job.attempts,
    }

"""Tinker sessions, training runs, futures, samplers and named checkpoints, per tenant.

Every lookup filters on the caller's tenant: another tenant's run, future or sampler is not
found (404), and nothing says it exists.
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta
from typing import TypeVar

from sqlalchemy import ColumnElement, exists, func, or_, select, update
from sqlalchemy.orm import Session

from skytrain_backend.db import tenants
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    TinkerSession,
    TrainingJob,
    utcnow,
)
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest, NotFound, QuotaExceeded
from skytrain_backend.json_types import JSONObject

logger = logging.getLogger(__name__)

# The kind of a Tinker run's job (``training_jobs.kind``).
JOB_KIND = "tinker"

# last_request_at and heartbeats are informative: written at most this often per row.
ACTIVITY_RESOLUTION = timedelta(seconds=10)


def create_session(
    session: Session,
    *,
    tenant_id: str,
    sdk_version: str,
    tags: list[str],
    user_metadata: JSONObject,
    limits: TenantLimits,
) -> TinkerSession:
    """The new session, refused (403) past the tenant's ``max_sessions`` open ones; its
    ``user_metadata`` is refused past the tenant's ``max_metadata_bytes`` (413) and counted in
    its stored bytes (403 past ``max_storage_bytes``), before anything is stored."""
    size = tenants.metadata_bytes(user_metadata, limits=limits, field="user_metadata")

    def refusal(open_sessions: int) -> QuotaExceeded:
        return QuotaExceeded(
            f"your tenant has {open_sessions} Tinker sessions open, the most its quota allows "
            f"(max_sessions, {limits.max_sessions}): close the ServiceClients you no longer use "
            "(an abandoned one ends once it stops heartbeating), or ask the operator to raise it "
            "(`skytrain tenants limits TENANT --max-sessions N`)",
            limit="max_sessions",
        )

    tenants.enforce_quota(
        session,
        tenant_id=tenant_id,
        used=select(func.count(TinkerSession.id)).where(
            TinkerSession.tenant_id == tenant_id, TinkerSession.finished_at.is_(None)
        ),
        adding=1,
        allowed=limits.max_sessions,
        refusal=refusal,
    )
    tenants.reserve_storage(
        session, tenant_id=tenant_id, limits=limits, adding=size, what="the session's user_metadata"
    )
    row = TinkerSession(
        tenant_id=tenant_id,
        sdk_version=sdk_version,
        tags=sorted(set(tags)),
        user_metadata=user_metadata,
        size_bytes=size,
    )
    session.add(row)
    session.commit()
    return row


_Owned = TypeVar("_Owned", TinkerSession, TinkerRun, TinkerRequest, TinkerSampler)


def _owned(
    session: Session, table: type[_Owned], *, tenant_id: str, row_id: str, missing: str
) -> _Owned:
    """The tenant's row ``row_id`` of ``table``; NotFound saying ``missing`` otherwise (a
    row of another tenant is not found either)."""
    row = session.scalar(select(table).where(table.id == row_id, table.tenant_id == tenant_id))
    if row is None:
        raise NotFound(missing)
    return row


def get_session(session: Session, *, tenant_id: str, session_id: str) -> TinkerSession:
    return _owned(
        session,
        TinkerSession,
        tenant_id=tenant_id,
        row_id=session_id,
        missing=f"session {session_id!r} not found: create one with a new ServiceClient",
    )


def open_session(session: Session, *, tenant_id: str, session_id: str) -> TinkerSession:
    """The session, refused once it finished (nothing new may start in it)."""
    row = get_session(session, tenant_id=tenant_id, session_id=session_id)
    if row.finished_at is not None:
        raise InvalidRequest(
            f"session {session_id} has finished ({row.finish_status}): create a new ServiceClient"
        )
    return row


def heartbeat(session: Session, *, row: TinkerSession) -> None:
    now = utcnow()
    if row.last_heartbeat_at < now - ACTIVITY_RESOLUTION:
        row.last_heartbeat_at = now
        session.commit()


def get_run(session: Session, *, tenant_id: str, run_id: str) -> TinkerRun:
    return _owned(
        session,
        TinkerRun,
        tenant_id=tenant_id,
        row_id=run_id,
        missing=f"training run {run_id!r} not found: create one with "
        "ServiceClient.create_lora_training_client",
    )


def touch_run(session: Session, *, run: TinkerRun) -> None:
    now = utcnow()
    if run.last_request_at < now - ACTIVITY_RESOLUTION:
        run.last_request_at = now
        session.commit()


def list_runs(
    session: Session, *, tenant_id: str, limit: int, offset: int
) -> tuple[list[TinkerRun], int]:
    """The tenant's runs, newest first, and how many there are."""
    where = TinkerRun.tenant_id == tenant_id
    total = int(session.scalar(select(func.count(TinkerRun.id)).where(where)) or 0)
    runs = session.scalars(
        select(TinkerRun)
        .where(where)
        .order_by(TinkerRun.created_at.desc(), TinkerRun.id)
        .limit(limit)
        .offset(offset)
    )
    return list(runs), total


def get_request(session: Session, *, tenant_id: str, request_id: str) -> TinkerRequest:
    return _owned(
        session,
        TinkerRequest,
        tenant_id=tenant_id,
        row_id=request_id,
        missing=f"future {request_id!r} not found",
    )


def get_sampler(session: Session, *, tenant_id: str, sampler_id: str) -> TinkerSampler:
    return _owned(
        session,
        TinkerSampler,
        tenant_id=tenant_id,
        row_id=sampler_id,
        missing=f"sampling session {sampler_id!r} not found: create one with "
        "ServiceClient.create_sampling_client",
    )


def named_checkpoints(
    session: Session, *, tenant_id: str, run_id: str | None = None
) -> list[tuple[TinkerCheckpoint, Checkpoint]]:
    """Named checkpoints (of one run, or all the tenant's) whose step was not deleted, newest
    first, with their skytrain checkpoint."""
    statement = (
        select(TinkerCheckpoint, Checkpoint)
        .join(TinkerRun, TinkerRun.id == TinkerCheckpoint.run_id)
        .join(
            Checkpoint,
            (Checkpoint.model_id == TinkerRun.model_id)
            & (Checkpoint.step == TinkerCheckpoint.step),
        )
        .where(TinkerRun.tenant_id == tenant_id, Checkpoint.deleted_at.is_(None))
        .order_by(TinkerCheckpoint.created_at.desc(), TinkerCheckpoint.id)
    )
    if run_id is not None:
        statement = statement.where(TinkerCheckpoint.run_id == run_id)
    return [(named, checkpoint) for named, checkpoint in session.execute(statement)]


# --- a run's activity: what placement and fair share ask of it -------------------------------

IN_FLIGHT = ("queued", "running")


def operation_in_flight() -> ColumnElement[bool]:
    """The Tinker run of the job (``TrainingJob`` in the query) has an operation queued or
    running: its worker needs the run's state."""
    return exists().where(
        TinkerRun.job_id == TrainingJob.id,
        TinkerRequest.run_id == TinkerRun.id,
        TinkerRequest.status.in_(IN_FLIGHT),
    )


def job_needs_its_worker() -> ColumnElement[bool]:
    """The job (``TrainingJob`` in the query) needs a worker while it is open: any job but a
    Tinker run's, which needs one only while an operation of it is queued or running."""
    return or_(TrainingJob.kind != JOB_KIND, operation_in_flight())


def run_used_since(since: datetime) -> ColumnElement[bool]:
    """The model (``Model`` in the query) is a Tinker run that got a request after ``since``
    (its operations do not touch the model's ``last_active_at``)."""
    return exists().where(TinkerRun.model_id == Model.id, TinkerRun.last_request_at > since)


def hand_back_idle_run(session: Session, *, model_id: str, why: str) -> bool:
    """Take the running job of the model (placed, its row locked) back from its worker, if
    it is a Tinker run's with no operation in flight: queued again, the attempt counted as a
    preemption, not a failure; the worker gets ``LeaseLost`` at its next call. Whether the
    model may now leave its worker: True when no job runs on it or its run was taken back;
    False when one needs the worker (an operation came since the caller looked, or the worker
    holds the job's row this moment: it is working on the run); the caller then rolls back."""
    running = select(TrainingJob).where(
        TrainingJob.model_id == model_id, TrainingJob.status == "running"
    )
    jobs = list(session.scalars(running.with_for_update(skip_locked=True)))
    if len(jobs) != session.scalar(select(func.count()).select_from(running.subquery())):
        return False  # one is locked: its worker is working on it
    if any(job.kind != JOB_KIND for job in jobs):
        return False
    for job in jobs:
        # One statement, so that SQLite (no row locks) cannot interleave a worker marking an
        # operation running between a read here and this write.
        taken = session.execute(
            update(TrainingJob)
            .where(
                TrainingJob.id == job.id,
                TrainingJob.status == "running",
                TrainingJob.attempts == job.attempts,
                ~operation_in_flight(),
            )
            .values(
                status="queued",
                worker_id=None,
                lease_expires_at=None,
                yield_requested=False,
                preemptions=TrainingJob.preemptions + 1,
            )
            .execution_options(synchronize_session=False)
        )
        if taken.rowcount != 1:  # type: ignore[attr-defined]
            return False
        logger.info(
            "Tinker run of model %s has no operation in flight: its job %s is taken back "
            "from its worker (%s)",
            model_id,
            job.id,
            why,
        )
    return True

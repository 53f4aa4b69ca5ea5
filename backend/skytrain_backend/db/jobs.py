"""Training jobs and their events, as the API sees them.

The API creates jobs ``queued`` and cancels them; leasing, heartbeats and results belong to
the scheduler. A job is reached through its model, so a tenant only ever finds its own.
"""

from __future__ import annotations

from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import tenants
from skytrain_backend.db.models import Model, TrainingJob, TrainingJobEvent, utcnow
from skytrain_backend.db.pages import PageRequest, fetch_page, list_page, where_given
from skytrain_backend.db.session import staged
from skytrain_backend.errors import Conflict, NotFound, RateLimited
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES, EventType, JobKind, JobStatus

# When a job refused for a full queue is worth sending again.
QUEUE_FULL_RETRY_S = 5.0


def reserve_job(session: Session, *, tenant_id: str, max_queued_jobs: int) -> None:
    """A place for one more RL or SFT job among the tenant's queued or running ones
    (``RateLimited`` past ``max_queued_jobs``), under the tenant's lock
    (``tenants.enforce_quota``): the caller adds the job and commits."""

    def full(active: int) -> RateLimited:
        return RateLimited(
            f"your tenant has {active} training jobs queued or running, the most its quota "
            f"allows (max_queued_jobs, {max_queued_jobs}): submit this one when one of them has "
            "ended, or ask the operator to raise it "
            "(`skytrain tenants limits TENANT --max-queued-jobs N`)",
            retry_after_s=QUEUE_FULL_RETRY_S,
            limit="max_queued_jobs",
        )

    tenants.enforce_quota(
        session,
        tenant_id=tenant_id,
        used=tenants.queued_jobs(tenant_id=tenant_id),
        adding=1,
        allowed=max_queued_jobs,
        refusal=full,
    )


def add_job(
    session: Session,
    *,
    job_id: str,
    model_id: str,
    kind: JobKind,
    config: dict[str, Any],
    input_uri: str,
    num_groups: int,
    num_trajectories: int,
    max_attempts: int,
    input_bytes: int = 0,
    request_id: str | None = None,
) -> TrainingJob:
    """Stage a queued job; the caller commits once its input (``input_bytes``) is in the
    store."""
    return staged(
        session,
        TrainingJob(
            id=job_id,
            model_id=model_id,
            kind=kind,
            status="queued",
            config=config,
            input_uri=input_uri,
            input_bytes=input_bytes,
            num_groups=num_groups,
            num_trajectories=num_trajectories,
            attempts=0,
            max_attempts=max_attempts,
            request_id=request_id,
            cancel_requested=False,
        ),
    )


def _tenant_jobs(tenant_id: str) -> Any:
    return select(TrainingJob).join(Model).where(Model.tenant_id == tenant_id)


def get_job(session: Session, *, tenant_id: str, job_id: str) -> TrainingJob:
    job = session.scalar(_tenant_jobs(tenant_id).where(TrainingJob.id == job_id))
    if job is None:
        raise NotFound(f"training job {job_id!r} not found: list yours with GET /v1/training-jobs")
    return job


def list_jobs(
    session: Session,
    *,
    tenant_id: str,
    model_id: str | None = None,
    status: JobStatus | None = None,
    page: PageRequest,
) -> tuple[list[TrainingJob], bool]:
    keys = (TrainingJob.created_at, TrainingJob.id)
    return list_page(
        session,
        where_given(
            _tenant_jobs(tenant_id), (TrainingJob.model_id, model_id), (TrainingJob.status, status)
        ),
        keys=keys,
        page=page,
        anchor=select(*keys)
        .join(Model)
        .where(Model.tenant_id == tenant_id, TrainingJob.id == page.after),
        missing="the id of one of your training jobs",
    )


def add_event(
    session: Session, *, job_id: str, type: EventType, data: dict[str, Any]
) -> TrainingJobEvent:
    return staged(session, TrainingJobEvent(job_id=job_id, type=type, data=data))


def cancel_job(session: Session, *, job: TrainingJob) -> TrainingJob:
    """Cancel a queued job at once; ask a running one's worker to stop at the next step."""
    if job.status in TERMINAL_JOB_STATUSES:
        raise Conflict(f"training job {job.id} has already ended ({job.status}): nothing to cancel")
    if job.status == "queued":
        job.status = "cancelled"
        job.finished_at = utcnow()
        # Clients following the events (ART's among them) stop on training_failed.
        add_event(
            session,
            job_id=job.id,
            type="training_failed",
            data={"error_message": "the job was cancelled before it started"},
        )
    else:
        job.cancel_requested = True
    session.commit()
    return job


def list_events(
    session: Session,
    *,
    job_id: str,
    after: int | None = None,
    limit: int,
    types: frozenset[str] | None = None,
) -> tuple[list[TrainingJobEvent], bool]:
    """A page of the job's events in order; only those of ``types`` when given."""
    statement = select(TrainingJobEvent).where(TrainingJobEvent.job_id == job_id)
    if types is not None:
        statement = statement.where(TrainingJobEvent.type.in_(sorted(types)))
    return fetch_page(
        session,
        statement,
        keys=(TrainingJobEvent.id,),
        after=None if after is None else (after,),
        limit=limit,
        order="asc",
    )

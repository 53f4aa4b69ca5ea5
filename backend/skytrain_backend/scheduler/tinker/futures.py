"""Where a Tinker future stands: done, failed, or pending and why (its queue state and the
reason the SDK shows), for ``retrieve_future``."""

from __future__ import annotations

from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from sqlalchemy import func, select
from sqlalchemy.orm import Session

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    TrainingJob,
    utcnow,
)
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES
from skytrain_backend.scheduler.serving import ServingStatus, serving_status
from skytrain_backend.scheduler.tinker.runs import JOB_KIND, ended_reason, fail_operation, run_job

# --- futures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pending:
    """Not finished: whether it is being worked on, or waits (and why)."""

    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"]
    reason: str | None = None


@dataclass(frozen=True)
class Failed:
    error: str
    category: Literal["user", "server", "unknown"]


def state(
    session: Session, *, operation: TinkerRequest, sample_timeout_s: float, settings: Settings
) -> Pending | Failed | None:
    """A future that is not done yet (with why it waits), or failed; None when it succeeded.

    What a pending future waits for is said as the REST API says it of the model it needs
    (``serving_status``: no worker yet, the tenant's placement quota, a worker starting, a
    checkpoint loading), or as the worker's room for Tinker runs.
    """
    if operation.status == "succeeded":
        return None
    if operation.status == "failed":
        category = operation.error_category or "unknown"
        return Failed(error=operation.error or "failed", category=category)  # type: ignore[arg-type]
    limits = tenants.limits_of(session.get_one(Tenant, operation.tenant_id), settings)
    if operation.run_id is None:
        if operation.created_at < utcnow() - timedelta(seconds=sample_timeout_s):
            fail_operation(
                operation,
                f"sampling did not finish within {sample_timeout_s:.0f}s "
                "(SKYTRAIN_TINKER_SAMPLE_TIMEOUT_S): retry, with fewer tokens if it recurs",
                category="server",
            )
            session.commit()
            return state(
                session, operation=operation, sample_timeout_s=sample_timeout_s, settings=settings
            )
        return _sample_wait(
            session,
            operation=operation,
            limits=limits,
            max_workers=settings.scheduler.launched_workers_limit,
        )
    run = session.get_one(TinkerRun, operation.run_id)
    job = run_job(session, run=run)
    if job.status in TERMINAL_JOB_STATUSES:
        return Failed(
            error=f"training run {run.id} ended before this operation ran ({ended_reason(job)})",
            category="server" if job.status == "failed" else "user",
        )
    if job.status != "queued":
        return Pending("active")
    serving = serving_status(
        session,
        model=session.get_one(Model, run.model_id),
        step=0,
        limits=limits,
        max_workers=settings.scheduler.launched_workers_limit,
    )
    if serving.state == "failed":
        return Failed(
            error=f"no worker can hold training run {run.id}: {serving.message}",
            category="server",
        )
    if job.attempts > 0:
        return Pending(
            "paused_capacity",
            f"the model's worker was lost; rebuilding its state (attempt {job.attempts + 1})",
        )
    if not serving.ready:
        return _paused(serving)
    return Pending(
        "paused_capacity",
        f"waiting for worker {serving.worker_id} to take the run: it holds "
        f"{_tinker_runs_on(session, worker_id=serving.worker_id)} Tinker runs, at most "
        "SKYTRAIN_WORKER_TINKER_MAX_RUNS at once, and takes this one when it has room",
    )


def _sample_wait(
    session: Session, *, operation: TinkerRequest, limits: TenantLimits, max_workers: int | None
) -> Pending:
    sampler = session.get(TinkerSampler, operation.sampler_id)
    model = session.get(Model, sampler.model_id) if sampler is not None else None
    if sampler is None or model is None:
        return Pending("active")
    serving = serving_status(
        session, model=model, step=sampler.step, limits=limits, max_workers=max_workers
    )
    if serving.ready or serving.state == "loading":
        return Pending("active", None if serving.ready else serving.message)
    return _paused(serving)


def _paused(serving: ServingStatus) -> Pending:
    return Pending(
        "paused_rate_limit" if serving.over_quota else "paused_capacity", serving.message
    )


def _tinker_runs_on(session: Session, *, worker_id: str | None) -> int:
    return int(
        session.scalar(
            select(func.count(TrainingJob.id)).where(
                TrainingJob.worker_id == worker_id,
                TrainingJob.kind == JOB_KIND,
                TrainingJob.status == "running",
            )
        )
        or 0
    )

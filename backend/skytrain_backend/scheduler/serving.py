"""Where a model is served, and in words what is happening when it is not.

One function answers both ``GET /v1/models/{id}`` (its ``serving`` object, which the SDK's
``register`` waits on) and the inference gateway (which routes a request, or answers 503 with
the same message and a ``Retry-After``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import registry
from skytrain_backend.db.models import Model, TrainingJob, Worker
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.protocol import lora_name
from skytrain_backend.scheduler import placement

ServingState = Literal[
    "waiting", "provisioning", "starting", "unreachable", "training", "loading", "ready", "failed"
]

LIVE_WORKER_STATUSES = ("provisioning", "starting", "unreachable", "ready", "training", "sleeping")
ROUTABLE_WORKER_STATUSES = ("ready", "training")


@dataclass(frozen=True)
class ServingStatus:
    state: ServingState
    ready: bool
    message: str
    worker_id: str | None = None
    step: int | None = None
    retry_after_s: float = 5.0
    # Waiting because of the tenant's quota: its requests get 429 rather than 503.
    over_quota: bool = False

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("retry_after_s")
        data.pop("over_quota")
        return data


def is_served(worker: Worker, *, model_id: str, step: int) -> bool:
    """Whether the worker's engine serves the model's ``step`` (step 0 is the base model)."""
    if step == 0:
        return True
    return any(
        item.get("model_id") == model_id and item.get("step") == step
        for item in worker.served or []
    )


def engine_model_name(worker: Worker, *, model_id: str, step: int) -> str:
    """The name to ask the worker's engine for: the base model, or the step's adapter."""
    if step == 0:
        return worker.served_model_name or worker.base_model
    return lora_name(model_id, step)


def serving_status(
    session: Session,
    *,
    model: Model,
    step: int | None = None,
    limits: TenantLimits | None = None,
) -> ServingStatus:
    """The model's serving state for ``step`` (default: its latest); with the tenant's
    ``limits``, an unplaced model says when its quota is what keeps it waiting."""
    target = registry.latest_step(session, model_id=model.id) if step is None else step
    worker = session.get(Worker, model.worker_id) if model.worker_id else None
    if worker is None or worker.status not in LIVE_WORKER_STATUSES:
        reason = placement.quota_wait(session, model=model, limits=limits) if limits else None
        if reason is not None:
            return ServingStatus(
                state="waiting", ready=False, message=reason, retry_after_s=30.0, over_quota=True
            )
        return _unplaced(session, model=model)
    if worker.status in ("provisioning", "starting"):
        return ServingStatus(
            state="starting",
            ready=False,
            worker_id=worker.id,
            message=f"worker {worker.id} is starting its engine for {model.base_model}",
            retry_after_s=10.0,
        )
    if worker.status == "unreachable":
        return _unreachable(worker, model=model)
    if worker.status == "sleeping":
        return ServingStatus(
            state="training",
            ready=False,
            worker_id=worker.id,
            step=target,
            message=f"worker {worker.id} is training: its engine sleeps while a job uses the "
            "GPU, and serves again when the job ends",
            retry_after_s=30.0,
        )
    if not is_served(worker, model_id=model.id, step=target):
        return ServingStatus(
            state="loading",
            ready=False,
            worker_id=worker.id,
            step=target,
            message=f"worker {worker.id} is loading step {target} of {model.entity}/"
            f"{model.project}/{model.name}",
            retry_after_s=1.0,
        )
    running = session.scalar(
        select(TrainingJob.id).where(
            TrainingJob.model_id == model.id, TrainingJob.status == "running"
        )
    )
    message = f"serving step {target} on worker {worker.id}"
    if running is not None:
        message += f"; training job {running} is running"
    return ServingStatus(
        state="ready", ready=True, worker_id=worker.id, step=target, message=message
    )


def _unreachable(worker: Worker, *, model: Model) -> ServingStatus:
    return ServingStatus(
        state="unreachable",
        ready=False,
        worker_id=worker.id,
        # The address tried is the operator's (`skytrain workers list`), not the tenant's.
        message=f"worker {worker.id} for {model.base_model} is running, but the control "
        "plane cannot reach it yet; its operator sees the address tried and what to do in "
        "`skytrain workers list`",
        retry_after_s=15.0,
    )


def _unplaced(session: Session, *, model: Model) -> ServingStatus:
    """No live worker holds the model: say whether one is coming, or why not."""
    newest = session.scalar(
        select(Worker)
        .where(Worker.base_model == model.base_model)
        .order_by(Worker.created_at.desc())
        .limit(1)
    )
    if newest is not None and newest.status in ("provisioning", "starting"):
        detail = f": {newest.status_message}" if newest.status_message else ""
        return ServingStatus(
            state="provisioning",
            ready=False,
            worker_id=newest.id,
            message=f"starting a worker for {model.base_model} ({newest.provider}){detail}",
            retry_after_s=15.0,
        )
    if newest is not None and newest.status == "unreachable":
        # Placement has not reached the model yet; what it waits for is that worker.
        return _unreachable(newest, model=model)
    if newest is not None and newest.status == "failed":
        # Why it failed (a launch error, a stack trace with the host's paths) is the
        # operator's to read, in the control plane's log and `skytrain logs`.
        return ServingStatus(
            state="failed",
            ready=False,
            worker_id=newest.id,
            message=f"the last worker for base model {model.base_model!r} failed to start: "
            "check that the name is right (a Hugging Face model id you may use, or a directory "
            f"the operator allows); otherwise the operator can see why with `skytrain logs "
            f"{newest.id}`",
            retry_after_s=30.0,
        )
    return ServingStatus(
        state="waiting",
        ready=False,
        message=f"waiting for a worker for {model.base_model} to be placed on",
        retry_after_s=5.0,
    )

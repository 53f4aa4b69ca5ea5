"""Which engine answers an inference request: from the ``model`` a caller sent to the worker
engine, the engine's name for that checkpoint, and the secret to call it with.

A request names a model as ``<entity>/<project>/<name>`` (its latest step), with ``:step<N>``
to pin a checkpoint, in ART's ``wandb-artifact:///`` form, or by the model's id (what
``GET /v1/models`` lists). Everything is looked up in the caller's tenant only, so another
tenant's model is simply not found.

This runs on every inference request, so it reads and rarely writes: the activity marks the
scheduler relies on (the model's, a pinned checkpoint's, the worker's) are written at most
once per ``ACTIVITY_RESOLUTION_S`` per row, or more often when the idle timeout the
scheduler judges them by is short.
"""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, replace
from datetime import datetime, timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import registry
from skytrain_backend.db.models import Checkpoint, Model, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import NotFound, RateLimited, Unavailable
from skytrain_backend.protocol import ModelRef
from skytrain_backend.ranges import parse_step
from skytrain_backend.scheduler import placement, replicas
from skytrain_backend.scheduler.serving import (
    ROUTABLE_WORKER_STATUSES,
    engine_model_name,
    is_served,
    serving_status,
)

ACTIVITY_RESOLUTION_S = 30.0

# Serving states in which no live worker holds the model: the scheduler has work to do.
UNPLACED_STATES = frozenset({"waiting", "provisioning", "failed"})

_MODEL_ID_RE = re.compile(r"^(?P<id>[0-9a-f]{32})(?::step(?P<step>[0-9]+))?$")


@dataclass(frozen=True)
class EngineRoute:
    """Where to send a request, and what to call the checkpoint there."""

    model_id: str
    step: int
    worker_id: str
    engine_endpoint: str
    engine_secret: str
    # The certificate the worker registered, which its front door must present.
    engine_certificate: str | None
    engine_model: str
    # Every engine serving the model's checkpoint (this one first): the gateway balances
    # requests among them (``api/gateway/balance.py``). Empty in a route built by hand.
    replicas: tuple[EngineRoute, ...] = ()

    @property
    def choices(self) -> tuple[EngineRoute, ...]:
        """The routes a request may take: every replica, or this one alone."""
        return self.replicas or (self,)


def resolve_route(
    session: Session,
    *,
    tenant_id: str,
    model: str,
    idle_timeout_s: float,
    limits: TenantLimits | None = None,
    max_workers: int | None = None,
    on_unplaced: Callable[[], None] | None = None,
) -> EngineRoute:
    """The engine serving ``model`` for the tenant.

    Raises ``NotFound`` for an unknown model or step, ``InvalidRequest`` for a malformed name,
    ``RateLimited`` when the tenant's quota (``limits``) keeps the model off the workers, and
    ``Unavailable`` (with the serving state's message and retry delay) when no engine serves
    the checkpoint yet (``max_workers``, the control plane's, may be what it waits for);
    ``on_unplaced`` is called first when no worker holds the model, so the scheduler can
    place it now rather than at its next pass. ``idle_timeout_s`` is the scheduler's:
    activity marks are refreshed well within it. The session's transaction is over when this
    returns, so a long stream holds no database connection.
    """
    interval_s = min(ACTIVITY_RESOLUTION_S, idle_timeout_s / 4)
    try:
        found, pinned = _find_model(session, tenant_id=tenant_id, model=model)
        step = _target_step(session, model=found, pinned=pinned, interval_s=interval_s)
        placement.mark_model_active(session, model=found, min_interval_s=interval_s)
        routes = _serving_routes(session, model=found, step=step, pinned=pinned is not None)
        if routes:
            if any(_stale(serving.last_active_at, interval_s=interval_s) for serving in routes):
                for serving in routes:
                    serving.last_active_at = utcnow()
                session.commit()
            return _routes(found.id, routes, step=step, pinned=pinned is not None)
        status = serving_status(
            session, model=found, step=step, limits=limits, max_workers=max_workers
        )
        if status.over_quota:
            raise RateLimited(
                status.message, retry_after_s=status.retry_after_s, limit="placement_quota"
            )
        if not status.ready:
            if on_unplaced is not None and (
                status.state in UNPLACED_STATES or found.worker_id is None
            ):
                on_unplaced()
            raise Unavailable(
                status.message, retry_after_s=status.retry_after_s, state=status.state
            )
        worker = session.get(Worker, status.worker_id)
        assert worker is not None
        if not worker.engine_endpoint:
            raise Unavailable(
                f"worker {worker.id} has not reported its engine's address yet", retry_after_s=5.0
            )
        if _stale(worker.last_active_at, interval_s=interval_s):
            worker.last_active_at = utcnow()
            session.commit()
        return EngineRoute(
            model_id=found.id,
            step=step,
            worker_id=worker.id,
            engine_endpoint=worker.engine_endpoint.rstrip("/"),
            engine_secret=worker.engine_secret,
            engine_certificate=worker.engine_certificate,
            engine_model=engine_model_name(worker, model_id=found.id, step=step),
        )
    finally:
        session.rollback()


def _serving_routes(session: Session, *, model: Model, step: int, pinned: bool) -> list[Worker]:
    """The workers whose engines answer for the model now, its home first: awake, reachable,
    and serving ``step`` (pinned), or for its latest (not pinned), any step of it they serve
    (a replica still loading the newest step answers with its previous one meanwhile, and
    says so in ``X-Skytrain-Step``)."""
    ids = [model.worker_id] if model.worker_id else []
    ids += replicas.replica_workers(session, model_id=model.id, status="serving")
    if not ids:
        return []
    workers = {
        worker.id: worker
        for worker in session.scalars(
            select(Worker).where(Worker.id.in_(ids), Worker.status.in_(ROUTABLE_WORKER_STATUSES))
        )
    }
    awake = [
        worker
        for worker_id in ids
        if (worker := workers.get(worker_id)) is not None and worker.engine_endpoint
    ]
    exact = [worker for worker in awake if is_served(worker, model_id=model.id, step=step)]
    if exact or pinned or len(ids) == 1:
        # A model on one worker waits for its newest step to load, as it always has.
        return exact
    return [worker for worker in awake if _served_step(worker, model_id=model.id) is not None]


def _served_step(worker: Worker, *, model_id: str) -> int | None:
    """The newest step of the model the worker's engine serves (None: none)."""
    steps = [
        int(item["step"])
        for item in worker.served or []
        if item.get("model_id") == model_id and isinstance(item.get("step"), int)
    ]
    return max(steps) if steps else None


def _routes(model_id: str, workers: list[Worker], *, step: int, pinned: bool) -> EngineRoute:
    """The route to each worker (the step each serves), the first holding the rest."""
    built = []
    for worker in workers:
        served = step
        if not pinned and not is_served(worker, model_id=model_id, step=step):
            served = _served_step(worker, model_id=model_id) or 0
        assert worker.engine_endpoint is not None
        built.append(
            EngineRoute(
                model_id=model_id,
                step=served,
                worker_id=worker.id,
                engine_endpoint=worker.engine_endpoint.rstrip("/"),
                engine_secret=worker.engine_secret,
                engine_certificate=worker.engine_certificate,
                engine_model=engine_model_name(worker, model_id=model_id, step=served),
            )
        )
    return replace(built[0], replicas=tuple(built))


def _find_model(session: Session, *, tenant_id: str, model: str) -> tuple[Model, int | None]:
    """The tenant's model named by ``model``, and the step it pins (None: the latest)."""
    by_id = _MODEL_ID_RE.match(model)
    if by_id is not None:
        found = session.scalar(
            select(Model).where(Model.id == by_id.group("id"), Model.tenant_id == tenant_id)
        )
        step = by_id.group("step")
        pinned = parse_step(step, where="the model's :step<N>") if step is not None else None
    else:
        ref = ModelRef.parse(model)
        found = session.scalar(
            select(Model).where(
                Model.tenant_id == tenant_id,
                Model.entity == ref.entity,
                Model.project == ref.project,
                Model.name == ref.name,
            )
        )
        pinned = ref.step
    if found is None:
        raise NotFound(
            f"model {model!r} not found: list yours with GET /v1/models, and create it with "
            "POST /v1/models (or TrainableModel.register)"
        )
    return found, pinned


def _target_step(session: Session, *, model: Model, pinned: int | None, interval_s: float) -> int:
    """The pinned step, checked to exist, or the model's newest live step."""
    latest = registry.latest_step(session, model_id=model.id)
    if pinned is None:
        return latest
    name = f"{model.entity}/{model.project}/{model.name}"
    checkpoint = session.scalar(
        select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.step == pinned)
    )
    if checkpoint is None:
        raise NotFound(
            f"model {name} has no step {pinned}: its latest step is {latest} "
            f"(ask for {name!r} to be served the latest)"
        )
    if checkpoint.deleted_at is not None:
        raise NotFound(
            f"step {pinned} of model {name} was deleted on "
            f"{checkpoint.deleted_at:%Y-%m-%d %H:%M} UTC: its latest step is {latest}"
        )
    if _stale(checkpoint.last_requested_at, interval_s=interval_s):
        checkpoint.last_requested_at = utcnow()
        session.commit()
    return pinned


def _stale(mark: datetime | None, *, interval_s: float) -> bool:
    return mark is None or mark < utcnow() - timedelta(seconds=interval_s)

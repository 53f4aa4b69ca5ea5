"""Placement and the provisioning policy: which worker holds which model, and when workers
are started and stopped.

- A model is *active* while it was registered, used for inference or trained within
  ``worker_idle_timeout_s``, or has a job queued or running. Active models are placed.
- Placement is sticky: a model stays on its worker until that worker is gone; then it is placed
  again (its adapters are fetched from the object store by the new worker). A pass places or
  unplaces a model only if its row still holds the worker the pass read (the row locked on
  PostgreSQL): a placement committed meanwhile by another control plane is not written over.
  Nor is a model placed on a worker that went away after the pass read it (its row is locked
  and its status checked first): the model waits for the next pass.
- A model with no live worker for its base model makes the provider start one, up to
  ``max_workers``. A launch that failed is not retried for ``worker_launch_backoff_s``, so a
  missing cloud credential shows up as the model's status instead of a launch loop.
- A worker with no active model for ``worker_idle_timeout_s`` is stopped.
- A model goes only to a worker whose engine loads adapters of its LoRA rank; a model (or a
  job) no worker for its base model could serve is refused up front (``check_lora_rank``).
- Quotas: a tenant has at most ``max_placed_models`` models placed at once, on at most
  ``max_workers`` workers (``db.tenants``); its next model waits until one goes idle, so one
  tenant's models cannot fill every worker while another tenant's model waits forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import exists, func, or_, select, update
from sqlalchemy.orm import Session

from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, TrainingJob, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.scheduler import queue

logger = logging.getLogger(__name__)

# Models wait on an unreachable worker (it may be reached once the provider reports its
# address) and on one whose engine sleeps during a job.
PLACEABLE_STATUSES = ("provisioning", "starting", "unreachable", "ready", "training", "sleeping")


def _has_open_job() -> object:
    return exists().where(
        TrainingJob.model_id == Model.id, TrainingJob.status.in_(("queued", "running"))
    )


def active_models_without_worker(session: Session, *, idle_timeout_s: float) -> list[Model]:
    """Active models that no live worker holds."""
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    live = select(Worker.id).where(Worker.status.in_(PLACEABLE_STATUSES))
    return list(
        session.scalars(
            select(Model)
            .where(
                or_(Model.worker_id.is_(None), Model.worker_id.not_in(live)),
                or_(Model.last_active_at > since, _has_open_job()),  # type: ignore[arg-type]
            )
            .order_by(Model.last_active_at)
        )
    )


def tenant_placements(session: Session, *, tenant_id: str) -> dict[str, int]:
    """The live workers holding the tenant's models, with how many of them each holds."""
    rows = session.execute(
        select(Model.worker_id, func.count(Model.id))
        .join(Worker, Worker.id == Model.worker_id)
        .where(Model.tenant_id == tenant_id, Worker.status.in_(PLACEABLE_STATUSES))
        .group_by(Model.worker_id)
    )
    return {str(worker_id): int(count) for worker_id, count in rows}


def quota_wait(session: Session, *, model: Model, limits: TenantLimits) -> str | None:
    """Why the tenant's quota keeps ``model`` off the workers now (None: it does not)."""
    held = tenant_placements(session, tenant_id=model.tenant_id)
    if sum(held.values()) >= limits.max_placed_models:
        return (
            f"your tenant has {sum(held.values())} models on workers, the most its quota allows "
            f"(max_placed_models={limits.max_placed_models}): this model is placed once one "
            "of them goes idle, or when the operator raises the quota"
        )
    if len(held) >= limits.max_workers and (
        _worker_with_room(
            session, base_model=model.base_model, lora_rank=_lora_rank(model), among=set(held)
        )
        is None
    ):
        return (
            f"your tenant's models occupy {len(held)} workers, the most its quota allows "
            f"(max_workers={limits.max_workers}), and none of them has room for this model: "
            "it is placed once one of your models goes idle, or when the operator raises "
            "the quota"
        )
    return None


def place_models(
    session: Session,
    *,
    idle_timeout_s: float,
    max_workers: int,
    launch_backoff_s: float,
    launch: Callable[[str], None] | None,
    limits: Callable[[str], TenantLimits],
) -> None:
    """Put every active unplaced model on a worker of its base model, launching if needed.

    ``launch(base_model)`` asks the provider for a new worker (None: no provider);
    ``limits(tenant_id)`` are the tenant's quotas.
    """
    launched: set[str] = set()
    for model in active_models_without_worker(session, idle_timeout_s=idle_timeout_s):
        quota = limits(model.tenant_id)
        held = tenant_placements(session, tenant_id=model.tenant_id)
        if sum(held.values()) >= quota.max_placed_models:
            _unplace(session, model)
            continue
        at_worker_quota = len(held) >= quota.max_workers
        worker = _worker_with_room(
            session,
            base_model=model.base_model,
            lora_rank=_lora_rank(model),
            among=set(held) if at_worker_quota else None,
        )
        if worker is not None:
            # Lock order: the worker's row, then the model's, as ``worker_gone`` writes them,
            # so the two never wait on each other. Claiming the worker's row first also takes
            # SQLite's write lock: nothing can be committed between the checks and the write.
            if not _claim_worker(session, worker):
                # Gone (lost, stopped, draining, deleted) since the pass read it: nothing
                # written, the model placed by a later pass.
                logger.debug("worker %s went away meanwhile; model %s waits", worker.id, model.id)
                session.rollback()
                continue
            if not _placement_unchanged(session, model):
                # Placed (or deleted) meanwhile: nothing written, the worker not marked active.
                session.rollback()
                logger.debug("model %s was placed meanwhile; left as it is", model.id)
                continue
            model.worker_id = worker.id
            session.commit()
            logger.info("placed model %s on worker %s", model.id, worker.id)
            continue
        if not _unplace(session, model):
            continue
        base = model.base_model
        if (
            launch is None
            or at_worker_quota
            or base in launched
            or _recently_failed(session, base_model=base, backoff_s=launch_backoff_s)
        ):
            continue
        if _live_worker_count(session) >= max_workers:
            logger.info("model %s waits: max_workers=%d reached", model.id, max_workers)
            continue
        launched.add(base)
        launch(base)


def _lora_rank(model: Model) -> int:
    return ModelConfig.model_validate(model.config or {}).lora_rank


def _rank_limit(worker: Worker) -> int | None:
    """The largest LoRA rank the worker's engine loads, as it registered it (None: any)."""
    limit = (worker.capacity or {}).get("max_lora_rank")
    return None if limit is None else int(limit)


def _claim_worker(session: Session, worker: Worker) -> bool:
    """Mark the worker active if it still takes models (it may have been lost, stopped, asked
    to drain or deleted since the pass read it), its row locked until the transaction ends;
    False (and nothing written) when it does not. One statement checks and locks: on
    PostgreSQL, one that waited for a concurrent writer of the row checks the row that writer
    committed."""
    claimed = session.scalar(
        update(Worker)
        .where(Worker.id == worker.id, Worker.status.in_(PLACEABLE_STATUSES))
        .values(last_active_at=utcnow())
        .returning(Worker.id)
    )
    return claimed is not None


def _placement_unchanged(session: Session, model: Model) -> bool:
    """Whether the model's row still has the worker this pass read (and still exists), its
    row locked until the transaction ends. A placement committed meanwhile (by a leader that
    took over, or by hand) is kept, not written over: writing the same one again would also
    empty every route cache of the process (``api/route_cache.py``) for nothing."""
    row = session.execute(
        select(Model.worker_id).where(Model.id == model.id).with_for_update(key_share=True)
    ).first()
    return row is not None and row.worker_id == model.worker_id


def _unplace(session: Session, model: Model) -> bool:
    """Forget the model's worker that is gone, so the model shows as waiting; False (and
    nothing written) when a placement was committed since the pass read the model."""
    if model.worker_id is None:
        return True
    if not _placement_unchanged(session, model):
        session.rollback()
        return False
    model.worker_id = None
    session.commit()
    return True


def _worker_with_room(
    session: Session, *, base_model: str, lora_rank: int, among: set[str] | None = None
) -> Worker | None:
    """The live worker of ``base_model`` (one of ``among``, when given) holding the fewest
    models, if it has room for one more and loads adapters of ``lora_rank``."""
    placed = select(func.count(Model.id)).where(Model.worker_id == Worker.id).scalar_subquery()
    statement = (
        select(Worker, placed)
        .where(Worker.base_model == base_model, Worker.status.in_(PLACEABLE_STATUSES))
        .order_by(placed, Worker.created_at)
    )
    if among is not None:
        statement = statement.where(Worker.id.in_(among))
    candidates = session.execute(statement).all()
    for worker, count in candidates:
        limit = _rank_limit(worker)
        if limit is not None and lora_rank > limit:
            continue
        if count < int((worker.capacity or {}).get("max_models", 1)):
            return worker
    return None


def check_lora_rank(
    session: Session, *, base_model: str, lora_rank: int, default_limit: int
) -> None:
    """Refuse a LoRA rank that no worker for ``base_model`` would load (InvalidRequest).

    The limit is the largest that a live registered worker for the base model reported, or,
    with none registered yet, ``default_limit`` (``SKYTRAIN_ENGINE_MAX_LORA_RANK``: what the
    workers this control plane starts are given).
    """
    workers = session.scalars(
        select(Worker).where(
            Worker.base_model == base_model, Worker.status.in_(worker_rows.REGISTERED_STATUSES)
        )
    ).all()
    limits = [_rank_limit(worker) for worker in workers]
    if any(limit is None for limit in limits):
        return
    largest = max([limit for limit in limits if limit is not None] or [default_limit])
    if lora_rank <= largest:
        return
    whose = (
        f"the largest the workers serving {base_model} load"
        if limits
        else "the largest a worker loads (SKYTRAIN_ENGINE_MAX_LORA_RANK)"
    )
    raise InvalidRequest(
        f"lora_rank {lora_rank} is above {largest}, {whose}: choose a lora_rank of at most "
        f"{largest}, or have the operator raise SKYTRAIN_ENGINE_MAX_LORA_RANK and start "
        "workers with it"
    )


def _live_worker_count(session: Session) -> int:
    return int(
        session.scalar(
            select(func.count(Worker.id)).where(Worker.status.in_(worker_rows.LIVE_STATUSES))
        )
        or 0
    )


def _recently_failed(session: Session, *, base_model: str, backoff_s: float) -> bool:
    newest = session.scalar(
        select(Worker)
        .where(Worker.base_model == base_model)
        .order_by(Worker.created_at.desc())
        .limit(1)
    )
    if newest is None or newest.status != "failed":
        return False
    ended = newest.stopped_at or newest.created_at
    return ended > utcnow() - timedelta(seconds=backoff_s)


def worker_gone(session: Session, *, worker: Worker, status: str, reason: str) -> None:
    """A worker stopped, was lost or failed: free its models and release its jobs."""
    worker.status = status
    worker.status_message = reason
    worker.stopped_at = utcnow()
    worker.served = []
    for model in session.scalars(select(Model).where(Model.worker_id == worker.id)):
        model.worker_id = None
    session.commit()
    running = list(
        session.scalars(
            select(TrainingJob).where(
                TrainingJob.worker_id == worker.id, TrainingJob.status == "running"
            )
        )
    )
    queue.release_jobs(session, jobs=running, reason=f"worker {worker.id} {status}: {reason}")
    logger.warning("worker %s %s: %s", worker.id, status, reason)


def idle_workers(session: Session, *, idle_timeout_s: float) -> list[Worker]:
    """Live workers that held no active model for ``idle_timeout_s``."""
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    active_model_on_worker = exists().where(
        Model.worker_id == Worker.id,
        or_(Model.last_active_at > since, _has_open_job()),  # type: ignore[arg-type]
    )
    return list(
        session.scalars(
            select(Worker).where(
                Worker.status.in_(("unreachable", "ready", "training", "sleeping")),
                ~active_model_on_worker,
                or_(Worker.last_active_at.is_(None), Worker.last_active_at < since),
            )
        )
    )


def mark_model_active(session: Session, *, model: Model, min_interval_s: float = 30.0) -> None:
    """Note a use of the model; written at most every ``min_interval_s`` (a hot path)."""
    now = utcnow()
    if model.last_active_at is None or model.last_active_at < now - timedelta(
        seconds=min_interval_s
    ):
        model.last_active_at = now
        session.commit()

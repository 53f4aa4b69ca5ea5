"""Placement and the provisioning policy: which worker holds which model, and when workers
are started and stopped.

- A model is *active* while it was registered, used for inference or trained within
  ``model_idle_timeout_s`` (a Tinker run: sent a request), or has a job queued or running
  that needs a worker (a Tinker run's job runs while its session lives, but needs its worker
  only while an operation of it is queued or running). Active models are placed. The idle
  clock stands still while an active model waits for a place or for its worker to start
  serving (to within half the timeout).
- A placed model that is no longer active is taken off its worker (``release_idle_models``):
  the worker's next heartbeat answer leaves it out, so the agent unloads its adapters, and its
  place (the worker's ``max_models``, the tenant's ``max_placed_models``) goes to a model that
  waits. Its next request makes it active again, and it is placed again like any model. An
  idle Tinker run's job is taken back from its worker (``tinker_rows.hand_back_idle_run``): its
  next operation places it again, and the worker that leases it rebuilds its state.
- Otherwise placement is sticky: a model stays on its worker until that worker is gone; then
  it is placed again (its adapters are fetched from the object store by the new worker). A
  pass places or unplaces a model only if its row still holds the worker the pass read (the
  row locked on PostgreSQL): a placement committed meanwhile by another control plane is not
  written over.
  Nor is a model placed on a worker that went away after the pass read it (its row is locked
  and its status checked first): the model waits for the next pass.
- A model with no live worker for its base model makes the provider start one, up to
  ``max_workers``. A worker that failed to start (its launch failed, its setup failed, it did
  not register by the deadline) holds the next launch for its base model back: for
  ``worker_launch_backoff_s``, doubling with each failure in a row up to
  ``worker_launch_backoff_max_s``; after ``worker_launch_max_failures`` in a row, until an
  operator runs ``skytrain workers retry``. So a missing cloud credential or a setup that
  cannot install shows up as the model's status instead of a launch loop.
- A worker with no active model for ``worker_idle_timeout_s`` is stopped. Sooner when the
  control plane runs ``max_workers`` workers and a model waits for a launch (``scale_in.make_room``):
  then a worker with nothing to do (no active model placed on it, no job queued for one or
  running on it: an open Tinker run's job runs while its session lives) is stopped at once,
  the one idle longest first, one per base model held back (less the workers already
  draining; none when stopping every such worker would not let one launch), and a later
  pass launches the waiting model's worker. A worker that serves an active model, runs a
  job, or is still provisioning or starting is never stopped for it; nor is any worker
  stopped for a model that waits on its tenant's own ``max_workers`` quota.
- A model goes only to a worker whose engine loads adapters of its LoRA rank; a model (or a
  job) no worker for its base model could serve is refused up front
  (``ranks.check_lora_rank``). So is a model whose base model fits none of the GPUs the
  provider's workers may get, by the memory plan at the model's own rank
  (``api.admission.model_rules.check_fits_a_gpu``), unless a worker for it is registered.
- Slots by fair share: a model no worker has room for, and none is launched for, takes a
  slot from a tenant holding more than its fair share (``fair_share``).
- Quotas: a tenant has at most ``max_placed_models`` models placed at once, on at most
  ``max_workers`` workers (``db.tenants``); its next model waits until one goes idle, so one
  tenant's models cannot fill every worker while another tenant's model waits forever.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, delete, exists, func, or_, select, union_all, update
from sqlalchemy.orm import Session

from skytrain_backend.db import tinker_rows
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import (
    Model,
    ModelEvent,
    ModelReplica,
    TrainingJob,
    Worker,
    utcnow,
)
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.scheduler import fair_share, queue, ranks

logger = logging.getLogger(__name__)

# Models wait on an unreachable worker (it may be reached once the provider reports its
# address) and on one whose engine sleeps during a job.
PLACEABLE_STATUSES = ("provisioning", "starting", "unreachable", "ready", "training", "sleeping")
# Workers launched or registered that do not serve yet: a model placed on one still waits.
STARTING_STATUSES = ("provisioning", "starting")
# Workers that serve (or may, once reached): only these are stopped for being idle.
SERVING_STATUSES = ("unreachable", "ready", "training", "sleeping")
# Workers that joined with a join token (not started by this control plane's provider).
JOINED_PROVIDER = "manual"
# How the status of a failed worker whose launch the memory plan stopped starts (its base
# model fits no configured GPU, or its config.json could not be read): the rest is
# skytrain's own words, shown to the tenant.
NOT_LAUNCHED = "not launched: "


def placeable() -> ColumnElement[bool]:
    """Workers models may be placed on: live ones, except a joined worker the control plane
    cannot reach. Whoever holds a join token can make one advertise any address; until it is
    reached it gets no tenant's model (its models go elsewhere, or wait)."""
    return and_(
        Worker.status.in_(PLACEABLE_STATUSES),
        or_(Worker.status != "unreachable", Worker.provider != JOINED_PROVIDER),
    )


@dataclass(frozen=True)
class LaunchBackoff:
    """How launches for a base model whose workers failed to start are spaced out."""

    base_s: float
    max_s: float
    max_failures: int

    def wait_s(self, failures: int) -> float | None:
        """The wait after ``failures`` failed launches in a row (None: no more launches)."""
        if failures >= self.max_failures:
            return None
        return float(min(self.base_s * 2 ** (failures - 1), self.max_s))


def has_open_job() -> ColumnElement[bool]:
    """A job of the model (``Model`` in the query) is queued or running, and needs a worker
    (a Tinker run's only while an operation of it is queued or running)."""
    return exists().where(
        TrainingJob.model_id == Model.id,
        TrainingJob.status.in_(("queued", "running")),
        tinker_rows.job_needs_its_worker(),
    )


def release_idle_models(session: Session, *, idle_timeout_s: float) -> int:
    """Take every placed model unused for ``idle_timeout_s`` (and with no open job that
    needs its worker) off its worker; how many. A model used meanwhile (its row is locked and
    read again) keeps its place; an idle Tinker run's job is taken back from its worker."""
    _hold_idle_clocks_of_starting_workers(session, idle_timeout_s=idle_timeout_s)
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    idle = and_(
        or_(Model.last_active_at.is_(None), Model.last_active_at <= since),
        ~tinker_rows.run_used_since(since),
        ~has_open_job(),
    )
    serving = select(Worker.id).where(Worker.status.not_in(STARTING_STATUSES))
    released = 0
    for model_id, worker_id in session.execute(
        select(Model.id, Model.worker_id).where(Model.worker_id.in_(serving), idle)
    ).all():
        row = session.execute(
            select(Model.worker_id)
            .where(Model.id == model_id, idle)
            .with_for_update(key_share=True)
        ).first()
        if row is None or row.worker_id != worker_id:
            session.rollback()
            continue
        if not tinker_rows.hand_back_idle_run(session, model_id=model_id, why="idle timeout"):
            session.rollback()
            continue
        session.execute(update(Model).where(Model.id == model_id).values(worker_id=None))
        session.execute(delete(ModelReplica).where(ModelReplica.model_id == model_id))
        session.commit()
        released += 1
        logger.info(
            "model %s idle for %.0fs: taken off worker %s", model_id, idle_timeout_s, worker_id
        )
    return released


def _hold_idle_clocks_of_starting_workers(session: Session, *, idle_timeout_s: float) -> None:
    """An active model placed on a worker that has not started serving yet still waits: its
    idle clock stands still (refreshed at half the timeout) until the worker serves it.

    Written only when a clock is due: any UPDATE of the models table empties the gateway's
    route caches in this process (``api/route_cache.py``), which one every pass would do."""
    now = utcnow()
    starting = select(Worker.id).where(Worker.status.in_(STARTING_STATUSES))
    due = and_(
        Model.worker_id.in_(starting),
        Model.last_active_at > now - timedelta(seconds=idle_timeout_s),
        Model.last_active_at <= now - timedelta(seconds=idle_timeout_s / 2),
    )
    if session.scalar(select(exists().where(due))):
        session.execute(
            update(Model)
            .where(due)
            .values(last_active_at=now)
            .execution_options(synchronize_session=False)
        )
    session.commit()


def active_models_without_worker(session: Session, *, idle_timeout_s: float) -> list[Model]:
    """Active models that no live worker holds."""
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    live = select(Worker.id).where(placeable())
    return list(
        session.scalars(
            select(Model)
            .where(
                or_(Model.worker_id.is_(None), Model.worker_id.not_in(live)),
                or_(Model.last_active_at > since, has_open_job()),
            )
            .order_by(Model.last_active_at)
        )
    )


def bases_waiting_for_a_slot(
    session: Session, *, idle_timeout_s: float, limits: Callable[[str], TenantLimits]
) -> set[str]:
    """The base models an active model waits for a slot on: its quota allows it one, and the
    live workers of its base that load its LoRA rank are all full (replicas leave those
    workers' room to it: ``replicas.scale``). A model no such worker could take (another
    rank, none yet) holds no replica back."""
    waiting: set[str] = set()
    for model in active_models_without_worker(session, idle_timeout_s=idle_timeout_s):
        if model.base_model in waiting:
            continue
        if quota_wait(session, model=model, limits=limits(model.tenant_id)) is not None:
            continue
        fitting = fitting_workers(
            session, base_model=model.base_model, lora_rank=ranks.model_lora_rank(model)
        )
        full = all(count >= int((w.capacity or {}).get("max_models", 1)) for w, count in fitting)
        if fitting and full:
            waiting.add(model.base_model)
    return waiting


def tenant_placements(session: Session, *, tenant_id: str) -> dict[str, int]:
    """The live workers holding the tenant's models, with how many of them each holds (a
    model's replicas count as placed models too: ``replicas.py``)."""
    homes = select(Model.worker_id.label("worker_id")).where(
        Model.tenant_id == tenant_id, Model.worker_id.is_not(None)
    )
    copies = (
        select(ModelReplica.worker_id.label("worker_id"))
        .join(Model, Model.id == ModelReplica.model_id)
        .where(Model.tenant_id == tenant_id)
    )
    held = union_all(homes, copies).subquery()
    rows = session.execute(
        select(held.c.worker_id, func.count())
        .join(Worker, Worker.id == held.c.worker_id)
        .where(placeable())
        .group_by(held.c.worker_id)
    )
    return {str(worker_id): int(count) for worker_id, count in rows}


def quota_wait(session: Session, *, model: Model, limits: TenantLimits) -> str | None:
    """Why the tenant's quota keeps ``model`` off the workers now (None: it does not)."""
    held = tenant_placements(session, tenant_id=model.tenant_id)
    if sum(held.values()) >= limits.max_placed_models:
        return (
            f"your tenant has {sum(held.values())} models on workers, the most its quota allows "
            f"(max_placed_models={limits.max_placed_models}): this model is placed once one "
            "of them goes idle (unused for SKYTRAIN_MODEL_IDLE_TIMEOUT_S), or when the "
            "operator raises the quota"
        )
    if len(held) >= limits.max_workers and (
        worker_with_room(
            session,
            base_model=model.base_model,
            lora_rank=ranks.model_lora_rank(model),
            among=set(held),
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
    launch: Callable[[str], None] | None,
    limits: Callable[[str], TenantLimits],
) -> list[str]:
    """Put every active unplaced model on a worker of its base model, launching if needed.

    ``launch(base_model)`` asks the provider for a new worker (None: no provider);
    ``limits(tenant_id)`` are the tenant's quotas. Returns the base models whose launch
    ``max_workers`` held back (each once): ``make_room`` stops idle workers for them.
    """
    launched: set[str] = set()
    held_back: list[str] = []
    for model in active_models_without_worker(session, idle_timeout_s=idle_timeout_s):
        # A replica that becomes the home takes no new slot: before the quota's check.
        if _promote_replica(session, model):
            continue
        quota = limits(model.tenant_id)
        held = tenant_placements(session, tenant_id=model.tenant_id)
        if sum(held.values()) >= quota.max_placed_models:
            if _unplace(session, model):
                _hold_idle_clock(session, model, idle_timeout_s=idle_timeout_s)
            continue
        at_worker_quota = len(held) >= quota.max_workers
        worker = worker_with_room(
            session,
            base_model=model.base_model,
            lora_rank=ranks.model_lora_rank(model),
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
            # Its idle time counts from now: the wait for a place was not idleness.
            model.last_active_at = utcnow()
            session.commit()
            logger.info("placed model %s on worker %s", model.id, worker.id)
            continue
        if not _unplace(session, model):
            continue
        _hold_idle_clock(session, model, idle_timeout_s=idle_timeout_s)
        base = model.base_model
        if base in launched:
            continue
        if (
            launch is not None
            and not at_worker_quota
            and base not in held_back
            and launch_hold(session, base_model=base) is None
        ):
            if live_worker_count(session) < max_workers:
                launched.add(base)
                launch(base)
                continue
            logger.info("model %s waits: max_workers=%d reached", model.id, max_workers)
            held_back.append(base)
        # No worker is coming for it: a slot another tenant holds beyond its fair share.
        among = set(held) if at_worker_quota else None
        fitting = fitting_workers(
            session, base_model=base, lora_rank=ranks.model_lora_rank(model), among=among
        )
        fair_share.take_slot(
            session,
            model=model,
            workers=[worker for worker, _ in fitting],
            locks=(_claim_worker, _placement_unchanged),
        )
    return held_back


def _promote_replica(session: Session, model: Model) -> bool:
    """A model whose home went away but that a replica still serves: that replica's worker
    becomes its home (it trains the model from now on); whether one did."""
    replica = session.scalar(
        select(ModelReplica)
        .join(Worker, Worker.id == ModelReplica.worker_id)
        .where(ModelReplica.model_id == model.id, ModelReplica.status == "serving", placeable())
        .order_by(ModelReplica.created_at)
        .limit(1)
    )
    if replica is None:
        return False
    if not _placement_unchanged(session, model):
        session.rollback()
        return True
    model.worker_id = replica.worker_id
    model.last_active_at = utcnow()
    session.delete(replica)
    left = session.scalar(
        select(func.count(ModelReplica.id)).where(ModelReplica.model_id == model.id)
    )
    session.add(
        ModelEvent(
            model_id=model.id,
            kind="home_moved",
            reason=f"its home worker went away: its replica on worker {replica.worker_id} "
            "serves on and trains it from now on",
            replicas=int(left or 0),  # the deleted row is still counted until the flush
            worker_id=replica.worker_id,
        )
    )
    session.commit()
    logger.info("model %s: its replica on worker %s is now its home", model.id, model.worker_id)
    return True


def _hold_idle_clock(session: Session, model: Model, *, idle_timeout_s: float) -> None:
    """An active model waiting for a place (a worker launching, which takes minutes on a
    cloud; the tenant's quota) stays active: it would otherwise go idle before its worker
    registers, and that worker find nothing to serve. Refreshed at half the timeout, so a
    waiting model costs one write per ``idle_timeout_s / 2``, not one per pass."""
    now = utcnow()
    if model.last_active_at is not None and model.last_active_at > now - timedelta(
        seconds=idle_timeout_s / 2
    ):
        return
    session.execute(
        update(Model)
        .where(Model.id == model.id, Model.worker_id.is_(None))
        .values(last_active_at=now)
    )
    session.commit()


def _claim_worker(session: Session, worker: Worker) -> bool:
    """Mark the worker active if it still takes models (it may have been lost, stopped, asked
    to drain or deleted since the pass read it), its row locked until the transaction ends;
    False (and nothing written) when it does not. One statement checks and locks: on
    PostgreSQL, one that waited for a concurrent writer of the row checks the row that writer
    committed."""
    claimed = session.scalar(
        update(Worker)
        .where(Worker.id == worker.id, placeable())
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


def fitting_workers(
    session: Session, *, base_model: str, lora_rank: int, among: set[str] | None = None
) -> list[tuple[Worker, int]]:
    """The live workers of ``base_model`` (of ``among``, when given) that load adapters of
    ``lora_rank``, room or not, with how many models each holds, the fewest first."""
    placed = (
        select(func.count(Model.id)).where(Model.worker_id == Worker.id).scalar_subquery()
        + select(func.count(ModelReplica.id))
        .where(ModelReplica.worker_id == Worker.id)
        .scalar_subquery()
    )
    statement = (
        select(Worker, placed)
        .where(Worker.base_model == base_model, placeable())
        .order_by(placed, Worker.created_at)
    )
    if among is not None:
        statement = statement.where(Worker.id.in_(among))
    return [
        (worker, count)
        for worker, count in session.execute(statement).all()
        if (limit := ranks.worker_rank_limit(worker)) is None or lora_rank <= limit
    ]


def worker_with_room(
    session: Session, *, base_model: str, lora_rank: int, among: set[str] | None = None
) -> Worker | None:
    """The live worker of ``base_model`` (one of ``among``, when given) holding the fewest
    models, if it has room for one more and loads adapters of ``lora_rank``."""
    fitting = fitting_workers(session, base_model=base_model, lora_rank=lora_rank, among=among)
    for worker, count in fitting:
        if count < int((worker.capacity or {}).get("max_models", 1)):
            return worker
    return None


def served_by_a_registered_worker(session: Session, *, base_model: str) -> bool:
    """A worker for ``base_model`` has registered: it planned for its own GPUs, which may not
    be the provider's (a worker joined by hand)."""
    return bool(
        session.scalar(
            select(
                exists().where(
                    Worker.base_model == base_model,
                    Worker.status.in_(worker_rows.REGISTERED_STATUSES),
                )
            )
        )
    )


def live_worker_count(session: Session) -> int:
    """Workers counted in ``max_workers``: every live one, draining ones included."""
    return int(
        session.scalar(
            select(func.count(Worker.id)).where(Worker.status.in_(worker_rows.LIVE_STATUSES))
        )
        or 0
    )


def newest_worker(session: Session, *, base_model: str) -> Worker | None:
    """The last worker started (or joined) for ``base_model``: what became of it decides
    whether another is launched."""
    return session.scalar(
        select(Worker)
        .where(Worker.base_model == base_model)
        .order_by(Worker.created_at.desc())
        .limit(1)
    )


@dataclass(frozen=True)
class LaunchHold:
    """Why no worker is launched for a base model now: its last ones failed to start."""

    failures: int
    # When the next launch goes (None: not before an operator's `skytrain workers retry`).
    after: datetime | None
    worker: Worker

    def describe(self, base_model: str) -> str:
        """In words, with what the operator can do; no provider's details."""
        said = f"{self.failures} in a row"
        if self.after is None:
            return (
                f"{said}; no more are launched until the operator finds why (`skytrain workers "
                f"list`, `skytrain logs {self.worker.id}`) and runs `skytrain workers retry "
                f"{base_model}`"
            )
        wait_s = max(0.0, (self.after - utcnow()).total_seconds())
        return f"{said}; the next is launched in {_duration(wait_s)}"


def launch_hold(session: Session, *, base_model: str) -> LaunchHold | None:
    """What holds the next launch for ``base_model`` back, if anything does."""
    newest = newest_worker(session, base_model=base_model)
    if newest is None or newest.status != "failed" or not newest.launch_failures:
        return None
    if newest.relaunch_after is not None and newest.relaunch_after <= utcnow():
        return None
    return LaunchHold(newest.launch_failures, newest.relaunch_after, newest)


def retry_launches(session: Session, *, base_model: str) -> Worker | None:
    """An operator's retry: forget the failures in a row of ``base_model``'s launches, so
    the next pass launches a worker if a model needs one. The worker whose failure is
    forgiven (None: its last worker did not fail to start, so nothing holds launches back)."""
    newest = newest_worker(session, base_model=base_model)
    if newest is None or newest.status != "failed":
        return None
    newest.launch_failures = 0
    newest.relaunch_after = None
    session.commit()
    return newest


def _duration(seconds: float) -> str:
    if seconds >= 5400:
        return f"{seconds / 3600:.1f} h"
    if seconds >= 90:
        return f"{seconds / 60:.0f} min"
    return f"{seconds:.0f} s"


def worker_gone(
    session: Session,
    *,
    worker: Worker,
    status: str,
    reason: str,
    backoff: LaunchBackoff | None = None,
) -> None:
    """A worker stopped, was lost or failed: free its models and release its jobs.

    A worker that ``failed`` to start counts as one more failed launch for its base model in
    a row, and holds the next launch back as ``backoff`` says.
    """
    worker.status = status
    worker.status_message = reason
    worker.stopped_at = utcnow()
    worker.served = []
    if status == "failed" and backoff is not None:
        failures = _failures_before(session, worker) + 1
        wait_s = backoff.wait_s(failures)
        worker.launch_failures = failures
        worker.relaunch_after = (
            None if wait_s is None else worker.stopped_at + timedelta(seconds=wait_s)
        )
    for model in session.scalars(select(Model).where(Model.worker_id == worker.id)):
        model.worker_id = None
    session.execute(delete(ModelReplica).where(ModelReplica.worker_id == worker.id))
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


def _failures_before(session: Session, worker: Worker) -> int:
    """Failed launches in a row for the worker's base model before this worker's."""
    previous = session.scalar(
        select(Worker)
        .where(
            Worker.base_model == worker.base_model,
            Worker.id != worker.id,
            Worker.created_at <= worker.created_at,
        )
        .order_by(Worker.created_at.desc())
        .limit(1)
    )
    if previous is None or previous.status != "failed":
        return 0
    return previous.launch_failures or 0


def mark_model_active(session: Session, *, model: Model, min_interval_s: float = 30.0) -> None:
    """Note a use of the model; written at most every ``min_interval_s`` (a hot path)."""
    now = utcnow()
    if model.last_active_at is None or model.last_active_at < now - timedelta(
        seconds=min_interval_s
    ):
        model.last_active_at = now
        session.commit()

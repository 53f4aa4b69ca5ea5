"""Scale-in: which workers the scheduler stops for having nothing to do.

- ``idle_workers``: a live worker that held no active model for ``worker_idle_timeout_s``.
- ``make_room``: sooner, when the control plane runs ``max_workers`` workers and a model
  waits for a launch (``placement.place_models`` returns the base models it held back): a
  worker with no work at all is asked to drain, the one idle longest first. The scheduler
  stops both kinds the same way (``Scheduler._stop_drained``).
"""

from __future__ import annotations

import logging
from datetime import datetime, timedelta

from sqlalchemy import ColumnElement, and_, exists, func, or_, select, update
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Model, ModelReplica, TrainingJob, Worker, utcnow
from skytrain_backend.scheduler import placement

logger = logging.getLogger(__name__)

# How a worker's status message starts when it is stopped to make room.
MAKING_ROOM = "idle: stopped to make room"


def make_room(
    session: Session, *, held_back: list[str], idle_timeout_s: float, max_workers: int
) -> list[tuple[Worker, str]]:
    """Ask idle workers to drain so that base models ``held_back`` by ``max_workers`` get
    their workers. Returns each worker marked ``draining`` (committed) with why, for the
    scheduler to stop as it stops an idle worker.

    A worker may go when it serves (it is not provisioning or starting) and has no work:
    no active model placed on it (``idle_timeout_s`` is the models' idle timeout), no job
    queued for one, none running on it (a Tinker run's job runs while its session lives).
    As many go, idle longest first, as let the most of those base models launch a worker
    once the workers already draining are gone: one each while the count is at the limit,
    none when too few could go to let even one launch. Each is checked again as it is
    marked, so one that got work since it was read stays.
    """
    if not held_back:
        return []
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    free = and_(Worker.status.in_(placement.SERVING_STATUSES), ~_has_work(since))
    candidates = list(
        session.scalars(
            select(Worker.id)
            .where(free)
            .order_by(Worker.last_active_at.is_not(None), Worker.last_active_at, Worker.created_at)
        )
    )
    draining = int(
        session.scalar(select(func.count(Worker.id)).where(Worker.status == "draining")) or 0
    )
    # Workers left once the draining ones are gone, and how many launches the limit leaves.
    staying = placement.live_worker_count(session) - draining
    launches = min(len(held_back), max_workers - staying + len(candidates))
    if launches <= 0:
        return []
    needed = staying + launches - max_workers
    bases = ", ".join(held_back[:launches])
    reason = f"{MAKING_ROOM} for a worker for {bases} (max_workers={max_workers} reached)"
    stopping: list[tuple[Worker, str]] = []
    for worker_id in candidates:
        if len(stopping) >= needed:
            break
        claimed = session.scalar(
            update(Worker)
            .where(Worker.id == worker_id, free)
            .values(status="draining", status_message=reason)
            .returning(Worker.id)
            .execution_options(synchronize_session=False)
        )
        session.commit()
        if claimed is None:
            logger.debug("worker %s got work meanwhile; it stays", worker_id)
            continue
        logger.info("worker %s is idle: stopping it to make room for %s", worker_id, bases)
        stopping.append((session.get_one(Worker, worker_id, populate_existing=True), reason))
    return stopping


def _active_model_on_worker(since: datetime) -> ColumnElement[bool]:
    """The worker holds a model (as its home or a replica) used after ``since`` or with a job
    queued or running."""
    active = or_(Model.last_active_at > since, placement.has_open_job())
    replica = (
        select(ModelReplica.id)
        .join(Model, Model.id == ModelReplica.model_id)
        .where(ModelReplica.worker_id == Worker.id, active)
        .exists()
    )
    return or_(exists().where(Model.worker_id == Worker.id, active), replica)


def _has_work(since: datetime) -> ColumnElement[bool]:
    """The worker holds an active model (see above) or runs a job."""
    running_here = exists().where(
        TrainingJob.worker_id == Worker.id, TrainingJob.status == "running"
    )
    return or_(_active_model_on_worker(since), running_here)


def idle_workers(session: Session, *, idle_timeout_s: float) -> list[Worker]:
    """Live workers that held no active model for ``idle_timeout_s``."""
    since = utcnow() - timedelta(seconds=idle_timeout_s)
    return list(
        session.scalars(
            select(Worker).where(
                Worker.status.in_(placement.SERVING_STATUSES),
                ~_active_model_on_worker(since),
                or_(Worker.last_active_at.is_(None), Worker.last_active_at < since),
            )
        )
    )

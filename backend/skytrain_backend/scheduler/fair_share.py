"""Slots by fair share: which model leaves a full worker so that another tenant's model that
waits for a slot gets one.

The slots are the places (``max_models``) on the live workers a waiting model could go to:
those of its base model that load its LoRA rank. When every one of them is taken and no
worker is being launched for it, a tenant holding more of them than the waiting model's
tenant does plus one (more than its share, with the slot moved) gives one up: its least
recently used model, however recently that was touched, unless a training job runs on it.
A Tinker training run's job runs for as long as its session heartbeats, but between two
operations nothing of it needs the worker: a run with no operation queued or running gives its
slot up like an idle model (its last use is its newest operation's arrival). Its job goes back
to the queue, not counted as a failed attempt; the worker loses the lease and lets the trainer
go; and the worker that leases the run next rebuilds its state from the newest restore point
and replays the steps after it (``scheduler.tinker.runs``), so nothing trained is lost.
Repeated pass after pass this shares the slots out max-min fairly among the tenants whose
models want them (a tenant wanting fewer than an equal share keeps all it wants) and never
moves a slot back and forth: after a move the tenant that gave one up holds at least as many
as the one that took it.

A replica (``replicas.py``: a model's second or later worker) is the cheapest slot: before any
model loses its place, a replica on those workers drains (one at a time, whoever's it is; the
tenant holding most slots first), and its slot goes to the waiting model once the requests in
flight on it are answered. Replicas count as slots held, and no replica is added while a
model waits for a slot on workers of its base model (``replicas.scale``).

The model taken off its worker is still active: it waits for a slot like any other, and says
so (``wait_status``). No torch and no provider here; ``placement`` makes the move.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime

from sqlalchemy import ColumnElement, exists, func, select, union_all
from sqlalchemy.orm import Session

from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import (
    Model,
    ModelEvent,
    ModelReplica,
    TinkerRun,
    TrainingJob,
    Worker,
    utcnow,
)

logger = logging.getLogger(__name__)

# How soon a model that takes a slot by fair share is served: the next scheduler pass (which
# its request wakes) moves it, and its worker loads the adapter in a few seconds.
TAKE_RETRY_AFTER_S = 5.0
# A model whose tenant holds its fair share waits for a model on the workers to go idle.
SHARE_HELD_RETRY_AFTER_S = 30.0


@dataclass(frozen=True)
class SlotWait:
    """Why a model waits for a slot on full workers, and when to ask again."""

    message: str
    retry_after_s: float


# The oldest time, for a model never used.
_NEVER = datetime.min.replace(tzinfo=UTC)


def _no_job_needs_the_worker() -> ColumnElement[bool]:
    """No training job of the model (``Model`` in the query) runs, but a Tinker run's job
    with no operation in flight."""
    return ~exists().where(
        TrainingJob.model_id == Model.id,
        TrainingJob.status == "running",
        tinker_rows.job_needs_its_worker(),
    )


def slots_held(session: Session, *, worker_ids: Collection[str]) -> dict[str, int]:
    """How many slots each tenant holds on ``worker_ids``: its models placed there and their
    replicas."""
    if not worker_ids:
        return {}
    homes = select(Model.tenant_id.label("tenant_id")).where(Model.worker_id.in_(worker_ids))
    copies = (
        select(Model.tenant_id.label("tenant_id"))
        .join(ModelReplica, ModelReplica.model_id == Model.id)
        .where(ModelReplica.worker_id.in_(worker_ids))
    )
    held = union_all(homes, copies).subquery()
    rows = session.execute(select(held.c.tenant_id, func.count()).group_by(held.c.tenant_id))
    return {str(tenant_id): int(count) for tenant_id, count in rows}


def replica_draining_on(session: Session, *, worker_ids: Collection[str]) -> bool:
    """Whether a replica drains on one of ``worker_ids`` (a slot is coming free there)."""
    draining = select(ModelReplica.id).where(
        ModelReplica.worker_id.in_(worker_ids), ModelReplica.status == "draining"
    )
    return session.scalar(draining.limit(1)) is not None


def replica_to_drain(session: Session, *, worker_ids: Collection[str]) -> ModelReplica | None:
    """The replica on ``worker_ids`` that drains so that a waiting model gets its slot: of
    the tenant holding most slots there, its newest; None while one already drains there
    (its slot is coming) or when there is none."""
    if not worker_ids or replica_draining_on(session, worker_ids=worker_ids):
        return None
    rows = session.execute(
        select(ModelReplica, Model.tenant_id)
        .join(Model, Model.id == ModelReplica.model_id)
        .where(ModelReplica.worker_id.in_(worker_ids), ModelReplica.status == "serving")
    ).all()
    if not rows:
        return None
    held = slots_held(session, worker_ids=worker_ids)
    return max(rows, key=lambda row: (held.get(row[1], 0), row[0].created_at))[0]


def drain_replica_for(session: Session, *, model: Model, replica: ModelReplica) -> None:
    """Drain ``replica`` so that ``model``, waiting, gets its slot (committed, with an event
    on the replica's model)."""
    replica.status = "draining"
    left = session.scalar(
        select(func.count(ModelReplica.id)).where(
            ModelReplica.model_id == replica.model_id, ModelReplica.status == "serving"
        )
    )
    session.add(
        ModelEvent(
            model_id=replica.model_id,
            kind="scale_in",
            reason=f"fair share: another model waits for a slot on worker {replica.worker_id}; "
            "a replica is the first slot to go (it drains, its requests in flight answered)",
            replicas=1 + int(left or 0),  # the home and the replicas still serving
            worker_id=replica.worker_id,
        )
    )
    session.commit()
    logger.info(
        "replica of model %s on worker %s drains: model %s waits for a slot (fair share)",
        replica.model_id,
        replica.worker_id,
        model.id,
    )


def _over_share(held: dict[str, int], *, tenant_id: str) -> list[str]:
    """The other tenants holding more than ``tenant_id``'s share, most slots first."""
    mine = held.get(tenant_id, 0)
    over = [other for other, count in held.items() if other != tenant_id and count > mine + 1]
    return sorted(over, key=lambda other: -held[other])


def victim(session: Session, *, tenant_id: str, worker_ids: Collection[str]) -> Model | None:
    """The model to take off one of ``worker_ids`` (all full) so that a model of
    ``tenant_id`` gets its slot: the least recently used of the tenant holding most above
    its share, with no job running (but a Tinker run's with no operation in flight); None when
    every tenant holds at most its share."""
    held = slots_held(session, worker_ids=worker_ids)
    for other in _over_share(held, tenant_id=tenant_id):
        rows = session.execute(
            select(Model, TinkerRun.last_request_at)
            .outerjoin(TinkerRun, TinkerRun.model_id == Model.id)
            .where(
                Model.tenant_id == other,
                Model.worker_id.in_(worker_ids),
                _no_job_needs_the_worker(),
            )
        ).all()
        if rows:
            # At most the slots of the workers: few rows. A run's operations do not touch
            # its model's ``last_active_at``; its newest one's arrival is its last use.
            return min(rows, key=lambda row: (_last_use(*row), row[0].created_at))[0]
    return None


def _last_use(model: Model, last_request_at: datetime | None) -> datetime:
    return max(when for when in (model.last_active_at, last_request_at, _NEVER) if when)


def take_slot(
    session: Session,
    *,
    model: Model,
    workers: Sequence[Worker],
    locks: tuple[Callable[[Session, Worker], bool], Callable[[Session, Model], bool]],
) -> bool:
    """Place ``model`` (unplaced, active) on the worker of the model ``victim`` names among
    ``workers``, which loses its place; whether it was. ``locks`` lock the worker's row, then
    a model's, each True if the row did not change since the pass read it (``placement``'s
    order and checks): nothing is written when one did.

    A replica on ``workers`` goes first (``replica_to_drain``): it drains, and the model is
    placed in its slot by a later pass; while one drains there, nothing else moves."""
    worker_ids = [w.id for w in workers]
    if replica_draining_on(session, worker_ids=worker_ids):
        return False
    replica = replica_to_drain(session, worker_ids=worker_ids)
    if replica is not None:
        drain_replica_for(session, model=model, replica=replica)
        return False
    loser = victim(session, tenant_id=model.tenant_id, worker_ids=[w.id for w in workers])
    worker = next((w for w in workers if loser is not None and w.id == loser.worker_id), None)
    if loser is None or worker is None:
        # Nothing locked or written. No rollback either: it would expire the pass's other
        # models, and one reloaded as placed meanwhile (by a concurrent pass) would then be
        # taken for a model whose worker is gone and unplaced (``placement._unplace``).
        return False
    lock_worker, lock_model = locks
    if not (lock_worker(session, worker) and lock_model(session, loser)):
        session.rollback()
        return False
    if not lock_model(session, model):
        session.rollback()
        return False
    if not tinker_rows.hand_back_idle_run(session, model_id=loser.id, why="fair share"):
        session.rollback()
        return False
    loser.worker_id = None
    model.worker_id = worker.id
    model.last_active_at = utcnow()  # its idle time counts from its placement
    session.commit()
    logger.info(
        "model %s took the slot of model %s (tenant %s) on worker %s: fair share",
        model.id,
        loser.id,
        loser.tenant_id,
        worker.id,
    )
    return True


def wait_status(session: Session, *, model: Model, worker_ids: Collection[str]) -> SlotWait:
    """What a model waiting for a slot on the full ``worker_ids`` is told."""
    base = model.base_model
    if (
        replica_draining_on(session, worker_ids=worker_ids)
        or replica_to_drain(session, worker_ids=worker_ids) is not None
    ):
        return SlotWait(
            message=f"every slot on the workers for {base} is taken, one of them by a "
            "replica (a model's second or later worker): the replica drains, and this model "
            "takes its slot once the requests in flight there are answered",
            retry_after_s=TAKE_RETRY_AFTER_S,
        )
    if victim(session, tenant_id=model.tenant_id, worker_ids=worker_ids) is not None:
        return SlotWait(
            message=f"every slot on the workers for {base} is taken, and another tenant's "
            "models hold more than their fair share of them: this model takes the place of "
            "that tenant's least recently used model at the scheduler's next pass, and is "
            "served a few seconds later",
            retry_after_s=TAKE_RETRY_AFTER_S,
        )
    held = slots_held(session, worker_ids=worker_ids)
    mine, total = held.get(model.tenant_id, 0), sum(held.values())
    return SlotWait(
        message=f"every slot on the workers for {base} is taken, and no tenant holds more "
        f"than its fair share of them (yours holds {mine} of {total}): this model is placed "
        "once a model on them goes idle (unused for SKYTRAIN_MODEL_IDLE_TIMEOUT_S) or is "
        "deleted; no worker is being started for it",
        retry_after_s=SHARE_HELD_RETRY_AFTER_S,
    )

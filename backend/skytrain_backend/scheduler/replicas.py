"""Replicas: a model served by 1..N workers of its base model, as many as its demand needs.

A placed model has a *home* (``Model.worker_id``: the worker that trains it, placed as
``placement.py`` says) and 0..N-1 *replicas* (``model_replicas`` rows) on other workers of its
base model, which load the same steps (the heartbeat answer lists the model to each) and share
its requests (the gateway balances them: ``api/gateway/balance.py``).

Each pass, for each placed model (``scale``):

- A replica whose worker went away is gone (``placement.worker_gone`` deletes its row).
- A ``draining`` replica (taken away) is deleted once the gateway has no request in flight on
  it: scale-in never drops a request. The worker then unloads the model once its front door has
  none in flight for it either (another control plane's gateway may still have sent one):
  ``worker/engine_host.py``.
- Below ``min_replicas`` (capped by the tenant's ``max_workers``): a replica is added; above
  ``max_replicas`` or ``max_workers`` (lowered since), the newest drains.
- Demand is the model's requests in flight, averaged over ``replica_window_s``
  (``demand.DemandMeter``). Above ``replica_scale_out_in_flight`` per replica, a replica is
  added, up to ``max_replicas`` (capped by the tenant's ``max_workers``). When the average
  counted over one replica fewer is below ``replica_scale_in_in_flight``, the newest replica
  drains, down to ``min_replicas``. Two thresholds (hysteresis), and no change for demand
  within ``replica_cooldown_s`` of the last one, so replicas do not flap.
- A replica goes to a live worker of the base model that loads the model's LoRA rank and has
  room (its ``max_models``), the one holding the fewest models first; only when none has room
  is a worker launched (once at a time per base model, within the control plane's and the
  tenant's ``max_workers``). A replica is a placed model of its tenant: it waits while the
  tenant holds ``max_placed_models`` places, and at the tenant's ``max_workers`` it goes only
  to a worker the tenant's models already occupy. No model is ever taken off a worker for a
  replica, and no replica is added while a model waits for a slot on the workers of its base
  model: one tenant's scale-out never evicts another tenant's model nor keeps it waiting. The
  other way round, a model waiting for a slot on full workers takes a replica's first: the
  replica drains (``fair_share.take_slot``).
- The demand per replica is the model's (``Demand``: ``GET /v1/models/{id}`` shows it; each
  pass also writes it to ``Model.demand_per_replica``, which ``skytrain models show`` reads)
  and, over the placed models, ``skytrain_model_demand_per_replica{stat="max"|"mean"}``.
- Every decision is a ``model_events`` row with its reason (``skytrain models show``,
  ``GET /v1/models/{id}/events``); a wait (no room, a quota) is written once, not per pass.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Collection
from dataclasses import dataclass
from datetime import timedelta
from typing import Literal

from sqlalchemy import delete, func, or_, select, update
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Model, ModelEvent, ModelReplica, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.observability import metrics as observed
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.scheduler import placement, ranks
from skytrain_backend.scheduler.demand import DemandMeter
from skytrain_backend.scheduler.serving import ROUTABLE_WORKER_STATUSES

logger = logging.getLogger(__name__)

# Events that change the number of replicas for demand: the cool-down counts from the last.
SCALING_EVENTS = ("scale_out", "scale_in")


@dataclass(frozen=True)
class ScalePolicy:
    """The settings of the replica policy (``Settings.replica_*``)."""

    window_s: float
    scale_out_in_flight: float
    scale_in_in_flight: float
    cooldown_s: float


@dataclass(frozen=True)
class Demand:
    """A model's demand as this control plane's gateway counts it (what the policy reads):
    its requests in flight now, their average over ``window_s`` (None until this process has
    counted that long) and the workers serving it (home and replicas not draining)."""

    in_flight: int
    average_in_flight: float | None
    replicas: int
    window_s: float

    @property
    def per_replica(self) -> float | None:
        if self.average_in_flight is None or not self.replicas:
            return None
        return self.average_in_flight / self.replicas


def serving_count(session: Session, *, model: Model) -> int:
    """The workers serving the model: its home (asleep while it trains, still counted: it
    serves again after the job) and its replicas not draining."""
    serving = replica_workers(session, model_id=model.id, status="serving")
    return (1 if model.worker_id else 0) + len(serving)


def demand_of(session: Session, *, model: Model, demand: DemandMeter, window_s: float) -> Demand:
    return Demand(
        in_flight=demand.in_flight(model.id),
        average_in_flight=demand.average(model.id, window_s=window_s),
        replicas=serving_count(session, model=model),
        window_s=window_s,
    )


# serving: its worker answers requests; sleeping: its engine sleeps while the worker trains;
# starting: its worker is not up yet; draining: it gets no new request and goes once those in
# flight are answered (the replica, or its whole worker); unreachable: its worker stopped
# answering or has ended.
ReplicaStatus = Literal["serving", "sleeping", "starting", "unreachable", "draining"]


def _status(worker_status: str | None, *, draining: bool = False) -> ReplicaStatus:
    if draining or worker_status == "draining":
        return "draining"
    if worker_status in ROUTABLE_WORKER_STATUSES:
        return "serving"
    if worker_status == "sleeping":
        return "sleeping"
    return "starting" if worker_status in ("provisioning", "starting") else "unreachable"


@dataclass(frozen=True)
class Placed:
    """A worker holding the model: its ``home`` (which trains it) or a ``replica``, with what
    it can do now."""

    worker_id: str
    role: Literal["home", "replica"]
    status: ReplicaStatus


def placed_on(session: Session, *, model: Model) -> list[Placed]:
    """The model's home, then its replicas in the order they were added."""
    found = []
    if model.worker_id:
        home = session.get(Worker, model.worker_id)
        found.append(Placed(model.worker_id, "home", _status(home.status if home else None)))
    for replica, worker_status in session.execute(
        select(ModelReplica, Worker.status)
        .join(Worker, Worker.id == ModelReplica.worker_id)
        .where(ModelReplica.model_id == model.id)
        .order_by(ModelReplica.created_at, ModelReplica.id)
    ):
        status = _status(worker_status, draining=replica.status == "draining")
        found.append(Placed(replica.worker_id, "replica", status))
    return found


def replica_workers(session: Session, *, model_id: str, status: str | None = None) -> list[str]:
    """The workers holding a replica of the model (in ``status``, when given), oldest first."""
    statement = (
        select(ModelReplica.worker_id)
        .where(ModelReplica.model_id == model_id)
        .order_by(ModelReplica.created_at, ModelReplica.id)
    )
    if status is not None:
        statement = statement.where(ModelReplica.status == status)
    return list(session.scalars(statement))


def record(
    session: Session,
    *,
    model: Model,
    kind: str,
    reason: str,
    replicas: int,
    worker_id: str | None = None,
) -> None:
    """Write a decision about the model's replicas (committed by the caller)."""
    session.add(
        ModelEvent(
            model_id=model.id, kind=kind, reason=reason, replicas=replicas, worker_id=worker_id
        )
    )
    observed.replica_decided(kind)
    logger.info("model %s: %s (%d replicas): %s", model.id, kind, replicas, reason)


def _record_wait(session: Session, *, model: Model, reason: str, cause: str, replicas: int) -> None:
    """A wait (``reason``, then ``cause``) is written once: not again while the model's last
    event is a wait for the same cause (the reason's figures change pass by pass)."""
    last = session.scalar(
        select(ModelEvent).where(ModelEvent.model_id == model.id).order_by(ModelEvent.id.desc())
    )
    if last is not None and last.kind == "held" and last.reason.endswith(cause):
        return
    record(session, model=model, kind="held", reason=f"{reason}{cause}", replicas=replicas)
    session.commit()


def _cooling(session: Session, *, model_id: str, cooldown_s: float) -> bool:
    last = session.scalar(
        select(func.max(ModelEvent.created_at)).where(
            ModelEvent.model_id == model_id, ModelEvent.kind.in_(SCALING_EVENTS)
        )
    )
    return last is not None and last > utcnow() - timedelta(seconds=cooldown_s)


def scale(
    session: Session,
    *,
    demand: DemandMeter,
    policy: ScalePolicy,
    limits: Callable[[str], TenantLimits],
    max_workers: int,
    launch: Callable[[str], None] | None,
    waiting: Collection[str] = (),
) -> None:
    """One pass of the replica policy over every placed model (see the module's doc);
    ``waiting``: the base models that a model waits for a slot on (no replica is added on
    their workers meanwhile)."""
    live = select(Worker.id).where(placement.placeable())
    homed = list(
        session.scalars(select(Model).where(Model.worker_id.in_(live)).order_by(Model.created_at))
    )
    # A model whose home went away while a replica of it drained has no pass of its own
    # below: its draining replicas still go once nothing is in flight on them (they would
    # otherwise hold their slot, and fair share's turn on those workers, for ever).
    homeless = session.scalars(
        select(Model)
        .join(ModelReplica, ModelReplica.model_id == Model.id)
        .where(ModelReplica.status == "draining", Model.id.not_in([m.id for m in homed]))
        .distinct()
    )
    for model in list(homeless):
        _finish_draining(session, model=model, demand=demand)
    launched: set[str] = set()
    per_replica_demands: list[float] = []
    for model in homed:
        _finish_draining(session, model=model, demand=demand)
        config = ModelConfig.model_validate(model.config or {})
        quota = limits(model.tenant_id)
        serving = replica_workers(session, model_id=model.id, status="serving")
        count = 1 + len(serving)
        cap = min(config.max_replicas, quota.max_workers)
        floor = min(config.min_replicas, cap)
        average = demand.average(model.id, window_s=policy.window_s)
        per_replica = None if average is None else average / count
        if per_replica is not None:
            per_replica_demands.append(per_replica)
        # For readers of the database (``skytrain models show``); rounded, so that a steady
        # demand is not written again at every pass.
        model.demand_per_replica = None if per_replica is None else round(per_replica, 1)
        # Why a replica is added, or the newest drains, this pass (None: neither).
        adding: str | None = None
        draining: str | None = None
        if count > cap and serving:
            # max_replicas or the tenant's max_workers lowered since (a PATCH, the operator).
            draining = (
                f"{count} replicas, more than max_replicas={config.max_replicas} and "
                f"your tenant's max_workers={quota.max_workers} allow"
            )
        elif count < floor:
            adding = f"{count} of min_replicas={config.min_replicas} replicas"
        elif (
            average is not None
            and per_replica is not None
            and not _cooling(session, model_id=model.id, cooldown_s=policy.cooldown_s)
        ):
            said = f"{average:.1f} requests in flight on average over {policy.window_s:.0f} s"
            if per_replica > policy.scale_out_in_flight and count < cap:
                adding = (
                    f"{said}: {per_replica:.1f} per replica over {count}, above "
                    f"{policy.scale_out_in_flight:g}"
                )
            elif count > floor and serving and average / (count - 1) < policy.scale_in_in_flight:
                draining = (
                    f"{said}: {average / (count - 1):.1f} per replica over {count - 1} would "
                    f"be below {policy.scale_in_in_flight:g}"
                )
        if draining is not None:
            _drain(session, model=model, worker_id=serving[-1], count=count, reason=draining)
        elif adding is not None:
            _add(
                session,
                model=model,
                count=count,
                quota=quota,
                max_workers=max_workers,
                launch=launch,
                launched=launched,
                waiting=waiting,
                reason=adding,
            )
    observed.demand_per_replica(per_replica_demands)
    # A model no longer placed has no demand per replica. Set row by row, not by a bulk
    # UPDATE: the gateway's route cache is emptied by any bulk update of models
    # (``api/route_cache.py``), and this runs every pass.
    unplaced = select(Model).where(
        Model.demand_per_replica.is_not(None),
        or_(Model.worker_id.is_(None), Model.worker_id.not_in(live)),
    )
    for unplaced_model in session.scalars(unplaced):
        unplaced_model.demand_per_replica = None
    session.commit()


def _finish_draining(session: Session, *, model: Model, demand: DemandMeter) -> None:
    """Delete the model's draining replicas that have no request in flight."""
    for worker_id in replica_workers(session, model_id=model.id, status="draining"):
        if demand.in_flight(model.id, worker_id) > 0:
            continue
        session.execute(
            delete(ModelReplica).where(
                ModelReplica.model_id == model.id,
                ModelReplica.worker_id == worker_id,
                ModelReplica.status == "draining",
            )
        )
        left = 1 + len(replica_workers(session, model_id=model.id, status="serving"))
        record(
            session,
            model=model,
            kind="replica_removed",
            reason=f"worker {worker_id} drained: no request in flight on it; it unloads the model",
            replicas=left,
            worker_id=worker_id,
        )
        session.commit()


def _drain(session: Session, *, model: Model, worker_id: str, count: int, reason: str) -> None:
    """Stop sending the model's requests to ``worker_id``; its row goes once none is left."""
    session.execute(
        update(ModelReplica)
        .where(ModelReplica.model_id == model.id, ModelReplica.worker_id == worker_id)
        .values(status="draining")
    )
    record(
        session,
        model=model,
        kind="scale_in",
        reason=reason,
        replicas=count - 1,
        worker_id=worker_id,
    )
    session.commit()


def _add(
    session: Session,
    *,
    model: Model,
    count: int,
    quota: TenantLimits,
    max_workers: int,
    launch: Callable[[str], None] | None,
    launched: set[str],
    waiting: Collection[str],
    reason: str,
) -> None:
    """Put one more replica of the model on a worker with room, or launch one for it; not
    past the tenant's ``max_placed_models`` (a replica is a placed model), and not while a
    model waits for a slot on the workers of its base model (``waiting``: models first)."""
    placed = placement.tenant_placements(session, tenant_id=model.tenant_id)
    if sum(placed.values()) >= quota.max_placed_models:
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f", but your tenant has {sum(placed.values())} models and replicas on "
            f"workers, the most its quota allows (max_placed_models={quota.max_placed_models})",
            replicas=count,
        )
        return
    if model.base_model in waiting:
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f", but a model waits for a slot on the workers of {model.base_model}: "
            "models are placed before replicas are added",
            replicas=count,
        )
        return
    held = set(placed)
    taken = {model.worker_id, *replica_workers(session, model_id=model.id)}
    at_quota = len(held) >= quota.max_workers
    rank = ranks.model_lora_rank(model)
    fitting = placement.fitting_workers(
        session, base_model=model.base_model, lora_rank=rank, among=held if at_quota else None
    )
    for worker, holds in fitting:
        if worker.id in taken or holds >= int((worker.capacity or {}).get("max_models", 1)):
            continue
        session.add(ModelReplica(model_id=model.id, worker_id=worker.id))
        record(
            session,
            model=model,
            kind="scale_out",
            reason=f"{reason}: replica placed on worker {worker.id}",
            replicas=count + 1,
            worker_id=worker.id,
        )
        session.commit()
        return
    if at_quota:
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f", but no worker of the {len(held)} your tenant's models occupy has room "
            f"for another replica (max_workers={quota.max_workers})",
            replicas=count,
        )
        return
    base = model.base_model
    starting = session.scalar(
        select(Worker.id).where(
            Worker.base_model == base, Worker.status.in_(placement.STARTING_STATUSES)
        )
    )
    if starting is not None or base in launched:
        # A worker is on its way: the replica goes there once it registers.
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f": waiting for a worker for {base} that is starting",
            replicas=count,
        )
        return
    if launch is None or placement.launch_hold(session, base_model=base) is not None:
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f", but no worker of {base} has room and none can be launched now",
            replicas=count,
        )
        return
    if placement.live_worker_count(session) >= max_workers:
        _record_wait(
            session,
            model=model,
            reason=reason,
            cause=f", but no worker of {base} has room and the control plane runs the most "
            f"workers it may (max_workers={max_workers})",
            replicas=count,
        )
        return
    launched.add(base)
    record(
        session,
        model=model,
        kind="launch",
        reason=f"{reason}: no worker of {base} has room, launching one",
        replicas=count,
    )
    session.commit()
    launch(base)


def forget_worker(session: Session, *, worker_id: str) -> None:
    """A worker went away: its replicas are gone (not committed: the caller's transaction)."""
    session.execute(delete(ModelReplica).where(ModelReplica.worker_id == worker_id))


def check_bounds(config: ModelConfig, *, limits: TenantLimits) -> None:
    """Refuse (400) a ``max_replicas`` above the tenant's ``max_workers``: each replica takes a
    worker of its own."""
    if config.max_replicas > limits.max_workers:
        raise InvalidRequest(
            f"max_replicas={config.max_replicas} is more than your tenant's max_workers="
            f"{limits.max_workers}: each replica holds a worker of its own"
        )


def set_bounds(
    session: Session,
    *,
    model: Model,
    min_replicas: int | None,
    max_replicas: int | None,
    limits: TenantLimits,
) -> ModelConfig:
    """Change the model's ``min_replicas``/``max_replicas`` (400 naming the problem, nothing
    stored, when they are out of order or above the tenant's ``max_workers``); committed, with
    an event. The next pass adds or drains replicas to fit them."""
    current = ModelConfig.model_validate(model.config or {})
    changes = {
        key: value
        for key, value in (("min_replicas", min_replicas), ("max_replicas", max_replicas))
        if value is not None
    }
    try:
        config = ModelConfig.model_validate({**current.model_dump(mode="json"), **changes})
    except ValueError as exc:
        raise InvalidRequest(_first_error(exc)) from None
    check_bounds(config, limits=limits)
    model.config = config.model_dump(mode="json")
    serving = replica_workers(session, model_id=model.id, status="serving")
    count = serving_count(session, model=model)
    record(
        session,
        model=model,
        kind="replicas_set",
        reason=f"min_replicas={config.min_replicas}, max_replicas={config.max_replicas}",
        replicas=count,
    )
    # Above the new maximum: the newest replicas drain at once (no cool-down).
    for worker_id in reversed(serving):
        if count <= config.max_replicas:
            break
        _drain(
            session,
            model=model,
            worker_id=worker_id,
            count=count,
            reason=f"{count} replicas, more than max_replicas={config.max_replicas}",
        )
        count -= 1
    session.commit()
    return config


def _first_error(exc: ValueError) -> str:
    errors = getattr(exc, "errors", None)
    if callable(errors):
        first = errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ()))
        message = str(first.get("msg", exc)).removeprefix("Value error, ")
        return f"{where}: {message}" if where else message
    return str(exc)


def events(session: Session, *, model_id: str, limit: int = 50) -> list[ModelEvent]:
    """The model's latest replica decisions, newest first."""
    return list(
        session.scalars(
            select(ModelEvent)
            .where(ModelEvent.model_id == model_id)
            .order_by(ModelEvent.id.desc())
            .limit(limit)
        )
    )

"""The replica policy is fair and safe (issue 35): one pass of ``scheduler.replicas.scale`` at a
time, on real rows (SQLite and PostgreSQL), with real demand counted by a ``DemandMeter``
whose clock the test moves (no waiting for a window to pass).

- replicas count against the tenant's quotas (``max_workers``, ``max_placed_models``);
- one tenant's scale-out never takes another tenant's model off a worker;
- scale-in never drops a request in flight: a draining replica stays until it has none;
- the demand per replica the policy reads is what ``skytrain_model_demand_per_replica`` says.
"""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable

import pytest
from prometheus_client import REGISTRY
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Model, ModelEvent, ModelReplica, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.scheduler import garbage, replicas
from skytrain_backend.scheduler.demand import DemandMeter
from tests.fixtures.rows import add_model, add_ready_worker
from tests.fixtures.services import EMBEDDED_BACKEND

WINDOW_S = 10.0
POLICY = replicas.ScalePolicy(
    window_s=WINDOW_S, scale_out_in_flight=1.5, scale_in_in_flight=0.5, cooldown_s=0.0
)
# Far above the workers other tests leave in the database: only the tenant's quota counts.
MAX_WORKERS = 100_000


class Clock:
    def __init__(self) -> None:
        self.now = 1_000.0

    def __call__(self) -> float:
        return self.now


def _meter() -> tuple[DemandMeter, Clock]:
    clock = Clock()
    return DemandMeter(clock=clock), clock


def _limits(settings: Settings, **quota: int) -> Callable[[str], TenantLimits]:
    limits = dataclasses.replace(TenantLimits.defaults(settings), **quota)
    return lambda _tenant_id: limits


def _scale(
    session: Session,
    meter: DemandMeter,
    limits: Callable[[str], TenantLimits],
    *,
    policy: replicas.ScalePolicy = POLICY,
    max_workers: int = MAX_WORKERS,
    launch: Callable[[str], None] | None = None,
) -> None:
    """One pass of the replica policy over the database."""
    replicas.scale(
        session,
        demand=meter,
        policy=policy,
        limits=limits,
        max_workers=max_workers,
        launch=launch,
    )


def _base() -> str:
    return f"tests/replica-policy-{uuid.uuid4().hex[:8]}"


def _home(
    session: Session, *, base: str, tenant: str, worker: Worker, max_replicas: int = 3
) -> Model:
    model = add_model(session, f"m-{uuid.uuid4().hex[:6]}", base_model=base, tenant=tenant)
    model.worker_id = worker.id
    model.config = {**(model.config or {}), "max_replicas": max_replicas}
    model.last_active_at = utcnow()
    session.commit()
    return model


def _held_on(session: Session, model_id: str) -> dict[str, str]:
    """The model's replica rows: worker id -> status."""
    rows = session.scalars(select(ModelReplica).where(ModelReplica.model_id == model_id))
    return {row.worker_id: row.status for row in rows}


def _last_event(session: Session, model_id: str) -> ModelEvent:
    event = session.scalar(
        select(ModelEvent).where(ModelEvent.model_id == model_id).order_by(ModelEvent.id.desc())
    )
    assert event is not None
    return event


def _busy(meter: DemandMeter, clock: Clock, model_id: str, worker_id: str, count: int) -> None:
    """``count`` requests in flight on the worker for a whole window."""
    for _ in range(count):
        meter.begin(model_id, worker_id)
    clock.now += WINDOW_S


def test_replicas_count_against_the_tenants_quotas(
    db_sessions: sessionmaker[Session], settings: Settings
) -> None:
    """At its ``max_workers``, a tenant's replica goes only to a worker its models already
    occupy (never to a free one), and each replica is a placed model under
    ``max_placed_models``; a wait says which quota holds it."""
    base, tenant = _base(), f"quota-{uuid.uuid4().hex[:6]}"
    meter, clock = _meter()
    with db_sessions() as session:
        first, second = (add_ready_worker(session, base_model=base, max_models=1) for _ in "12")
        free = add_ready_worker(session, base_model=base, max_models=4)
        busy = _home(session, base=base, tenant=tenant, worker=first)
        _home(session, base=base, tenant=tenant, worker=second)
        _busy(meter, clock, busy.id, first.id, 4)  # 4 per replica, above 1.5

        _scale(session, meter, _limits(settings, max_workers=2, max_placed_models=10))
        # Read at once: the gauge is the process's, and the schedulers of other tests' control
        # planes in this process set it from their own databases at each of their passes.
        demand = REGISTRY.get_sample_value("skytrain_model_demand_per_replica", {"stat": "max"})
        assert _held_on(session, busy.id) == {}  # the free worker would be a third
        held = _last_event(session, busy.id)
        assert held.kind == "held" and "max_workers=2" in held.reason, held.reason
        assert demand == 4.0
        # The same figure, on the model's row for readers of the database (`models show`).
        session.refresh(busy)
        assert busy.demand_per_replica == 4.0

        # Room on a worker the tenant already occupies: the replica goes there, within
        # max_workers, unless it would be one placed model more than max_placed_models.
        session.get_one(Worker, second.id).capacity = {"max_models": 2}
        session.commit()
        _scale(session, meter, _limits(settings, max_workers=2, max_placed_models=2))
        assert _held_on(session, busy.id) == {}
        held = _last_event(session, busy.id)
        assert held.kind == "held" and "max_placed_models=2" in held.reason, held.reason
        _scale(session, meter, _limits(settings, max_workers=2, max_placed_models=3))
        assert _held_on(session, busy.id) == {second.id: "serving"}
        assert free.id not in _held_on(session, busy.id)

        # A model taken off its worker has no demand per replica.
        busy.worker_id = None
        session.commit()
        _scale(session, meter, _limits(settings, max_workers=2, max_placed_models=3))
        session.refresh(busy)
        assert busy.demand_per_replica is None


def test_one_tenants_scale_out_never_evicts_another_tenants_model(
    db_sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Tenant A's model needs a replica; the only other worker of its base model is full
    with tenant B's active model. B's model stays where it is: A's replica waits for a worker
    launched for it, or, at the control plane's max_workers, waits saying so."""
    base = _base()
    meter, clock = _meter()
    with db_sessions() as session:
        mine, theirs = (add_ready_worker(session, base_model=base, max_models=1) for _ in "ab")
        wanting = _home(session, base=base, tenant=f"a-{uuid.uuid4().hex[:6]}", worker=mine)
        other = _home(session, base=base, tenant=f"b-{uuid.uuid4().hex[:6]}", worker=theirs)
        _busy(meter, clock, wanting.id, mine.id, 4)
        launched: list[str] = []
        limits = _limits(settings, max_workers=3)
        _scale(session, meter, limits, launch=launched.append)
        # (Other tests' models in this database may want workers of their own bases.)
        assert [launch for launch in launched if launch == base] == [base]
        assert _last_event(session, wanting.id).kind == "launch"
        session.expire_all()
        assert session.get_one(Model, other.id).worker_id == theirs.id
        assert _held_on(session, wanting.id) == {} and _held_on(session, other.id) == {}

        # At the control plane's max_workers nothing is launched, and still nothing is taken
        # from B.
        launched.clear()
        _scale(session, meter, limits, max_workers=1, launch=launched.append)
        assert base not in launched
        held = _last_event(session, wanting.id)
        assert held.kind == "held" and "max_workers=1" in held.reason, held.reason
        session.expire_all()
        assert session.get_one(Model, other.id).worker_id == theirs.id
        assert _held_on(session, wanting.id) == {}


def test_scale_in_keeps_a_draining_replica_until_its_requests_in_flight_are_answered(
    db_sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Low demand drains the newest replica: it gets no new request (the gateway routes to
    ``serving`` replicas only) and its worker keeps the model loaded while a request is in
    flight on it; only once that request is answered is the replica removed."""
    base = _base()
    meter, clock = _meter()
    with db_sessions() as session:
        home, spare = (add_ready_worker(session, base_model=base, max_models=2) for _ in "12")
        model = _home(session, base=base, tenant=f"drain-{uuid.uuid4().hex[:6]}", worker=home)
        session.add(ModelReplica(model_id=model.id, worker_id=spare.id, status="serving"))
        session.commit()
        answered = meter.begin(model.id, spare.id)  # one request, streaming on the replica
        clock.now += WINDOW_S  # 1 in flight over 2 replicas: 1 per replica over one would be
        policy = dataclasses.replace(POLICY, scale_in_in_flight=2.0)  # below 2
        limits = _limits(settings, max_workers=3)
        _scale(session, meter, limits, policy=policy)
        assert _held_on(session, model.id) == {spare.id: "draining"}
        assert replicas.replica_workers(session, model_id=model.id, status="serving") == []
        assert _last_event(session, model.id).kind == "scale_in"
        clock.now += 1.0
        _scale(
            session, meter, limits, policy=policy
        )  # the request is still in flight: the replica stays, draining
        assert _held_on(session, model.id) == {spare.id: "draining"}
        answered()
        _scale(session, meter, limits, policy=policy)
        assert _held_on(session, model.id) == {}
        removed = _last_event(session, model.id)
        assert removed.kind == "replica_removed" and removed.worker_id == spare.id
        assert "no request in flight" in removed.reason


@pytest.mark.parametrize(
    "settings",
    [EMBEDDED_BACKEND, pytest.param("postgres-local", marks=pytest.mark.postgres)],
    indirect=True,
)
def test_pruning_keeps_each_models_newest_events_and_deletes_the_older(
    db_sessions: sessionmaker[Session], settings: Settings
) -> None:
    """Every PATCH and scale decision added a ``model_events`` row for ever; the scheduler's
    sweep (``garbage.prune_model_events``) now keeps the newest ``model_events_kept`` of each
    model. A model with fewer keeps all of its own, however many another model has."""
    base, tenant = _base(), f"events-{uuid.uuid4().hex[:6]}"
    with db_sessions() as session:
        worker = add_ready_worker(session, base_model=base)
        busy = _home(session, base=base, tenant=tenant, worker=worker)
        quiet = _home(session, base=base, tenant=tenant, worker=worker)
        for bound in range(1, 13):
            replicas.set_bounds(
                session,
                model=busy,
                min_replicas=None,
                max_replicas=bound % 3 + 1,
                limits=_limits(settings, max_workers=3)(tenant),
            )
        for reason in ("first", "second"):
            replicas.record(session, model=quiet, kind="held", reason=reason, replicas=1)
        session.commit()
        newest = [event.id for event in replicas.events(session, model_id=busy.id, limit=5)]

        garbage.prune_model_events(session, keep=5)

        kept = session.scalars(select(ModelEvent.id).where(ModelEvent.model_id == busy.id))
        assert sorted(kept) == sorted(newest)
        assert [e.reason for e in replicas.events(session, model_id=quiet.id)] == [
            "second",
            "first",
        ]

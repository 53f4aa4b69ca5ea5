"""Replicas are the cheapest slots: a model waiting for a slot on full workers takes a
replica's (it drains first), no replica is added while a model waits for one, a replica is a
placed model for ``max_placed_models``, and a model whose home went away is served from its
replica even at that quota; replicas above a lowered quota drain. Scheduler passes on real
rows; SQLite (the same queries run on
PostgreSQL in the e2e replica tests)."""

from __future__ import annotations

import dataclasses
import uuid
from collections.abc import Callable

from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Model, ModelEvent, ModelReplica, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.scheduler import placement, replicas
from skytrain_backend.scheduler.demand import DemandMeter
from tests.fixtures.rows import add_model, add_ready_worker

IDLE_S = 600.0
POLICY = replicas.ScalePolicy(
    window_s=60, scale_out_in_flight=2, scale_in_in_flight=0.5, cooldown_s=0
)
LIMITS = TenantLimits.defaults(Settings(tenant_limits={"max_placed_models": 8, "max_workers": 8}))


def _pass(session: Session, limits: TenantLimits = LIMITS) -> None:
    """One scheduler pass's placement and replica steps, as ``Scheduler.run_pass`` runs them
    (no provider: nothing is launched)."""
    quotas: Callable[[str], TenantLimits] = lambda _tenant_id: limits  # noqa: E731
    placement.place_models(
        session, idle_timeout_s=IDLE_S, max_workers=8, launch=None, limits=quotas
    )
    replicas.scale(
        session,
        demand=DemandMeter(),
        policy=POLICY,
        limits=quotas,
        max_workers=8,
        launch=None,
        waiting=placement.bases_waiting_for_a_slot(session, idle_timeout_s=IDLE_S, limits=quotas),
    )
    session.expire_all()


def _model(session: Session, name: str, *, base: str, tenant: str, min_replicas: int = 1) -> str:
    model = add_model(session, name, base_model=base, tenant=tenant)
    model.config = {**(model.config or {}), "min_replicas": min_replicas, "max_replicas": 4}
    model.last_active_at = utcnow()
    session.commit()
    return model.id


def _slots(session: Session, model_id: str) -> list[str]:
    """The workers serving the model: its home, then its replicas still serving."""
    home = session.get_one(Model, model_id).worker_id
    return ([home] if home else []) + replicas.replica_workers(
        session, model_id=model_id, status="serving"
    )


def test_a_waiting_model_takes_a_replicas_slot_and_no_replica_comes_back(
    db_sessions: sessionmaker[Session],
) -> None:
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    with db_sessions() as session:
        workers = [add_ready_worker(session, base_model=base, max_models=1) for _ in range(2)]
        alice = _model(session, "a", base=base, tenant="fair-alice", min_replicas=2)
        _pass(session)
        assert sorted(_slots(session, alice)) == sorted(w.id for w in workers)

        bob = _model(session, "b", base=base, tenant="fair-bob")
        _pass(session)  # the replica drains; nothing in flight on it: it goes
        _pass(session)  # bob's model takes the slot; alice's replica is not added again
        _pass(session)
        assert len(_slots(session, alice)) == 1 and len(_slots(session, bob)) == 1
        kinds = session.scalars(
            select(ModelEvent.kind).where(ModelEvent.model_id == alice).order_by(ModelEvent.id)
        ).all()
        assert "scale_in" in kinds and kinds[-1] == "held"
        held = session.scalars(
            select(ModelEvent.reason).where(ModelEvent.model_id == alice, ModelEvent.kind == "held")
        ).all()
        # min_replicas wants a second worker, and says why it has none: bob's model waiting,
        # then no room (one run under load also said the tenant's max_workers, a cause of its
        # own); each cause once, not once per pass.
        waits = [reason for reason in held if "a model waits for a slot" in reason]
        assert len(waits) == 1 and held.index(waits[0]) < len(held) - 1
        assert all("no worker" in reason for reason in held if reason not in waits)
        assert len(held) == len(set(held)) <= 3


def test_a_replica_is_a_placed_model_and_a_lost_home_is_its_replicas_at_the_quota(
    db_sessions: sessionmaker[Session],
) -> None:
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    quota = dataclasses.replace(LIMITS, max_placed_models=2)
    with db_sessions() as session:
        workers = [add_ready_worker(session, base_model=base, max_models=1).id for _ in range(3)]
        first = _model(session, "m", base=base, tenant="fair-carol", min_replicas=3)
        _pass(session, quota)
        _pass(session, quota)
        # Its home and one replica: the third would be a third placed model.
        assert len(_slots(session, first)) == 2
        held = session.scalars(
            select(ModelEvent.reason).where(ModelEvent.model_id == first, ModelEvent.kind == "held")
        ).all()
        assert held and "max_placed_models=2" in held[-1]

        # Its home worker goes away: the replica serves on as its home, though the tenant is
        # at its quota meanwhile (the replica counted).
        (replica,) = replicas.replica_workers(session, model_id=first)
        home = session.get_one(Model, first).worker_id
        assert home is not None
        session.get_one(Worker, home).status = "lost"
        session.get_one(Model, first).worker_id = None
        session.commit()
        _pass(session, quota)
        assert session.get_one(Model, first).worker_id == replica
        # And the quota's second placed model is a replica on the worker left.
        (spare,) = set(workers) - {home, replica}
        assert replicas.replica_workers(session, model_id=first) == [spare]


def test_replicas_above_a_lowered_quota_drain(db_sessions: sessionmaker[Session]) -> None:
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    with db_sessions() as session:
        for _ in range(3):
            add_ready_worker(session, base_model=base, max_models=1)
        model = _model(session, "m", base=base, tenant="fair-dave", min_replicas=3)
        for _ in range(3):
            _pass(session)
        assert len(_slots(session, model)) == 3
        # The operator lowers the tenant's max_workers to 2: the newest replica drains (and,
        # nothing in flight on it, goes), and none is added back.
        lowered = dataclasses.replace(LIMITS, max_workers=2)
        for _ in range(3):
            _pass(session, lowered)
        assert len(_slots(session, model)) == 2
        assert replicas.replica_workers(session, model_id=model, status="draining") == []


def test_a_draining_replica_whose_home_went_away_still_goes(
    db_sessions: sessionmaker[Session],
) -> None:
    """Its model has no home (no pass of its own), yet the replica drains out: its slot and
    fair share's turn on those workers are not held for ever."""
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    with db_sessions() as session:
        for _ in range(2):
            add_ready_worker(session, base_model=base, max_models=1)
        alice = _model(session, "a", base=base, tenant="fair-erin", min_replicas=2)
        _pass(session)
        (replica,) = replicas.replica_workers(session, model_id=alice)
        session.execute(
            update(ModelReplica)
            .where(ModelReplica.model_id == alice)
            .values(status="draining")  # a scale-in, its request still in flight
        )
        home = session.get_one(Worker, session.get_one(Model, alice).worker_id)
        placement.worker_gone(session, worker=home, status="lost", reason="spot preemption")
        session.commit()
        bob = _model(session, "b", base=base, tenant="fair-frank")
        for _ in range(3):
            _pass(session)
        assert replicas.replica_workers(session, model_id=alice, status="draining") == []
        placed = {session.get_one(Model, m).worker_id for m in (alice, bob)}
        assert replica in placed


def test_a_model_no_worker_could_take_holds_no_replica_back(
    db_sessions: sessionmaker[Session],
) -> None:
    """A model of a rank the workers do not load waits for a worker of its own: the others'
    replicas still go to the room those workers have."""
    base = f"tests/fair-{uuid.uuid4().hex[:8]}"
    with db_sessions() as session:
        for _ in range(2):
            worker = add_ready_worker(session, base_model=base, max_models=4)
            worker.capacity = {**(worker.capacity or {}), "max_lora_rank": 16}
        session.commit()
        alice = _model(session, "a", base=base, tenant="fair-gina", min_replicas=2)
        carol = add_model(session, "c", base_model=base, tenant="fair-hank")
        carol.config = {**(carol.config or {}), "lora_rank": 64}
        carol.last_active_at = utcnow()
        session.commit()
        for _ in range(3):
            _pass(session)
        assert session.get_one(Model, carol.id).worker_id is None
        assert len(_slots(session, alice)) == 2

"""At ``max_workers``, an idle worker makes room for a model that waits for a worker.

A model whose base model no live worker serves needs a launch; when the control plane already
runs ``SKYTRAIN_MAX_WORKERS`` workers, a worker with nothing to do (no active model, no job) is
stopped at once rather than after ``SKYTRAIN_WORKER_IDLE_TIMEOUT_S``, and the next pass
launches the waiting model's worker. Workers that serve an active model, run a job or are
still starting are never stopped for it, nor is anything stopped because a tenant is at its
own ``max_workers`` quota.

The real scheduler, placement and worker rows on SQLite and PostgreSQL; the clusters live in
``FakeSky``, the fake cloud at the SkyPilot SDK boundary (tests/provision/fake_sky.py).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from datetime import timedelta

import pytest
import sky
from sqlalchemy import select, update
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerRequest,
    TinkerRun,
    TinkerSession,
    TrainingJob,
    Worker,
    utcnow,
)
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.errors import LeaseLost
from skytrain_backend.protocol.tinker_api import LoraConfig
from skytrain_backend.protocol.tinker_ops import CreationOperation, CreationParams
from skytrain_backend.provision.skypilot import SkyPilotProvider
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.scheduler.serving import serving_status
from skytrain_backend.scheduler.tinker import runs as tinker_runs
from skytrain_backend.scheduler.tinker import worker_ops as tinker_worker
from tests.fixtures.rows import add_model, add_rl_job
from tests.fixtures.services import MakeSettings
from tests.provision.fake_sky import ENDPOINT_HOST, FakeSky

BASE_A = "Qwen/Qwen2.5-1.5B-Instruct"
BASE_B = "Qwen/Qwen2.5-7B-Instruct"
LONG_AGO = timedelta(hours=2)
# Workers idle less than SKYTRAIN_WORKER_IDLE_TIMEOUT_S (30 min): only making room stops them.
WORKER_IDLE = timedelta(minutes=10)


@dataclass
class Plane:
    settings: Settings
    sessions: sessionmaker[Session]
    fake: FakeSky
    scheduler: Scheduler

    def tick(self) -> None:
        self.scheduler.tick()
        self.fake.settle()

    def status(self, worker_id: str) -> str:
        with self.sessions() as session:
            return session.get_one(Worker, worker_id).status

    def launched(self) -> list[str]:
        return [call.task.envs["SKYTRAIN_WORKER_BASE_MODEL"] for call in self.fake.launches]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def make_plane(
    request: pytest.FixtureRequest, make_settings: MakeSettings
) -> Iterator[Callable[[int], Plane]]:
    """Control planes (their scheduler and the skypilot provider) on one database, each running
    at most ``max_workers`` workers."""
    database_url = make_settings(database=request.param).storage.resolved_database_url
    engine = create_db_engine(database_url)
    fakes: list[FakeSky] = []

    def make(max_workers: int) -> Plane:
        settings = make_settings(
            storage={"database_url": database_url},
            scheduler={
                "provider": "skypilot",
                "max_workers": max_workers,
                "worker_idle_timeout_s": 1800,
            },
            server={"public_url": "https://skytrain.example.com"},
            skypilot={"status_interval_s": 0},
        )
        fake = FakeSky()
        fakes.append(fake)
        sessions = session_factory(engine)
        scheduler = Scheduler(
            settings=settings,
            sessions=sessions,
            provider=SkyPilotProvider(settings, sky_api=fake),
        )
        return Plane(settings, sessions, fake, scheduler)

    yield make
    for fake in fakes:
        fake.launch_gate.set()
        fake.settle()
    engine.dispose()


def _model(
    plane: Plane,
    name: str,
    *,
    base_model: str,
    tenant: str = "acme",
    idle: bool = False,
    worker_id: str | None = None,
) -> str:
    """A model of ``tenant``, used just now (or long ago: ``idle``), placed on ``worker_id``."""
    with plane.sessions() as session:
        model = add_model(session, name, base_model=base_model, tenant=tenant)
        model.last_active_at = utcnow() - (LONG_AGO if idle else timedelta(0))
        model.worker_id = worker_id
        session.commit()
        return model.id


def _worker(
    plane: Plane,
    base_model: str,
    *,
    idle_for: timedelta = WORKER_IDLE,
    provider: str = "skypilot",
) -> str:
    """A registered worker with nothing placed on it, its last work ``idle_for`` ago; its
    cluster up in the fake cloud when the provider started it."""
    with plane.sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider=provider, base_model=base_model, max_models=8
        )
        if provider == "skypilot":
            worker.cluster_name = f"skytrain-{worker.id}"
            plane.fake.add_cluster(worker.cluster_name, sky.ClusterStatus.UP)
        session.commit()
        worker_rows.register(
            session,
            worker=worker,
            base_model=base_model,
            served_model_name=base_model,
            engine_endpoint=f"https://{ENDPOINT_HOST}:8100",  # what SkyPilot reports
            engine_secret=worker.engine_secret,
            engine_certificate="",
            capacity={"max_models": 8},
            hardware={},
            unreachable=None,
        )
        worker.last_active_at = utcnow() - idle_for
        session.commit()
        return worker.id


def _serving(plane: Plane, model_id: str) -> tuple[str, str]:
    with plane.sessions() as session:
        status = serving_status(
            session,
            model=session.get_one(Model, model_id),
            limits=tenants.TenantLimits.defaults(plane.settings),
            max_workers=plane.settings.scheduler.max_workers,
        )
        return status.state, status.message


def test_an_idle_worker_is_stopped_to_make_room_for_a_model_that_waits(
    make_plane: Callable[[int], Plane],
) -> None:
    """The gap: at max_workers=1 a worker of another base model with nothing to do held a
    new model's launch back for up to SKYTRAIN_WORKER_IDLE_TIMEOUT_S (30 min)."""
    plane = make_plane(1)
    # Its worker registered a moment ago, so the idle timeout is far from stopping it.
    idle_worker = _worker(plane, BASE_A, idle_for=timedelta(seconds=5))
    _model(plane, "earlier", base_model=BASE_A, idle=True, worker_id=idle_worker)
    waiting = _model(plane, "new", base_model=BASE_B)

    plane.tick()
    assert plane.status(idle_worker) == "stopped"
    assert plane.fake.downs == [f"skytrain-{idle_worker}"]
    with plane.sessions() as session:
        reason = session.get_one(Worker, idle_worker).status_message or ""
    assert "make room" in reason and "max_workers=1" in reason

    plane.tick()  # the count allows a launch now
    assert plane.launched() == [BASE_B]
    assert _serving(plane, waiting)[0] == "provisioning"


@pytest.mark.parametrize("busy", ["active model", "running job", "starting"])
def test_a_worker_with_work_is_not_stopped_and_the_model_says_it_waits_for_max_workers(
    make_plane: Callable[[int], Plane], busy: str
) -> None:
    plane = make_plane(1)
    worker_id = _worker(plane, BASE_A)
    if busy == "active model":
        _model(plane, "in-use", base_model=BASE_A, worker_id=worker_id)
    elif busy == "running job":
        # Unused for two hours, but training: a job (and a Tinker run's) keeps its model active.
        trained = _model(plane, "training", base_model=BASE_A, idle=True, worker_id=worker_id)
        with plane.sessions() as session:
            add_rl_job(session, trained, job_id="job-1")
            session.commit()
            worker = session.get_one(Worker, worker_id)
            assert queue.lease_job(session, worker=worker, lease_s=60) is not None
    else:
        with plane.sessions() as session:
            session.get_one(Worker, worker_id).status = "starting"
            session.commit()
    waiting = _model(plane, "new", base_model=BASE_B)

    for _ in range(2):
        plane.tick()
    assert plane.status(worker_id) == ("starting" if busy == "starting" else "ready")
    assert (plane.fake.downs, plane.launched()) == ([], [])
    state, message = _serving(plane, waiting)
    assert state == "waiting"
    assert "max_workers=1" in message and "being stopped" not in message


def test_the_worker_idle_longest_is_stopped_and_no_more_than_the_launches_need(
    make_plane: Callable[[int], Plane],
) -> None:
    plane = make_plane(2)
    longest = _worker(plane, BASE_A, idle_for=timedelta(minutes=20))
    shorter = _worker(plane, BASE_A, idle_for=timedelta(minutes=1))
    _model(plane, "new", base_model=BASE_B)
    _model(plane, "new-too", base_model=BASE_B)  # same base model: one launch serves both

    plane.tick()
    assert (plane.status(longest), plane.status(shorter)) == ("stopped", "ready")
    plane.tick()
    assert plane.launched() == [BASE_B]
    assert plane.status(shorter) == "ready"


def test_no_worker_is_stopped_when_that_would_not_let_the_launch_go(
    make_plane: Callable[[int], Plane],
) -> None:
    """Above the limit (the operator lowered it, or workers joined by hand), stopping the
    one idle worker would still leave the count at max_workers: it is left to its timeout."""
    plane = make_plane(1)
    busy = _worker(plane, BASE_A)
    _model(plane, "in-use", base_model=BASE_A, worker_id=busy)
    idle = _worker(plane, BASE_A)
    _model(plane, "new", base_model=BASE_B)

    for _ in range(2):
        plane.tick()
    assert (plane.status(busy), plane.status(idle)) == ("ready", "ready")
    assert (plane.fake.downs, plane.launched()) == ([], [])


def test_a_worker_started_by_hand_is_asked_to_drain_and_counts_until_it_has_gone(
    make_plane: Callable[[int], Plane],
) -> None:
    """A joined worker cannot be stopped by the control plane: it is asked to drain and
    exits at its next heartbeat. Meanwhile it still counts in max_workers, and no second
    worker is stopped for the same launch."""
    plane = make_plane(2)
    joined = _worker(plane, BASE_A, idle_for=timedelta(minutes=20), provider="manual")
    other = _worker(plane, BASE_A, idle_for=timedelta(minutes=1))
    waiting = _model(plane, "new", base_model=BASE_B)

    plane.tick()
    assert plane.status(joined) == "draining"
    state, message = _serving(plane, waiting)
    assert state == "waiting"
    assert "max_workers=2" in message and "being stopped to make room" in message
    plane.tick()
    assert (plane.status(other), plane.launched()) == ("ready", [])

    with plane.sessions() as session:  # its process exited: no heartbeat since
        session.get_one(Worker, joined).last_heartbeat_at = utcnow() - LONG_AGO
        session.commit()
    plane.tick()
    assert plane.status(joined) == "stopped"
    plane.tick()
    assert plane.launched() == [BASE_B]
    assert plane.status(other) == "ready"


def test_a_tenant_at_its_own_worker_quota_does_not_stop_other_workers(
    make_plane: Callable[[int], Plane],
) -> None:
    """max_workers per tenant is the tenant's own limit: its model waits for one of the
    tenant's workers, and no one else's idle worker is stopped for it."""
    plane = make_plane(2)
    with plane.sessions() as session:
        api_keys.get_or_create_tenant(session, name="capped")
        tenants.set_limits(session, tenant_name="capped", values={"max_workers": 1}, reset=[])
    busy = _worker(plane, BASE_A)
    _model(plane, "in-use", base_model=BASE_A, tenant="capped", worker_id=busy)
    idle = _worker(plane, BASE_A)
    capped = _model(plane, "new", base_model=BASE_B, tenant="capped")

    for _ in range(2):
        plane.tick()
    assert (plane.status(busy), plane.status(idle)) == ("ready", "ready")
    assert (plane.fake.downs, plane.launched()) == ([], [])
    with plane.sessions() as session:
        model = session.get_one(Model, capped)
        quota = tenants.limits_of(session.get_one(Tenant, model.tenant_id), plane.settings)
        status = serving_status(session, model=model, limits=quota)
    assert status.over_quota and "max_workers=1" in status.message

    # Another tenant's model of the same base model, held back by max_workers alone, does
    # make room.
    _model(plane, "new", base_model=BASE_B, tenant="other")
    plane.tick()
    assert (plane.status(busy), plane.status(idle)) == ("ready", "stopped")


def _pinned_worker(plane: Plane, *, models: int) -> tuple[str, list[str]]:
    """A full worker of BASE_A: ``models`` models of tenant "pinner", each touched just now
    (the one made first touched least recently), as a tenant keeps them all active by sending
    each a 1-token request every 20 s."""
    worker_id = _worker(plane, BASE_A)
    with plane.sessions() as session:
        worker = session.get_one(Worker, worker_id)
        worker.capacity = {"max_models": models}
        session.commit()
    pinned = [
        _model(plane, f"pinned-{index}", base_model=BASE_A, tenant="pinner", worker_id=worker_id)
        for index in range(models)
    ]
    with plane.sessions() as session:
        for age, model_id in enumerate(reversed(pinned)):
            session.get_one(Model, model_id).last_active_at = utcnow() - timedelta(seconds=age)
        session.commit()
    return worker_id, pinned


def _worker_of(plane: Plane, model_id: str) -> str | None:
    with plane.sessions() as session:
        return session.get_one(Model, model_id).worker_id


def test_a_tenant_pinning_every_slot_gives_its_least_recently_used_one_up(
    make_plane: Callable[[int], Plane],
) -> None:
    """The gap: a tenant touching its 8 models every 20 s kept them all placed, and another
    tenant's model got 503 on every try, told that a new worker was needed (none was coming:
    max_workers=1). Now the waiting model takes the slot of the pinning tenant's least
    recently used model at the next pass, and the models stay where they are after."""
    plane = make_plane(1)
    worker_id, pinned = _pinned_worker(plane, models=8)
    bobs = _model(plane, "bobs", base_model=BASE_A, tenant="bob")

    state, message = _serving(plane, bobs)
    assert state == "waiting"
    assert "fair share" in message and "next pass" in message
    assert "max_workers" not in message and "starts" not in message
    with plane.sessions() as session:
        status = serving_status(session, model=session.get_one(Model, bobs))
    assert status.retry_after_s <= 5

    plane.tick()
    assert _worker_of(plane, bobs) == worker_id
    assert _worker_of(plane, pinned[0]) is None
    assert all(_worker_of(plane, model_id) == worker_id for model_id in pinned[1:])
    assert (plane.fake.downs, plane.launched()) == ([], [])

    # The pinner's model waits, told why: its tenant holds its fair share already.
    state, message = _serving(plane, pinned[0])
    assert state == "waiting"
    assert "fair share" in message and "yours holds 7 of 8" in message
    assert "max_workers" not in message
    for _ in range(2):
        plane.tick()
    assert _worker_of(plane, bobs) == worker_id
    assert _worker_of(plane, pinned[0]) is None


def test_slots_are_shared_out_evenly_and_a_training_model_keeps_its_slot(
    make_plane: Callable[[int], Plane],
) -> None:
    """Four waiting models of one tenant take slots until both tenants hold as many; a
    model whose job runs is never the one taken off."""
    plane = make_plane(1)
    worker_id, pinned = _pinned_worker(plane, models=6)
    with plane.sessions() as session:
        add_rl_job(session, pinned[0], job_id="job-1")
        session.commit()
        worker = session.get_one(Worker, worker_id)
        assert queue.lease_job(session, worker=worker, lease_s=60) is not None
    bobs = [_model(plane, f"bobs-{index}", base_model=BASE_A, tenant="bob") for index in range(4)]

    for _ in range(5):
        plane.tick()
    placed = {model_id for model_id in pinned + bobs if _worker_of(plane, model_id) == worker_id}
    assert len(placed & set(bobs)) == 3 and len(placed & set(pinned)) == 3
    assert pinned[0] in placed  # training: it stays, the next least recently used go
    assert set(pinned[1:4]).isdisjoint(placed)


@dataclass(frozen=True)
class Run:
    id: str
    tenant_id: str
    model_id: str
    job_id: str


def _tinker_runs(plane: Plane, *, worker_id: str, count: int) -> list[Run]:
    """``count`` Tinker training runs of tenant "pinner" on the worker (as many slots), each
    created (operation 0 done) and leased by the worker, its session heartbeating: their jobs
    run for as long as the session lives."""
    with plane.sessions() as session:
        session.get_one(Worker, worker_id).capacity = {"max_models": count}
        owner = api_keys.get_or_create_tenant(session, name="pinner")
        row = TinkerSession(tenant_id=owner.id, sdk_version="test")
        session.add(row)
        session.commit()
        for seq in range(count):
            new = tinker_runs.NewRun(
                session_id=row.id,
                model_seq_id=seq,
                base_model=BASE_A,
                model_config=tinker_runs.lora_model_config(rank=8, train_attn=True, train_mlp=True),
                lora=LoraConfig(rank=8),
                user_metadata={},
                creation=CreationOperation(kind="create_model", params=CreationParams(seed=seq)),
            )
            tinker_runs.create_run(
                session, new, tenant=owner, tinker_session=row, max_attempts=3, max_models=100
            )
        runs = [
            Run(run.id, run.tenant_id, run.model_id, run.job_id)
            for run in session.scalars(
                select(TinkerRun).where(TinkerRun.session_id == row.id).order_by(TinkerRun.id)
            )
        ]
        for run in runs:
            session.get_one(Model, run.model_id).worker_id = worker_id
        session.execute(
            update(TinkerRequest)
            .where(TinkerRequest.run_id.in_([run.id for run in runs]))
            .values(status="succeeded", finished_at=utcnow())
        )
        session.commit()
        for _ in runs:
            worker = session.get_one(Worker, worker_id)
            assert tinker_worker.lease_run(session, worker=worker, lease_s=600) is not None
        return runs


def test_an_idle_tinker_run_gives_its_slot_up_and_resumes_later(
    make_plane: Callable[[int], Plane],
) -> None:
    """The gap: a Tinker run's job runs for as long as its session heartbeats, and a model
    with a running job never lost its slot, so a tenant holding idle training runs kept their
    slots for ever. Now a run with no operation queued or running gives its slot up like an
    idle model (its job taken back from its worker, not counted as a failure, its state
    rebuilt by the next lease); a run with an operation in flight keeps it, even if it is
    the least recently used."""
    plane = make_plane(1)
    worker_id = _worker(plane, BASE_A)
    busy, idle = _tinker_runs(plane, worker_id=worker_id, count=2)
    with plane.sessions() as session:
        # The busy run is the least recently used, but its optimizer step waits for the worker.
        session.get_one(TinkerRun, busy.id).last_request_at = utcnow() - LONG_AGO
        session.add(
            TinkerRequest(tenant_id=busy.tenant_id, run_id=busy.id, seq_id=1, kind="optim_step")
        )
        session.commit()
    bobs = _model(plane, "bobs", base_model=BASE_A, tenant="bob")
    state, message = _serving(plane, bobs)
    assert state == "waiting" and "fair share" in message and "next pass" in message

    plane.tick()
    assert _worker_of(plane, bobs) == worker_id
    assert (_worker_of(plane, busy.model_id), _worker_of(plane, idle.model_id)) == (worker_id, None)
    with plane.sessions() as session:
        worker = session.get_one(Worker, worker_id)
        job = session.get_one(TrainingJob, idle.job_id)
        assert (job.status, job.worker_id, job.attempts, job.preemptions) == ("queued", None, 1, 1)
        with pytest.raises(LeaseLost):  # the worker lets the run's trainer go
            tinker_worker.leased_run(session, worker=worker, job_id=idle.job_id, attempt=1)
        session.rollback()
        assert session.get_one(TrainingJob, busy.job_id).status == "running"
    state, message = _serving(plane, idle.model_id)
    assert state == "waiting" and "yours holds 1 of 2" in message
    plane.tick()
    assert _worker_of(plane, idle.model_id) is None  # one slot each: no slot moves back

    # Bob's model goes idle: the run takes the slot again, and the worker that leases it
    # rebuilds its state from its creation (nothing to replay), its next operation 1.
    with plane.sessions() as session:
        session.get_one(Model, bobs).last_active_at = utcnow() - LONG_AGO
        session.commit()
    plane.tick()
    assert _worker_of(plane, idle.model_id) == worker_id
    with plane.sessions() as session:
        leased = tinker_worker.lease_run(
            session, worker=session.get_one(Worker, worker_id), lease_s=600
        )
        assert leased is not None
        assert (leased.run_id, leased.attempt) == (idle.id, 2)
        assert (leased.plan.replay, leased.plan.next_seq) == ([], 1)


# A pass that waited for the row instead would wait on this test's own session for ever.
@pytest.mark.timeout(120)
def test_a_tinker_run_whose_worker_holds_its_job_keeps_its_slot(
    make_plane: Callable[[int], Plane],
) -> None:
    """The worker locks a run's job row for each call it makes for the run (the next
    operation, a result, a renewal): while it holds it, the run is not taken off (its job row
    is skipped, not waited for), and the next pass takes the slot once it is let go."""
    plane = make_plane(1)
    if plane.settings.storage.resolved_database_url.startswith("sqlite"):
        pytest.skip("SQLite has no row locks: its writers take turns")
    worker_id = _worker(plane, BASE_A)
    runs = _tinker_runs(plane, worker_id=worker_id, count=2)
    bobs = _model(plane, "bobs", base_model=BASE_A, tenant="bob")
    with plane.sessions() as held:
        for run in runs:  # as queue.leased_job locks them
            held.scalar(select(TrainingJob).where(TrainingJob.id == run.job_id).with_for_update())
        plane.tick()
        assert _worker_of(plane, bobs) is None
        assert all(_worker_of(plane, run.model_id) == worker_id for run in runs)
    plane.tick()
    assert _worker_of(plane, bobs) == worker_id

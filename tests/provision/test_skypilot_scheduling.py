"""The skypilot provider driven by the real scheduler, on SQLite and PostgreSQL.

Launch on demand, reconciliation in both directions, scale-in, failures on the model's serving
status, and preemption (lost worker, job retried elsewhere). The scheduler, placement, the job
queue and the worker rows are skytrain's own code; the clusters live in ``FakeSky``, the fake
cloud at the SkyPilot SDK boundary (fake_sky.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import sky
from sky import exceptions
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend import tls
from skytrain_backend.config import Settings
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, TrainingJob, Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.provision.skypilot import SkyPilotProvider
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.scheduler.serving import serving_status
from tests.fixtures.rows import add_active_model, add_rl_job
from tests.fixtures.services import MakeSettings
from tests.provision.fake_sky import ENDPOINT_HOST, FakeSky

BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
SKY_ENDPOINT = f"https://{ENDPOINT_HOST}:8100"
# The address a worker's registration came from (behind the cloud's NAT, say).
REGISTERED_FROM = "https://198.51.100.1:8100"
CERTIFICATE, _ = tls.self_signed_certificate(["127.0.0.1"])


@dataclass
class ControlPlane:
    settings: Settings
    sessions: sessionmaker[Session]
    fake: FakeSky
    scheduler: Scheduler

    def restart(self) -> None:
        """A new control plane process: a fresh provider that launched nothing yet."""
        provider = SkyPilotProvider(self.settings, sky_api=self.fake)
        self.scheduler = Scheduler(
            settings=self.settings, sessions=self.sessions, provider=provider
        )

    def tick(self) -> None:
        self.scheduler.tick()

    def workers(self) -> list[Worker]:
        with self.sessions() as session:
            return worker_rows.list_workers(session, include_ended=True)


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def control_plane(
    request: pytest.FixtureRequest, make_settings: MakeSettings
) -> Iterator[ControlPlane]:
    settings = make_settings(
        database=request.param,
        scheduler={"provider": "skypilot", "worker_idle_timeout_s": 600},
        server={"public_url": "https://skytrain.example.com"},
        skypilot={"status_interval_s": 0},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    sessions = session_factory(engine)
    fake = FakeSky()
    plane = ControlPlane(settings, sessions, fake, scheduler=None)  # type: ignore[arg-type]
    plane.restart()
    yield plane
    fake.launch_gate.set()
    fake.settle()
    engine.dispose()


def _active_model(plane: ControlPlane, name: str = "agent") -> str:
    return add_active_model(plane.sessions, name, base_model=BASE_MODEL)


def _register(plane: ControlPlane, worker_id: str) -> None:
    """What the worker's own `POST /v1/worker/register` records when the control plane reached
    its front door: at SkyPilot's endpoint once the provider knows it, else at the address the
    registration came from."""
    with plane.sessions() as session:
        worker = session.get_one(Worker, worker_id)
        worker_rows.register(
            session,
            worker=worker,
            base_model=BASE_MODEL,
            served_model_name=BASE_MODEL,
            engine_endpoint=worker.engine_endpoint or REGISTERED_FROM,
            engine_secret=worker.engine_secret,
            engine_certificate=CERTIFICATE,
            capacity={"max_models": 8, "max_lora_rank": 64},
            hardware={"gpu_name": "NVIDIA L4"},
            unreachable=None,
        )


def _serving(plane: ControlPlane, model_id: str) -> tuple[str, str]:
    with plane.sessions() as session:
        status = serving_status(session, model=session.get_one(Model, model_id))
        return status.state, status.message


def _up_and_registered(plane: ControlPlane, model_id: str) -> Worker:
    """Launch a worker for the model, let SkyPilot bring it up, and the worker join."""
    plane.tick()
    plane.fake.settle()
    plane.tick()
    (worker,) = [w for w in plane.workers() if w.status == "provisioning"]
    _register(plane, worker.id)
    plane.tick()
    with plane.sessions() as session:
        assert session.get_one(Model, model_id).worker_id == worker.id
    return worker


def test_an_active_model_launches_one_cluster_for_its_base_model(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)
    _active_model(plane, "second-agent")
    fake.launch_gate.clear()
    plane.tick()
    plane.tick()
    (worker,) = plane.workers()
    (call,) = fake.launches
    assert call.cluster_name == f"skytrain-{worker.id}" == worker.cluster_name
    assert (worker.provider, worker.status) == ("skypilot", "provisioning")
    state, message = _serving(plane, model_id)
    assert state == "starting" and worker.id in message

    # The task joins the worker to this control plane with the worker's own token and secret.
    assert call.task.envs["SKYTRAIN_CONTROL_PLANE_URL"] == "https://skytrain.example.com"
    assert call.task.envs["SKYTRAIN_WORKER_BASE_MODEL"] == BASE_MODEL
    token = call.task.secrets["SKYTRAIN_WORKER_TOKEN"].get_secret_value()
    with plane.sessions() as session:
        assert worker_rows.authenticate_worker(session, token=token).id == worker.id
    assert call.task.secrets["SKYTRAIN_ENGINE_SECRET"].get_secret_value() == worker.engine_secret


def test_the_gateway_gets_the_endpoint_skypilot_exposes(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)
    fake.ports_open = False  # the worker registers before SkyPilot reports its port
    worker = _up_and_registered(plane, model_id)
    with plane.sessions() as session:
        assert session.get_one(Worker, worker.id).engine_endpoint == REGISTERED_FROM
    fake.ports_open = True
    plane.tick()
    with plane.sessions() as session:
        row = session.get_one(Worker, worker.id)
        # SkyPilot's public endpoint replaces the address the registration came from; the
        # worker is routed to again once a heartbeat reaches it there.
        assert (row.status, row.engine_endpoint) == ("unreachable", SKY_ENDPOINT)
        assert SKY_ENDPOINT in (row.status_message or "")
    state, message = _serving(plane, model_id)
    assert state == "unreachable" and "skytrain workers list" in message
    assert ENDPOINT_HOST not in message  # the address is the operator's, not the tenant's
    with plane.sessions() as session:
        # What the heartbeat route records once its probe reached the front door.
        row = session.get_one(Worker, worker.id)
        worker_rows.heartbeat(session, worker=row, status="ready", served=[], unreachable=None)
    state, message = _serving(plane, model_id)
    assert state == "ready", message


def test_a_failed_launch_fails_the_model_and_keeps_skypilots_message_for_the_operator(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    fake.fail_next_launch = exceptions.ResourcesUnavailableError(
        "Failed to acquire resources in all zones in us-east-1 for {A100:1}."
    )
    model_id = _active_model(plane)
    plane.tick()
    fake.settle()
    plane.tick()
    (worker,) = plane.workers()
    assert worker.status == "failed"
    state, message = _serving(plane, model_id)
    assert state == "failed"
    assert "the last worker for base model 'Qwen/Qwen2.5-7B-Instruct' failed" in message
    # SkyPilot's words are the operator's (`skytrain workers list`, the log), not the tenant's.
    assert "ResourcesUnavailableError" not in message
    assert "ResourcesUnavailableError: Failed to acquire resources" in (worker.status_message or "")
    # No launch loop: the next attempt waits for the back-off.
    plane.tick()
    assert len(fake.launches) == 1


def test_a_cluster_nobody_owns_is_torn_down(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    orphan = "skytrain-" + "e" * 32
    fake.add_cluster(orphan, sky.ClusterStatus.UP)
    fake.add_cluster("not-ours", sky.ClusterStatus.UP)
    plane.tick()
    fake.settle()
    assert fake.downs == [orphan]
    assert set(fake.clusters) == {"not-ours"}


def test_after_a_restart_live_workers_clusters_are_kept(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)
    worker = _up_and_registered(plane, model_id)
    plane.restart()
    plane.tick()
    fake.settle()
    assert fake.downs == []
    with plane.sessions() as session:
        assert session.get_one(Worker, worker.id).status == "ready"
        assert session.get_one(Model, model_id).worker_id == worker.id


def test_a_launching_worker_whose_cluster_vanished_is_lost(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    fake.launch_gate.clear()
    _active_model(plane)
    plane.tick()
    (worker,) = plane.workers()
    # The control plane restarts, and the launch never produced a cluster.
    fake.fail_next_launch = exceptions.ResourcesUnavailableError("no capacity")
    fake.launch_gate.set()
    fake.settle()
    plane.restart()
    with plane.sessions() as session:
        row = session.get_one(Worker, worker.id)
        row.created_at = utcnow() - timedelta(hours=1)
        session.commit()
    plane.tick()
    with plane.sessions() as session:
        row = session.get_one(Worker, worker.id)
        assert row.status == "lost"
        assert "no longer knows" in (row.status_message or "")


def test_scale_in_downs_the_idle_workers_cluster(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)
    worker = _up_and_registered(plane, model_id)
    long_ago = utcnow() - timedelta(hours=2)
    with plane.sessions() as session:
        session.get_one(Model, model_id).last_active_at = long_ago
        session.get_one(Worker, worker.id).last_active_at = long_ago
        session.commit()
    plane.tick()
    fake.settle()
    assert fake.downs == [worker.cluster_name]
    assert fake.clusters == {}
    plane.tick()
    with plane.sessions() as session:
        assert session.get_one(Worker, worker.id).status == "stopped"
    assert len(fake.launches) == 1


def test_a_preempted_worker_is_lost_and_its_job_runs_on_a_new_one(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)
    first = _up_and_registered(plane, model_id)
    with plane.sessions() as session:
        add_rl_job(session, model_id, job_id="job-1")
        session.commit()
        leased = queue.lease_job(session, worker=session.get_one(Worker, first.id), lease_s=60)
        assert leased is not None and (leased.status, leased.attempts) == ("running", 1)

    assert first.cluster_name is not None
    fake.preempt(first.cluster_name)
    plane.tick()
    with plane.sessions() as session:
        lost = session.get_one(Worker, first.id)
        assert lost.status == "lost"
        assert "no longer exists" in (lost.status_message or "")
        job = session.get_one(TrainingJob, "job-1")
        assert (job.status, job.worker_id) == ("queued", None)
    # The model still has work, so a replacement cluster is launched at once.
    assert len(fake.launches) == 2
    fake.settle()
    plane.tick()
    (second,) = [w for w in plane.workers() if w.status == "provisioning"]
    _register(plane, second.id)
    plane.tick()
    with plane.sessions() as session:
        leased = queue.lease_job(session, worker=session.get_one(Worker, second.id), lease_s=60)
        assert leased is not None
        assert (leased.id, leased.attempts, leased.worker_id) == ("job-1", 2, second.id)


def test_a_base_model_that_fits_no_configured_gpu_fails_its_worker_with_the_plans_reasons(
    control_plane: ControlPlane,
) -> None:
    """The model was stored before the accelerators changed (creation refuses it now): its
    launch never reaches SkyPilot, and `skytrain workers list` says why."""
    plane = control_plane
    models = Path(__file__).resolve().parents[1] / "planning" / "models"
    settings = plane.settings
    plane.settings = settings.model_copy(
        update={
            "storage": settings.storage.model_copy(update={"model_cache_dir": models}),
            "skypilot": settings.skypilot.model_copy(update={"accelerators": "L4:1, A10G:1"}),
        }
    )
    plane.restart()
    model_id = add_active_model(plane.sessions, "huge", base_model="Qwen/Qwen2.5-72B-Instruct")
    plane.tick()
    plane.fake.settle()
    (worker,) = plane.workers()
    assert worker.status == "failed"
    assert "fits none of the GPUs workers may get (L4:1, A10G:1)" in (worker.status_message or "")
    assert "does not fit 1 x L4 for serving" in (worker.status_message or "")
    assert plane.fake.launches == []
    state, _ = _serving(plane, model_id)
    assert state == "failed"

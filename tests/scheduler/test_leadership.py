"""One scheduler acts per database: leader election between control planes on PostgreSQL.

Two control planes share one PostgreSQL schema and one cloud (``FakeSky``, the fake at the
SkyPilot SDK boundary: tests/provision/fake_sky.py); each has its own provider and
``Scheduler`` with the real advisory-lock leadership. ``run_pass()`` is one wake-up of a
scheduler's loop. A process that holds the lock is played by a subprocess (killed with
SIGKILL) or by a ``Leadership`` object of the test's own.
"""

from __future__ import annotations

import asyncio
import logging
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import pytest
import sky
from sqlalchemy import create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, TrainingJob, Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.provision.skypilot import SkyPilotProvider
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler.leader import (
    AdvisoryLockLeadership,
    SoleLeadership,
    lock_key,
    open_leadership,
)
from skytrain_backend.scheduler.loop import Scheduler
from tests.fixtures.rows import add_active_model, add_rl_job
from tests.fixtures.services import MakeSettings
from tests.provision.fake_sky import FakeSky

BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"
OTHER_BASE_MODEL = "Qwen/Qwen2.5-1.5B-Instruct"


@dataclass
class Cluster:
    """One database and one cloud shared by every control plane of a test."""

    url: str
    sessions: sessionmaker[Session]
    fake: FakeSky
    settings: Settings

    def scheduler(self) -> Scheduler:
        """A control plane's scheduler: its own provider, its own claim on the leadership."""
        return Scheduler(
            settings=self.settings,
            sessions=self.sessions,
            provider=SkyPilotProvider(self.settings, sky_api=self.fake),
            leadership=open_leadership(self.url),
        )


def _stop(scheduler: Scheduler) -> None:
    """The control plane shuts down: its scheduler gives the leadership up."""
    asyncio.run(scheduler.stop())


@pytest.fixture
def cluster(make_settings: MakeSettings) -> Iterator[Cluster]:
    settings = make_settings(
        database="postgres",
        scheduler={
            "provider": "skypilot",
            "worker_idle_timeout_s": 600,
            "worker_heartbeat_timeout_s": 45,
            "max_workers": 4,
        },
        server={"public_url": "https://skytrain.example.com"},
        skypilot={"status_interval_s": 0},
    )
    url = settings.storage.resolved_database_url
    engine = create_db_engine(url)
    yield Cluster(url, session_factory(engine), FakeSky(), settings)
    engine.dispose()


def _ready_worker(cluster: Cluster, base_model: str, *, cluster_up: bool) -> str:
    """A registered worker, as a launch leaves it (its cluster up in the cloud, or gone)."""
    with cluster.sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider="skypilot", base_model=base_model, max_models=8
        )
        worker.cluster_name = f"skytrain-{worker.id}"
        session.commit()
        if cluster_up:
            cluster.fake.add_cluster(worker.cluster_name, sky.ClusterStatus.UP)
        worker_rows.register(
            session,
            worker=worker,
            base_model=base_model,
            served_model_name=base_model,
            engine_endpoint="http://127.0.0.1:8100",
            engine_secret=worker.engine_secret,
            engine_certificate="",
            capacity={"max_models": 8},
            hardware={},
            unreachable=None,
        )
        return worker.id


def _running_job(cluster: Cluster, model_id: str, worker_id: str) -> None:
    with cluster.sessions() as session:
        session.get_one(Model, model_id).worker_id = worker_id
        add_rl_job(session, model_id, job_id="job-1")
        session.commit()
        leased = queue.lease_job(session, worker=session.get_one(Worker, worker_id), lease_s=60)
        assert leased is not None


def _silent(cluster: Cluster, worker_id: str) -> None:
    """The worker sent its last heartbeat two hours ago; its job's lease ran out."""
    long_ago = utcnow() - timedelta(hours=2)
    with cluster.sessions() as session:
        session.get_one(Worker, worker_id).last_heartbeat_at = long_ago
        for job in session.query(TrainingJob).filter_by(worker_id=worker_id):
            job.lease_expires_at = long_ago
        session.commit()


def _idle(cluster: Cluster, worker_id: str) -> None:
    """The worker heartbeats, but has served nothing for two hours."""
    with cluster.sessions() as session:
        session.get_one(Worker, worker_id).last_active_at = utcnow() - timedelta(hours=2)
        session.commit()


def _state(cluster: Cluster) -> dict[str, object]:
    """What a scheduler pass changes: workers, jobs, and the cloud's launches and downs."""
    with cluster.sessions() as session:
        return {
            "workers": sorted(
                (w.id, w.status) for w in worker_rows.list_workers(session, include_ended=True)
            ),
            "jobs": sorted((j.id, j.status, j.attempts) for j in session.query(TrainingJob)),
            "launches": len(cluster.fake.launches),
            "downs": list(cluster.fake.downs),
        }


@pytest.mark.postgres
def test_of_two_schedulers_on_one_database_one_leads_until_it_stops(cluster: Cluster) -> None:
    first, second = cluster.scheduler(), cluster.scheduler()
    assert first.run_pass() is True
    for _ in range(3):
        assert second.run_pass() is False
        assert first.run_pass() is True
    assert (first.is_leader, second.is_leader) == (True, False)
    _stop(first)
    assert second.run_pass() is True  # its next wake-up takes over
    restarted = cluster.scheduler()
    assert restarted.run_pass() is False  # a control plane started again follows
    _stop(second)
    _stop(restarted)


@pytest.mark.postgres
def test_a_follower_neither_provisions_nor_expires_leases_nor_stops_workers(
    cluster: Cluster,
) -> None:
    # Work for a scheduler: a model nobody serves (a launch), a silent worker whose job's
    # lease ran out (lost, job requeued) and an idle worker (stopped).
    add_active_model(cluster.sessions, "unserved", base_model=OTHER_BASE_MODEL)
    trained = add_active_model(cluster.sessions, "trained", base_model=BASE_MODEL)
    silent = _ready_worker(cluster, BASE_MODEL, cluster_up=False)  # its machine is gone
    _running_job(cluster, trained, silent)
    _silent(cluster, silent)
    idle = _ready_worker(cluster, "HuggingFaceTB/SmolLM2-135M-Instruct", cluster_up=True)
    _idle(cluster, idle)
    before = _state(cluster)

    leader = AdvisoryLockLeadership(cluster.url)  # another control plane holds it
    assert leader.hold()
    follower = cluster.scheduler()
    for _ in range(3):
        assert follower.run_pass() is False
    cluster.fake.settle()
    assert _state(cluster) == before

    leader.release()
    assert follower.run_pass() is True
    cluster.fake.settle()
    after = _state(cluster)
    workers = dict(after["workers"])  # type: ignore[call-overload]
    assert (workers[silent], workers[idle]) == ("lost", "stopped")
    assert after["jobs"] == [("job-1", "queued", 1)]
    assert after["downs"] == [f"skytrain-{idle}"]
    launched = {call.task.envs["SKYTRAIN_WORKER_BASE_MODEL"] for call in cluster.fake.launches}
    assert launched == {OTHER_BASE_MODEL, BASE_MODEL}  # the unserved model, the requeued job
    _stop(follower)


@pytest.mark.postgres
def test_a_leader_killed_with_sigkill_hands_over_at_the_followers_next_wake_up(
    cluster: Cluster, tmp_path: Path
) -> None:
    holder = subprocess.Popen(
        [
            sys.executable,
            "-c",
            textwrap.dedent(
                f"""
                import sys, time
                from skytrain_backend.scheduler.leader import AdvisoryLockLeadership
                assert AdvisoryLockLeadership({cluster.url!r}).hold()
                print("leading", flush=True)
                time.sleep(600)
                """
            ),
        ],
        stdout=subprocess.PIPE,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == b"leading\n"
        follower = cluster.scheduler()
        assert follower.run_pass() is False
        holder.send_signal(signal.SIGKILL)
        holder.wait()
        # The dead process's connection closes with it; PostgreSQL frees the lock as soon
        # as it reads the end of the stream, so within a few wake-ups it is taken.
        wake_ups = 0
        while not follower.run_pass():
            wake_ups += 1
            assert wake_ups < 50, "the lock of a killed leader was not released"
            time.sleep(0.1)
        assert follower.is_leader
        _stop(follower)
    finally:
        holder.kill()
        holder.wait()


@pytest.mark.postgres
def test_a_leader_whose_connection_breaks_steps_down(
    cluster: Cluster, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="skytrain_backend.scheduler")
    leader, follower = cluster.scheduler(), cluster.scheduler()
    assert leader.run_pass() is True
    assert follower.run_pass() is False
    admin = create_engine(cluster.url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        # The backend holding this schema's lock (bigint keys are split in two in pg_locks).
        key = lock_key(str(connection.scalar(text("SELECT current_schema()"))))
        ended = connection.scalar(
            text(
                "SELECT count(pg_terminate_backend(pid)) FROM pg_locks WHERE locktype = "
                "'advisory' AND granted AND classid = :high AND objid = :low AND objsubid = 1"
            ),
            {"high": (key >> 32) & 0xFFFFFFFF, "low": key & 0xFFFFFFFF},
        )
    admin.dispose()
    assert ended == 1
    wake_ups = 0
    while not follower.run_pass():  # the backend ends a moment after it is told to
        wake_ups += 1
        assert wake_ups < 50, "the lock of a terminated connection was not released"
        time.sleep(0.1)
    assert leader.run_pass() is False  # it notices, and does not take the lock back
    messages = [record.getMessage() for record in caplog.records]
    assert any("is the leader" in m for m in messages)
    assert any("follows" in m for m in messages)
    assert any("lost the leadership" in m for m in messages)
    _stop(follower)
    _stop(leader)


@pytest.mark.postgres
def test_control_planes_in_different_schemas_do_not_contend(
    cluster: Cluster, make_settings: MakeSettings
) -> None:
    other_url = make_settings(database="postgres").storage.resolved_database_url
    here, there = AdvisoryLockLeadership(cluster.url), AdvisoryLockLeadership(other_url)
    try:
        assert here.hold() and there.hold()
    finally:
        here.release()
        there.release()


def test_on_sqlite_the_single_process_leads(make_settings: MakeSettings) -> None:
    settings = make_settings()
    url = settings.storage.resolved_database_url
    assert isinstance(open_leadership(url), SoleLeadership)
    engine = create_db_engine(url)
    scheduler = Scheduler(
        settings=settings, sessions=session_factory(engine), provider=None, leadership=None
    )
    assert scheduler.run_pass() is True and scheduler.is_leader
    engine.dispose()

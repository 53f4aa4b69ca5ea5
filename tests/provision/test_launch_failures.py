"""Workers that fail to start: a setup that fails inside SkyPilot's job, a worker that never
registers, and the back-off and limit of the launches that replace them.

SkyPilot runs a task's setup inside the cluster's job, after ``sky launch`` returned: the
cluster is UP while pip fails, then autostops and disappears. The scheduler, placement, worker
rows and the CLI are skytrain's own code on SQLite; the clusters and their jobs live in
``FakeSky``, the fake cloud at the SkyPilot SDK boundary (fake_sky.py).
"""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import pytest
from sky import exceptions
from sky.skylet.job_lib import JobStatus

from skytrain_backend.db.models import Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.cli import run_cli
from tests.fixtures.services import MakeSettings
from tests.provision.fake_sky import FakeSky
from tests.provision.test_skypilot_scheduling import (
    BASE_MODEL,
    ControlPlane,
    _active_model,
    _register,
    _serving,
)

DEADLINE_S = 600.0
SETUP_LOG = (
    "Running setup on 1 node.\n"
    "Collecting skytrain[gpu,worker]\n"
    "ERROR: No matching distribution found for unsloth==2026.10.9\n"
)


@pytest.fixture
def control_plane(make_settings: MakeSettings) -> Iterator[ControlPlane]:
    settings = make_settings(
        scheduler={
            "provider": "skypilot",
            "worker_register_deadline_s": DEADLINE_S,
            "worker_launch_backoff_s": 100,
            "worker_launch_backoff_max_s": 250,
            "worker_launch_max_failures": 4,
        },
        server={"public_url": "https://skytrain.example.com"},
        skypilot={"status_interval_s": 0},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    fake = FakeSky()
    plane = ControlPlane(settings, session_factory(engine), fake, scheduler=None)  # type: ignore[arg-type]
    plane.restart()
    yield plane
    fake.launch_gate.set()
    fake.settle()
    engine.dispose()


def _cli(plane: ControlPlane, *args: str) -> str:
    """`skytrain ...` on the control plane's database, as its operator runs it."""
    result = run_cli(plane.settings, *args)
    assert result.exit_code == 0, result.output
    return result.output


def _launched(plane: ControlPlane) -> Worker:
    """Launch a worker for an active model; SkyPilot brings its cluster up, setup runs."""
    plane.tick()
    plane.fake.settle()
    plane.tick()
    (worker,) = [w for w in plane.workers() if w.status == "provisioning"]
    return worker


def _launched_for_a_model(plane: ControlPlane) -> tuple[Worker, str]:
    """An active model and the worker launched for it: the worker and its cluster's name."""
    _active_model(plane)
    worker = _launched(plane)
    assert worker.cluster_name is not None
    return worker, worker.cluster_name


def _worker(plane: ControlPlane, worker_id: str) -> Worker:
    with plane.sessions() as session:
        return session.get_one(Worker, worker_id)


def _newest(plane: ControlPlane) -> Worker:
    return max(plane.workers(), key=lambda worker: worker.created_at)


def _age(
    plane: ControlPlane, worker_id: str, *, created_s: float = 0, stopped_s: float = 0
) -> None:
    """Move a worker's launch, or its end (with the times reckoned from it), this many
    seconds into the past."""
    with plane.sessions() as session:
        worker = session.get_one(Worker, worker_id)
        if created_s:
            worker.created_at = utcnow() - timedelta(seconds=created_s)
        if stopped_s:
            assert worker.stopped_at is not None
            shift = utcnow() - timedelta(seconds=stopped_s) - worker.stopped_at
            worker.stopped_at += shift
            if worker.relaunch_after is not None:
                worker.relaunch_after += shift
        session.commit()


def test_a_worker_whose_setup_fails_is_failed_at_once_with_skypilots_log(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    worker, cluster = _launched_for_a_model(plane)
    plane.tick()
    assert _worker(plane, worker.id).status == "provisioning"  # setup still running

    fake.end_job(cluster, JobStatus.FAILED_SETUP, log=SETUP_LOG)
    plane.tick()
    fake.settle()
    row = _worker(plane, worker.id)
    assert row.status == "failed"
    reason = row.status_message or ""
    assert "FAILED_SETUP" in reason and "No matching distribution found" in reason
    # Its cluster is downed now, not left to autostop.
    assert fake.downs == [cluster] and fake.clusters == {}

    # The operator sees it without --all: it is why the base model has no worker.
    listed = _cli(plane, "workers", "list")
    assert worker.id in listed and "failed" in listed and "FAILED_SETUP" in listed
    # The replacement waits for the back-off.
    plane.tick()
    assert len(fake.launches) == 1


def test_a_worker_that_does_not_register_in_time_is_failed_and_its_cluster_downed(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    worker, cluster = _launched_for_a_model(plane)
    fake.end_job(cluster, JobStatus.SETTING_UP, log="Pulling vllm/vllm-openai\n")
    _age(plane, worker.id, created_s=DEADLINE_S - 60)
    plane.tick()
    assert _worker(plane, worker.id).status == "provisioning"

    _age(plane, worker.id, created_s=DEADLINE_S + 1)
    plane.tick()
    fake.settle()
    row = _worker(plane, worker.id)
    assert row.status == "failed"
    reason = row.status_message or ""
    assert f"did not register within {DEADLINE_S:.0f}s" in reason
    assert "SKYTRAIN_WORKER_REGISTER_DEADLINE_S" in reason
    assert "SETTING_UP" in reason and "Pulling vllm/vllm-openai" in reason
    assert fake.downs == [cluster]


def test_a_registered_worker_is_never_held_to_the_deadline(control_plane: ControlPlane) -> None:
    plane, fake = control_plane, control_plane.fake
    _active_model(plane)
    worker = _launched(plane)
    _register(plane, worker.id)
    _age(plane, worker.id, created_s=DEADLINE_S * 10)
    plane.tick()
    assert _worker(plane, worker.id).status == "ready"
    assert fake.downs == []


def test_a_cluster_gone_before_its_worker_registered_is_a_failed_start(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    worker, cluster = _launched_for_a_model(plane)
    fake.preempt(cluster)  # autostopped after its setup failed, say
    plane.tick()
    row = _worker(plane, worker.id)
    assert row.status == "failed" and "no longer exists" in (row.status_message or "")
    assert len(fake.launches) == 1  # no replacement at once


def test_relaunches_back_off_exponentially_and_stop_at_the_limit_until_retried(
    control_plane: ControlPlane,
) -> None:
    plane, fake = control_plane, control_plane.fake
    model_id = _active_model(plane)

    def fail_next() -> None:
        fake.fail_next_launch = exceptions.ResourcesUnavailableError("no L4 in us-east-1")

    fail_next()
    assert _launch_and_settle(plane).status == "failed"
    # Base 100 s, doubling, capped at 250 s: 100, 200, 250.
    for failures, wait_s in ((1, 100), (2, 200), (3, 250)):
        newest = _newest(plane)
        assert newest.status == "failed"
        state, message = _serving(plane, model_id)
        assert state == "failed"
        assert f"{failures} in a row" in message and "next is launched in" in message
        _age(plane, newest.id, stopped_s=wait_s - 5)
        plane.tick()
        assert len(fake.launches) == failures
        fail_next()
        _age(plane, newest.id, stopped_s=wait_s + 5)
        assert _launch_and_settle(plane).status == "failed"
        assert len(fake.launches) == failures + 1

    # Four failures in a row: no more launches, however long it waits.
    newest = _newest(plane)
    _age(plane, newest.id, stopped_s=30 * 24 * 3600)
    plane.tick()
    assert len(fake.launches) == 4
    state, message = _serving(plane, model_id)
    assert state == "failed"
    assert "4 in a row" in message and "no more are launched" in message
    assert f"skytrain workers retry {BASE_MODEL}" in message
    assert "no L4" not in message  # SkyPilot's words are the operator's
    listed = _cli(plane, "workers", "list")
    assert newest.id in listed and "4 in a row" in listed

    said = _cli(plane, "workers", "retry", BASE_MODEL)
    assert "launched again" in said
    worker = _launch_and_settle(plane)
    assert len(fake.launches) == 5 and worker.status == "provisioning"
    _register(plane, worker.id)
    plane.tick()
    assert _serving(plane, model_id)[0] == "ready"


def test_retry_refuses_a_base_model_with_no_failed_launch(control_plane: ControlPlane) -> None:
    result = run_cli(control_plane.settings, "workers", "retry", "org/never-launched")
    assert result.exit_code == 1
    assert "no failed launch of 'org/never-launched'" in result.output


def _launch_and_settle(plane: ControlPlane) -> Worker:
    """One pass that launches, SkyPilot finishing the launch, and the pass that sees how."""
    plane.tick()
    plane.fake.settle()
    plane.tick()
    return _newest(plane)

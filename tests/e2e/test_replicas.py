"""Two `skytrain serve` replicas on one PostgreSQL and one object store (S3 on SeaweedFS),
real processes over real HTTP, with local workers running the tiny model.

Clients call either replica directly; workers reach them through a TCP load balancer in front
of both (``SKYTRAIN_PUBLIC_URL``), as in a deployment of N replicas. The first replica leads
the scheduler; the second follows until the first dies. Local workers are their replica's
children and die with it; the leader-kill test therefore uses a worker started by hand, as one
on another machine is.

Per-tenant request limits across two replicas are asserted in tests/gateway/test_limits.py.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import create_engine, text

from tests.e2e import support
from tests.e2e.conftest import _show_logs_if_failed
from tests.e2e.test_rl_loop import LEARNING_RATE, _long_job
from tests.fixtures.balancer import Balancer
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.s3]


@dataclass
class Replicas:
    leader: Service
    follower: Service
    database_url: str

    def rows(self, query: str, **params: Any) -> list[tuple[Any, ...]]:
        return _rows(self.database_url, query, **params)


def _rows(database_url: str, query: str, **params: Any) -> list[tuple[Any, ...]]:
    engine = create_engine(database_url)
    try:
        with engine.connect() as connection:
            return [tuple(row) for row in connection.execute(text(query), params)]
    finally:
        engine.dispose()


def _role(service: Service) -> str:
    return str(httpx.get(f"{service.url}/health", timeout=10).json()["scheduler"])


def _wait_for_role(service: Service, role: str, timeout_s: float = 60) -> None:
    deadline = time.monotonic() + timeout_s
    while _role(service) != role:
        assert service.process.poll() is None, service.log()
        assert time.monotonic() < deadline, f"{service.url} is not the {role}:\n{service.log()}"
        time.sleep(0.2)


@contextlib.contextmanager
def _replicas(
    request: pytest.FixtureRequest,
    make_postgres_url: Callable[[], str],
    make_bucket: Callable[[], str],
    s3_endpoint: str,
    home: Path,
    **overrides: str,
) -> Iterator[tuple[Replicas, Balancer]]:
    database_url = make_postgres_url()
    with Balancer() as balancer:
        shared = {
            "SKYTRAIN_DATABASE_URL": database_url,
            "SKYTRAIN_OBJECT_STORE_URL": make_bucket(),
            "SKYTRAIN_S3_ENDPOINT_URL": s3_endpoint,
            "SKYTRAIN_PUBLIC_URL": balancer.url,
            **overrides,
        }
        subprocess.run(
            [sys.executable, "-m", "skytrain_backend", "db", "upgrade"],
            env={**os.environ, **shared},
            check=True,
            capture_output=True,
        )
        services: list[Service] = []
        try:
            for name, role in (("first", "leader"), ("second", "follower")):
                service = start_service(shared, home / name)
                services.append(service)
                _wait_for_role(service, role)
                balancer.add(service.url)
            yield Replicas(services[0], services[1], database_url), balancer
        finally:
            for service in services:
                if service.process.poll() is None:
                    stop_service(service)
                _show_logs_if_failed(request, service)
            # Workers outlive a replica killed with SIGKILL (and are not its children to
            # stop when it is not): stop what is left, engine and all.
            for (hardware,) in _rows(database_url, "select hardware from workers"):
                with contextlib.suppress(ProcessLookupError, KeyError, TypeError):
                    os.killpg(int(hardware["pid"]), signal.SIGKILL)


@pytest.fixture
def replicas(
    request: pytest.FixtureRequest,
    make_postgres_url: Callable[[], str],
    make_bucket: Callable[[], str],
    s3_endpoint: str,
    tmp_path: Path,
) -> Iterator[Replicas]:
    """Two replicas whose leader starts local workers (children of its own)."""
    with _replicas(request, make_postgres_url, make_bucket, s3_endpoint, tmp_path) as (plane, _):
        yield plane


@pytest.fixture
def replicas_with_a_hand_started_worker(
    request: pytest.FixtureRequest,
    make_postgres_url: Callable[[], str],
    make_bucket: Callable[[], str],
    s3_endpoint: str,
    tmp_path: Path,
    tiny_model_path: Path,
) -> Iterator[Replicas]:
    """Two replicas provisioning nothing, and a worker started by hand (as on another machine)
    that joins through the load balancer: it outlives any one replica."""
    with _replicas(
        request, make_postgres_url, make_bucket, s3_endpoint, tmp_path, SKYTRAIN_PROVIDER="none"
    ) as (plane, balancer):
        token = plane.leader.cli("workers", "token", "create", "--base-model", str(tiny_model_path))
        worker = support.start_hand_worker(
            plane.leader.env,
            tmp_path / "worker",
            control_plane_url=balancer.url,
            join_token=token.strip().splitlines()[-1],
            base_model=tiny_model_path,
        )
        try:
            yield plane
        finally:
            worker.stop(grace_s=30)
            report = getattr(request.node, "rep_call", None)
            if report is not None and report.failed:
                print((tmp_path / "worker" / "worker.log").read_text()[-6000:])


def _register(service: Service, name: str, base_model: Path) -> dict[str, Any]:
    with service.http("alice") as http:
        response = http.post(
            "/v1/models", json={"project": "replicas", "name": name, "base_model": str(base_model)}
        )
        assert response.status_code == 201, response.text
        return dict(response.json())


def _launched_by(service: Service) -> list[str]:
    """Worker ids whose processes this replica's local provider started (their logs)."""
    return sorted(path.stem for path in (service.home / "workers").glob("*.log"))


@pytest.mark.slow
def test_a_model_registered_through_the_follower_is_placed_by_the_leader_only(
    replicas: Replicas, tiny_model_path: Path
) -> None:
    leader, follower = replicas.leader, replicas.follower
    first = _register(follower, "first", tiny_model_path)  # wakes the follower: it must not act
    second = _register(leader, "second", tiny_model_path)
    with follower.http("alice") as http:
        worker_id = support.wait_until_served(http, first["id"])["worker_id"]
        assert support.wait_until_served(http, second["id"])["worker_id"] == worker_id

    # One worker for the demand of both, provisioned by the leader; none by the follower.
    assert replicas.rows("select id from workers") == [(worker_id,)]
    assert _launched_by(leader) == [worker_id]
    assert _launched_by(follower) == []
    assert f"placed model {first['id']} on worker {worker_id}" in leader.log()
    assert "placed model" not in follower.log()
    assert (_role(leader), _role(follower)) == ("leader", "follower")

    # Sampled through one replica, trained through the other, the new step served by both.
    client = support.openai_client(follower.url, follower.key("alice"))
    groups = support.sample_groups(client, first["inference_name"], groups=2, n=4)
    with leader.http("alice") as http:
        _, events = support.train(http, first["id"], groups, learning_rate=LEARNING_RATE)
    ended = events[-1]["data"]
    assert events[-1]["type"] == "training_ended" and ended["step"] == 1
    # The worker reports how long each phase took (bench/rl_step.py prints them).
    phases = ("download", "prepare", "steps", "save", "upload", "engine_load", "training")
    assert all(ended[f"time/{phase}_s"] >= 0 for phase in phases), ended
    assert ended["time/training_s"] >= ended["time/save_s"] + ended["time/upload_s"]
    for service in (leader, follower):
        client = support.openai_client(service.url, service.key("alice"))
        _, headers = support.sample(client, first["inference_name"], "Say hello.", n=1)
        assert headers["x-skytrain-step"] == "1"
        assert headers["x-skytrain-worker"] == worker_id
    assert replicas.rows("select status, attempts from training_jobs") == [("succeeded", 1)]


@pytest.mark.slow
def test_killing_the_leader_mid_job_hands_scheduling_over_and_the_job_completes_once(
    replicas_with_a_hand_started_worker: Replicas, tiny_model_path: Path
) -> None:
    replicas = replicas_with_a_hand_started_worker
    leader, follower = replicas.leader, replicas.follower
    model = _register(leader, "survivor", tiny_model_path)
    with follower.http("alice") as http:
        worker_id = support.wait_until_served(http, model["id"])["worker_id"]
        job_id = _long_job(follower, http, model)  # queued through the follower; training now

        leader.process.send_signal(signal.SIGKILL)  # the worker is another machine's: it stays
        leader.process.wait()
        _wait_for_role(follower, "leader")
        events = support.events_until_end(http, job_id, timeout_s=600)

        job = http.get(f"/v1/training-jobs/{job_id}").json()
        assert (job["status"], job["attempts"], job["step"]) == ("succeeded", 1, 1), job
        types = [event["type"] for event in events]
        assert types.count("training_started") == 1 and events[0]["data"]["attempt"] == 1
        assert types.count("training_ended") == 1 and types[-1] == "training_ended"
        assert "training_failed" not in types
        # Leased once, by the worker that started it, and committed once.
        assert replicas.rows(
            "select status, attempts, worker_id from training_jobs where id = :id", id=job_id
        ) == [("succeeded", 1, worker_id)]
        assert replicas.rows(
            "select step from checkpoints where model_id = :id order by step", id=model["id"]
        ) == [(0,), (1,)]

        # The new leader schedules: a model registered now is placed, by it.
        newcomer = _register(follower, "newcomer", tiny_model_path)
        assert support.wait_until_served(http, newcomer["id"])["worker_id"] == worker_id
        assert f"placed model {newcomer['id']} on worker {worker_id}" in follower.log()
        assert "is the leader" in follower.log()
        assert support.wait_until_served(http, model["id"], step=1)["worker_id"] == worker_id
    assert replicas.rows("select count(*) from workers") == [(1,)]  # nothing provisioned twice

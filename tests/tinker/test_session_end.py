"""A Tinker client that goes away without ``close()`` (its script exited, its machine died)
stops heartbeating: its session ends after ``SKYTRAIN_TINKER_SESSION_TIMEOUT_S``, and so do its
training runs, whose jobs are what hold their trainers' places on a worker.

The client is played over HTTP in the SDK's wire format, sending no heartbeat at all; the
control plane (uvicorn in this process, SQLite) runs with a short timeout.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import httpx
import pytest

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.services import MakeSettings
from tests.fixtures.tinker_http import create_run
from tests.gateway.conftest import serve_in_thread, wait_until

SESSION_TIMEOUT_S = 2.0


@pytest.fixture(scope="module")
def plane(make_settings: MakeSettings) -> Iterator[tuple[str, str]]:
    """The control plane's URL, and a Tinker key of a tenant of its."""
    settings = make_settings(tinker={"session_timeout_s": SESSION_TIMEOUT_S})
    engine = create_db_engine(settings.storage.resolved_database_url)
    with session_factory(engine)() as session:
        _, key = api_keys.create_key(session, tenant_name=f"t-{uuid.uuid4().hex[:8]}")
    engine.dispose()
    with serve_in_thread(create_app(settings)) as url:
        yield url, key


@pytest.mark.slow
def test_a_client_that_stops_heartbeating_ends_its_runs(plane: tuple[str, str]) -> None:
    url, key = plane
    sdk = httpx.Client(base_url=url, headers={"X-API-Key": "tml-" + key}, timeout=60)
    rest = httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60)
    with sdk, rest:
        session_id, created = create_run(sdk)
        future = created.json()["request_id"]

        def job_status() -> str:
            (job,) = rest.get("/v1/training-jobs").json()["data"]
            assert job["kind"] == "tinker"
            return str(job["status"])

        # No heartbeat comes: the session ends, its run with it, and so the run's job, which
        # is what holds a trainer's place on a worker.
        wait_until(lambda: job_status() == "succeeded", what="the silent session's run ended")
        answer = sdk.post("/api/v1/retrieve_future", json={"request_id": future}).json()
        assert "its session finished" in answer["error"]
        heartbeat = sdk.post("/api/v1/session_heartbeat", json={"session_id": session_id})
        assert heartbeat.status_code == 410

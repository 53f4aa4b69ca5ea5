"""The database lost between an object's write and its row's commit: the request is answered
503 ``database_unavailable`` and commits nothing; sent again once the database is back, it
commits once (the object written again over the first), and an object whose row never came
is collected by the garbage sweep.

The control plane is the real app over HTTP on a PostgreSQL server of the test's own, which
the test stops from inside the store's write (the app's own store, watched: the moment
between the write and the commit is the one under test)."""

from __future__ import annotations

import hashlib
import json
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerRequest,
    TinkerRun,
    TrainingJobEvent,
    UploadReservation,
    utcnow,
)
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.scheduler import garbage
from skytrain_backend.storage import LocalObjectStore, keys
from tests.api.support import group, sft_trajectory
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.services import MakeSettings
from tests.fixtures.tinker_http import create_run, forward_backward_body
from tests.gateway.conftest import serve_in_thread
from tests.lifecycle.conftest import store_replaced

pytestmark = [pytest.mark.postgres, pytest.mark.slow]

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x02" * 4096}


class _StoreThatLosesTheDatabase(LocalObjectStore):
    """The app's own store (its directory), which stops the database right after a write
    while ``armed``: an observer that picks the moment, not a fake."""

    def __init__(self, root: Path, postgres: PostgresServer) -> None:
        super().__init__(root)
        self.postgres = postgres
        self.armed = False

    def _after_write(self) -> None:
        if self.armed:
            self.armed = False
            self.postgres.stop()

    def put_bytes(self, key: str, data: bytes) -> None:
        super().put_bytes(key, data)
        self._after_write()

    def copy(self, source_key: str, dest_key: str) -> int:
        size = super().copy(source_key, dest_key)
        if dest_key.endswith("adapter_model.safetensors"):  # the last file of the step
            self._after_write()
        return size


@dataclass
class Plane:
    app: FastAPI
    url: str
    key: str
    tenant_id: str
    sessions: sessionmaker[Session]
    store: _StoreThatLosesTheDatabase
    postgres: PostgresServer

    def lose_the_database_after_the_next_write(self) -> None:
        self.store.armed = True

    def database_back(self) -> None:
        self.postgres.start_again()


@pytest.fixture
def plane(make_settings: MakeSettings, private_postgres: PostgresServer) -> Iterator[Plane]:
    settings = make_settings(
        storage={"database_url": private_postgres.url},
        scheduler={"worker_heartbeat_timeout_s": 3600, "job_lease_s": 3600},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    sessions = session_factory(engine)
    with sessions() as session:
        row, key = api_keys.create_key(session, tenant_name=f"t-{uuid.uuid4().hex[:8]}")
    app = create_app(settings)
    with serve_in_thread(app) as url:
        store = _StoreThatLosesTheDatabase(app.state.store.root, private_postgres)
        with store_replaced(app, store):
            yield Plane(app, url, key, row.tenant_id, sessions, store, private_postgres)
    engine.dispose()


def _database_unavailable(response: httpx.Response) -> None:
    assert response.status_code == 503, response.text
    assert response.json()["error"]["type"] == "database_unavailable"


def test_a_checkpoint_whose_commit_lost_the_database_is_committed_once_on_retry(
    plane: Plane,
) -> None:
    rest = httpx.Client(
        base_url=plane.url, headers={"Authorization": f"Bearer {plane.key}"}, timeout=60
    )
    with rest:
        created = rest.post(
            "/v1/models", json={"project": "p", "name": "m", "base_model": "tests/base"}
        )
        model_id = created.json()["id"]
        with plane.sessions() as session:
            worker, token = worker_rows.create_worker(
                session, provider="manual", base_model="tests/base", max_models=8, status="ready"
            )
            session.get_one(Model, model_id).worker_id = worker.id
            session.commit()
        job_id = rest.post(
            "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
        ).json()["id"]
        as_worker = httpx.Client(
            base_url=f"{plane.url}/v1/worker",
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        with as_worker:
            assert as_worker.post("/jobs/lease", json={}).json()["job"]["id"] == job_id
            for name, data in ADAPTER.items():
                staged = as_worker.put(
                    f"/jobs/{job_id}/files/{name}", params={"attempt": 1}, content=data
                )
                assert staged.status_code == 204, staged.text
            files = [
                {"name": n, "size": len(d), "sha256": hashlib.sha256(d).hexdigest()}
                for n, d in ADAPTER.items()
            ]
            completion = {"attempt": 1, "step": 1, "metrics": {}, "files": files}
            plane.lose_the_database_after_the_next_write()
            try:
                _database_unavailable(as_worker.post(f"/jobs/{job_id}/complete", json=completion))
            finally:
                plane.database_back()
            # Nothing was committed: the job is still the worker's, at step 0.
            assert rest.get(f"/v1/training-jobs/{job_id}").json()["status"] == "running"
            steps = rest.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
            assert [checkpoint["step"] for checkpoint in steps] == [0]

            retried = as_worker.post(f"/jobs/{job_id}/complete", json=completion)
            assert retried.status_code == 200, retried.text
            assert retried.json()["step"] == 1
    with plane.sessions() as session:
        steps_committed = session.scalars(
            select(Checkpoint.step).where(Checkpoint.model_id == model_id)
        )
        assert sorted(steps_committed) == [0, 1]  # step 1 once
        ended = session.scalar(
            select(func.count())
            .select_from(TrainingJobEvent)
            .where(TrainingJobEvent.job_id == job_id, TrainingJobEvent.type == "training_ended")
        )
        assert ended == 1
    prefix = keys.model_prefix(tenant_id=plane.tenant_id, model_id=model_id)
    step = keys.checkpoint_prefix(
        tenant_id=plane.tenant_id,
        model_id=model_id,
        step=1,
        writer=keys.attempt_writer(job_id=job_id, attempt=1),
    ).removeprefix(prefix)
    assert sorted(info.key.removeprefix(prefix) for info in plane.store.list(prefix)) == sorted(
        [f"jobs/{job_id}/input.jsonl"] + [f"{step}{name}" for name in ADAPTER]
    )


def test_a_tinker_body_whose_row_lost_the_database_is_reused_or_collected(
    plane: Plane,
) -> None:
    sdk = httpx.Client(base_url=plane.url, headers={"X-API-Key": "tml-" + plane.key}, timeout=60)
    with sdk:
        session_id, _ = create_run(sdk)
        run_id = f"{session_id}:train:0"

        def send(seq_id: int) -> httpx.Response:
            return sdk.post(
                "/api/v1/forward_backward",
                content=forward_backward_body(run_id, seq_id),
                headers={"Content-Type": "application/x-protobuf"},
            )

        for seq_id in (1, 2):
            plane.lose_the_database_after_the_next_write()
            try:
                _database_unavailable(send(seq_id))
            finally:
                plane.database_back()
        # The SDK sends operation 1 again (it never got an answer); operation 2 it never does.
        assert send(1).status_code == 200
        assert send(1).status_code == 200  # and once more: still one operation
    with plane.sessions() as session:
        seq_ids = session.scalars(
            select(TinkerRequest.seq_id).where(
                TinkerRequest.run_id == run_id, TinkerRequest.seq_id > 0
            )
        )
        assert list(seq_ids) == [1]
        run = session.get_one(TinkerRun, run_id)
        tenant_id, model_id = run.tenant_id, run.model_id
    body_1 = keys.tinker_op_key(tenant_id=tenant_id, model_id=model_id, seq_id=1, name="input.pb")
    body_2 = keys.tinker_op_key(tenant_id=tenant_id, model_id=model_id, seq_id=2, name="input.pb")
    assert plane.store.exists(body_1) and plane.store.exists(body_2)
    with plane.sessions() as session:
        garbage.collect_garbage(
            session, store=plane.store, written_before=utcnow() + timedelta(seconds=1)
        )
    assert plane.store.exists(body_1)  # its row came: kept
    assert not plane.store.exists(body_2)  # its row never came: collected


def test_an_upload_whose_row_lost_the_database_keeps_nothing_and_its_reservation_expires(
    plane: Plane,
) -> None:
    """An uploaded file whose row's commit lost the database: 503, no row, no object, the
    tenant's total unchanged; the bytes its upload reserved, which could not be given back
    with the database away, stop counting once the reservation expires."""
    line = json.dumps(sft_trajectory()).encode() + b"\n"
    rest = httpx.Client(
        base_url=plane.url, headers={"Authorization": f"Bearer {plane.key}"}, timeout=60
    )
    with rest:
        plane.lose_the_database_after_the_next_write()
        try:
            _database_unavailable(rest.post("/v1/files", files={"file": ("a.jsonl", line)}))
        finally:
            plane.database_back()
        assert rest.get("/v1/files").json()["data"] == []
        assert plane.store.list(keys.files_prefix(plane.tenant_id)) == []
        with plane.sessions() as session:
            assert session.get_one(Tenant, plane.tenant_id).storage_bytes == 0
            (left,) = session.scalars(select(UploadReservation))  # the one not given back
            assert left.expires_at <= utcnow() + tenants.RESERVATION_TTL
            assert left.bytes > 1000  # it would hold all of the quota set below
            # Its time passes: nothing it held counts any more.
            left.expires_at = utcnow() - timedelta(seconds=1)
            values = {"max_storage_bytes": 1000}
            tenant = session.get_one(Tenant, plane.tenant_id)
            tenants.set_limits(session, tenant_name=tenant.name, values=values, reset=[])

        uploaded = rest.post("/v1/files", files={"file": ("a.jsonl", line)})
        assert uploaded.status_code == 201, uploaded.text
    with plane.sessions() as session:
        held = session.get_one(Tenant, plane.tenant_id).storage_bytes
        assert held == uploaded.json()["bytes"] > 0
        assert list(session.scalars(select(UploadReservation))) == []
    assert len(plane.store.list(keys.files_prefix(plane.tenant_id))) == 1

"""A Tinker ``forward_backward`` body (up to the request limit) goes to the object store with
no database transaction open: nothing of the run's tables is held while the bytes go up, and
the operation is queued once they are stored. An operation body whose row never came is
collected by the garbage sweep; one whose row came is kept. An operation's output that would
take its tenant past its storage quota is not stored: the operation fails saying so. Reading
an operation's output, a logged batch, or deleting a model's objects holds no transaction
either.

PostgreSQL on a schema of the module's own (``make_settings``), so that the table locks the
test looks at are this control plane's only."""

from __future__ import annotations

import hashlib
import uuid
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Checkpoint, Model, TinkerRequest, TinkerRun, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.scheduler import garbage
from skytrain_backend.storage import LocalObjectStore, keys
from tests.api.support import group
from tests.fixtures.services import MakeSettings
from tests.fixtures.tinker_http import create_run, forward_backward_body
from tests.gateway.conftest import serve_in_thread
from tests.lifecycle.conftest import held_tables, store_watched

pytestmark = pytest.mark.postgres

PROTOBUF = "application/x-protobuf"


@dataclass
class Plane:
    app: FastAPI
    sdk: httpx.Client
    rest: httpx.Client
    sessions: sessionmaker[Session]
    store: LocalObjectStore


@pytest.fixture(scope="module")
def plane(make_settings: MakeSettings) -> Iterator[Plane]:
    settings = make_settings(database="postgres")
    engine = create_db_engine(settings.storage.resolved_database_url)
    sessions = session_factory(engine)
    with sessions() as session:
        _, key = api_keys.create_key(session, tenant_name=f"t-{uuid.uuid4().hex[:8]}")
    app = create_app(settings)
    with (
        serve_in_thread(app) as url,
        httpx.Client(base_url=url, headers={"X-API-Key": "tml-" + key}, timeout=60) as sdk,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=60) as rest,
    ):
        store = LocalObjectStore(settings.storage.home / "objects")
        yield Plane(app, sdk, rest, sessions, store)
    engine.dispose()


def _run(plane: Plane) -> str:
    """A new training run (no worker needed to queue its operations): its id. Its base model
    is its own, so that the running scheduler places no other test's run on its worker."""
    session_id, _ = create_run(plane.sdk, base_model=f"tests-org/tiny-{uuid.uuid4().hex[:8]}")
    return f"{session_id}:train:0"


def _forward_backward(sdk: httpx.Client, run_id: str, seq_id: int) -> str:
    """Queue a forward_backward as operation ``seq_id`` of the run: its future's id."""
    queued = sdk.post(
        "/api/v1/forward_backward",
        content=forward_backward_body(run_id, seq_id),
        headers={"Content-Type": PROTOBUF},
    )
    assert queued.status_code == 200, queued.text
    return str(queued.json()["request_id"])


def test_a_forward_backward_body_is_stored_with_no_transaction_open(plane: Plane) -> None:
    run_id = _run(plane)
    held: list[list[str]] = []

    def watch() -> None:
        held.append(held_tables(plane.sessions, "tinker_requests", "tinker_runs", "training_jobs"))

    with store_watched(plane.app, watch, on="put_bytes"):
        _forward_backward(plane.sdk, run_id, 1)
    assert held == [[]]  # one put, and no table held meanwhile
    with plane.sessions() as session:
        row = session.query(TinkerRequest).filter_by(run_id=run_id, seq_id=1).one()
        assert row.kind == "forward_backward" and row.input_uri is not None


def test_an_operation_body_whose_row_never_came_is_collected(plane: Plane) -> None:
    run_id = _run(plane)
    _forward_backward(plane.sdk, run_id, 1)
    with plane.sessions() as session:
        run = session.get_one(TinkerRun, run_id)
        orphan = keys.tinker_op_key(
            tenant_id=run.tenant_id, model_id=run.model_id, seq_id=2, name="input.pb"
        )
        kept = keys.tinker_op_key(
            tenant_id=run.tenant_id, model_id=run.model_id, seq_id=1, name="input.pb"
        )
    # What a control plane that died between the store's write and the row's commit leaves.
    plane.store.put_bytes(orphan, b"a body whose row never came")
    with plane.sessions() as session:
        garbage.collect_garbage(
            session, store=plane.store, written_before=utcnow() + timedelta(seconds=1)
        )
    assert not plane.store.exists(orphan)
    assert plane.store.exists(kept)


SAVED = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256)) * 64}


def _staged(files: dict[str, bytes]) -> list[dict[str, object]]:
    return [
        {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in files.items()
    ]


@contextmanager
def _save_leased(plane: Plane, run_id: str) -> Iterator[tuple[httpx.Client, str]]:
    """A ``save_weights`` queued as operation 1 of the run, and the run leased by a worker
    holding its model: the worker's client (``/v1/worker``) and the run's job id."""
    queued = plane.sdk.post(
        "/api/v1/save_weights", json={"model_id": run_id, "path": "s1", "seq_id": 1}
    )
    assert queued.status_code == 200, queued.text
    with _leased(plane, run_id) as leased:
        yield leased


@contextmanager
def _leased(plane: Plane, run_id: str) -> Iterator[tuple[httpx.Client, str]]:
    """The run leased by a worker holding its model: the worker's client (``/v1/worker``)
    and the run's job id."""
    with plane.sessions() as session:
        model = session.get_one(Model, session.get_one(TinkerRun, run_id).model_id)
        worker, token = worker_rows.create_worker(
            session, provider="manual", base_model=model.base_model, max_models=8, status="ready"
        )
        model.worker_id = worker.id
        session.commit()
    with httpx.Client(
        base_url=str(plane.sdk.base_url.join("/v1/worker")),
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    ) as http:
        leased = http.post("/tinker/lease")
        assert leased.status_code == 200, leased.text
        assert leased.json()["run"]["attempt"] == 1
        yield http, str(leased.json()["run"]["job_id"])


def _stage(http: httpx.Client, job_id: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        put = http.put(f"/jobs/{job_id}/files/{name}", params={"attempt": 1}, content=data)
        assert put.status_code == 204, put.text


def _save(http: httpx.Client, job_id: str, files: dict[str, bytes]) -> httpx.Response:
    body = {"attempt": 1, "files": _staged(files), "step": 1, "grads_pending": False}
    return http.post(f"/tinker/runs/{job_id}/operations/1/save", json={**body, "optim_steps": 0})


def test_a_tinker_save_copies_its_files_with_no_transaction_open(plane: Plane) -> None:
    run_id = _run(plane)
    held: list[list[str]] = []

    def watch() -> None:
        held.append(
            held_tables(
                plane.sessions, "tinker_requests", "tinker_runs", "training_jobs", "checkpoints"
            )
        )

    with _save_leased(plane, run_id) as (http, job_id):
        _stage(http, job_id, SAVED)
        with store_watched(plane.app, watch, on="copy"):
            saved = _save(http, job_id, SAVED)
    assert saved.status_code == 204, saved.text
    assert held == [[], []]  # one copy per file, and no table held meanwhile
    with plane.sessions() as session:
        operation = session.query(TinkerRequest).filter_by(run_id=run_id, seq_id=1).one()
        assert operation.status == "succeeded"
        model_id = session.get_one(TinkerRun, run_id).model_id
        row = session.query(Checkpoint).filter_by(model_id=model_id, step=1).one()
        assert [item["name"] for item in row.files or []] == list(SAVED)
        tenant_id = session.get_one(Model, model_id).tenant_id
    assert row.uri is not None
    prefix = keys.committed_prefix(tenant_id=tenant_id, model_id=model_id, uri=row.uri)
    assert (
        plane.store.get_bytes(prefix + "adapter_model.safetensors")
        == SAVED["adapter_model.safetensors"]
    )


def test_a_tinker_save_whose_staged_file_differs_commits_nothing(plane: Plane) -> None:
    run_id = _run(plane)
    weights = SAVED["adapter_model.safetensors"]
    with _save_leased(plane, run_id) as (http, job_id):
        _stage(http, job_id, {**SAVED, "adapter_model.safetensors": weights[:-100]})
        refused = _save(http, job_id, SAVED)
        assert refused.status_code == 400, refused.text
        error = refused.json()["error"]["message"]
        assert "adapter_model.safetensors is staged with 16284 bytes, not 16384" in error
        assert "adapter_config.json" not in error
        assert str(plane.store.root) not in refused.text
        with plane.sessions() as session:
            model_id = session.get_one(TinkerRun, run_id).model_id
            assert session.query(Checkpoint).filter_by(model_id=model_id, step=1).count() == 0
            operation = session.query(TinkerRequest).filter_by(run_id=run_id, seq_id=1).one()
            assert operation.status not in ("succeeded", "failed")
        # Still the worker's to save: the file uploaded again, the same save commits.
        _stage(http, job_id, SAVED)
        saved = _save(http, job_id, SAVED)
        assert saved.status_code == 204, saved.text


def test_an_operation_output_past_the_storage_quota_fails_it_and_stores_nothing(
    plane: Plane,
) -> None:
    name = f"t-{uuid.uuid4().hex[:8]}"
    with plane.sessions() as session:
        _, key = api_keys.create_key(session, tenant_name=name)
    headers = {"X-API-Key": "tml-" + key}
    with httpx.Client(base_url=plane.sdk.base_url, headers=headers, timeout=60) as sdk:
        session_id, _ = create_run(sdk, base_model=f"tests-org/tiny-{uuid.uuid4().hex[:8]}")
        run_id = f"{session_id}:train:0"
        futures = [_forward_backward(sdk, run_id, seq_id) for seq_id in (1, 2)]
        with plane.sessions() as session:
            tenant = tenants.get_tenant_by_name(session, name=name)
            held = tenant.storage_bytes
            values = {"max_storage_bytes": held + 1000}
            tenants.set_limits(session, tenant_name=name, values=values, reset=[])
            run = session.get_one(TinkerRun, run_id)
            outputs = [
                keys.tinker_op_key(
                    tenant_id=run.tenant_id, model_id=run.model_id, seq_id=seq_id, name="output.pb"
                )
                for seq_id in (1, 2)
            ]

        def operation(seq_id: int) -> TinkerRequest:
            with plane.sessions() as session:
                return session.query(TinkerRequest).filter_by(run_id=run_id, seq_id=seq_id).one()

        with _leased(plane, run_id) as (http, job_id):
            path = f"/tinker/runs/{job_id}/operations"
            done = {"attempt": 1, "result": {}, "has_output": True}
            for seq_id in (0, 1):
                arrived = http.post(
                    f"/tinker/runs/{job_id}/next", json={"attempt": 1, "seq_id": seq_id}
                )
                assert arrived.status_code == 200, arrived.text
            created = http.post(f"{path}/0/complete", json={**done, "has_output": False})
            assert created.status_code == 204, created.text
            # 2,000 bytes where 1,000 are left: refused, and the operation fails saying so.
            put = http.put(f"{path}/1/output", params={"attempt": 1}, content=b"x" * 2000)
            assert put.status_code == 204, put.text
            assert not plane.store.exists(outputs[0])
            refused = operation(1)
            assert refused.status == "failed" and refused.error_category == "user"
            assert refused.error is not None
            assert refused.error.startswith("nothing of it was stored (its gradients were")
            assert (
                f"takes 2000 bytes and your tenant holds {held} of the {held + 1000}"
                in refused.error
            )
            assert "(max_storage_bytes)" in refused.error
            assert refused.output_bytes == 0
            # The worker's completion finds it over: it stays failed, with nothing counted.
            assert http.post(f"{path}/1/complete", json=done).status_code == 204
            assert operation(1).status == "failed"
            future = sdk.post("/api/v1/retrieve_future", json={"request_id": futures[0]})
            assert "max_storage_bytes" in future.json()["error"]

            # One that fits is stored, counted, and completes.
            arrived = http.post(f"/tinker/runs/{job_id}/next", json={"attempt": 1, "seq_id": 2})
            assert arrived.status_code == 200, arrived.text
            put = http.put(f"{path}/2/output", params={"attempt": 1}, content=b"y" * 600)
            assert put.status_code == 204, put.text
            assert http.post(f"{path}/2/complete", json=done).status_code == 204
        assert plane.store.get_bytes(outputs[1]) == b"y" * 600
        assert operation(2).status == "succeeded" and operation(2).output_bytes == 600
        with plane.sessions() as session:
            assert tenants.get_tenant_by_name(session, name=name).storage_bytes == held + 600
            assert name not in [item.tenant for item in tenants.recount_storage(session, fix=False)]


def _output_completed(
    plane: Plane, watched: Callable[[], AbstractContextManager[None]] = nullcontext
) -> str:
    """A forward_backward (operation 1 of a new run) completed by its worker with an uploaded
    output of 100 bytes, the ``complete`` call made within ``watched()``: its future's id."""
    run_id = _run(plane)
    future_id = _forward_backward(plane.sdk, run_id, 1)
    with _leased(plane, run_id) as (http, job_id):
        path = f"/tinker/runs/{job_id}/operations"
        for seq_id in (0, 1):
            arrived = http.post(
                f"/tinker/runs/{job_id}/next", json={"attempt": 1, "seq_id": seq_id}
            )
            assert arrived.status_code == 200, arrived.text
        done = {"attempt": 1, "result": {}, "has_output": False}
        assert http.post(f"{path}/0/complete", json=done).status_code == 204
        put = http.put(f"{path}/1/output", params={"attempt": 1}, content=b"z" * 100)
        assert put.status_code == 204, put.text
        with watched():
            completed = http.post(f"{path}/1/complete", json={**done, "has_output": True})
    assert completed.status_code == 204, completed.text
    with plane.sessions() as session:
        row = session.query(TinkerRequest).filter_by(run_id=run_id, seq_id=1).one()
        assert row.status == "succeeded" and row.output_bytes == 100
    return future_id


def test_an_operations_output_is_checked_with_no_transaction_open(plane: Plane) -> None:
    """``complete`` looks the uploaded output up in the store before it locks the run's job:
    it held that row lock while the store answered."""
    held: list[list[str]] = []

    def watch() -> None:
        held.append(held_tables(plane.sessions, "tinker_requests", "tinker_runs", "training_jobs"))

    _output_completed(plane, lambda: store_watched(plane.app, watch, on="list"))
    assert held == [[]]  # one listing, and no table held meanwhile


def test_an_operations_output_is_read_with_no_transaction_open(plane: Plane) -> None:
    """The future's answer is read from the store after the run's row was looked up: that
    read transaction stayed open while the store answered."""
    future_id = _output_completed(plane)
    held: list[list[str]] = []

    def watch() -> None:
        held.append(held_tables(plane.sessions, "tinker_requests", "tinker_runs"))

    with store_watched(plane.app, watch, on="get_bytes"):
        answer = plane.sdk.post("/api/v1/retrieve_future", json={"request_id": future_id})
    assert answer.status_code == 200, answer.text
    assert answer.content == b"z" * 100
    assert held == [[]]


def _logged_model(plane: Plane) -> tuple[str, str]:
    """A REST model of its own with one logged batch: their ids."""
    model = plane.rest.post(
        "/v1/models",
        json={"project": "p", "name": uuid.uuid4().hex[:8], "base_model": "tests-org/tiny"},
    )
    assert model.status_code == 201, model.text
    model_id = str(model.json()["id"])
    logged = plane.rest.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    assert logged.status_code == 201, logged.text
    return model_id, str(logged.json()["id"])


def test_a_logged_batch_is_read_and_a_model_deleted_with_no_transaction_open(
    plane: Plane,
) -> None:
    model_id, batch_id = _logged_model(plane)
    held: list[list[str]] = []

    def watch() -> None:
        held.append(held_tables(plane.sessions, "models", "trajectory_batches"))

    with store_watched(plane.app, watch, on="get_bytes"):
        read = plane.rest.get(f"/v1/models/{model_id}/logs/{batch_id}")
    assert read.status_code == 200, read.text
    assert read.json()["num_trajectories"] == 2
    with store_watched(plane.app, watch, on="delete_prefix"):
        deleted = plane.rest.delete(f"/v1/models/{model_id}")
    assert deleted.status_code == 204, deleted.text
    assert held == [[], []]
    assert plane.rest.get(f"/v1/models/{model_id}").status_code == 404
    assert not [info.key for info in plane.store.list() if f"/{model_id}/" in info.key]

"""A job's checkpoint is committed only as the worker has it: ``complete`` carries each staged
file's size and SHA-256, the control plane reads the staged objects back, and a file that
differs (cut short, or the same length with other bytes) commits nothing, with a 400 naming
it; the job stays the worker's, so uploading it again and completing works. And the store's
work happens with no transaction open: nothing holds the job's row while its files are
checked and copied."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
from fastapi import FastAPI
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.storage import LocalObjectStore
from tests.api.support import group
from tests.lifecycle.conftest import Who, WorkerClient

ADAPTER = {
    "adapter_config.json": b'{"r": 8}',
    "adapter_model.safetensors": bytes(range(256)) * 64,
}


def _completion(step: int = 1) -> dict[str, object]:
    files = [
        {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in ADAPTER.items()
    ]
    return {"attempt": 1, "step": step, "metrics": {}, "files": files}


def _leased_job(alice: Who, worker: WorkerClient, model_id: str) -> str:
    job_id = str(
        alice.http.post(
            "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
        ).json()["id"]
    )
    assert worker.http.post("/jobs/lease", json={}).json()["job"]["id"] == job_id
    return job_id


def _stage(worker: WorkerClient, job_id: str, files: dict[str, bytes]) -> None:
    for name, data in files.items():
        staged = worker.http.put(
            f"/jobs/{job_id}/files/{name}", params={"attempt": 1}, content=data
        )
        assert staged.status_code == 204, staged.text


def _steps(alice: Who, model_id: str) -> list[int]:
    listed = alice.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
    return sorted(int(checkpoint["step"]) for checkpoint in listed)


WEIGHTS = ADAPTER["adapter_model.safetensors"]
DAMAGED = {
    "cut short": (WEIGHTS[:-100], "is staged with 16284 bytes, not 16384"),
    "other bytes": (b"\xff" + WEIGHTS[1:], "is staged with a SHA-256 other than"),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_staged_file_that_differs_from_the_workers_commits_nothing(
    damage: str,
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_store: LocalObjectStore,
) -> None:
    alice = who()
    model_id = str(alice.create_model()["id"])
    worker = worker_client(model_id)
    job_id = _leased_job(alice, worker, model_id)
    staged, message = DAMAGED[damage]
    _stage(worker, job_id, {**ADAPTER, "adapter_model.safetensors": staged})

    refused = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]["message"]
    assert "the checkpoint of step 1 of job" in error and "was not committed" in error
    assert f"adapter_model.safetensors {message}" in error
    assert "adapter_config.json" not in error  # the good file is not blamed
    assert str(lifecycle_store.root) not in refused.text
    assert _steps(alice, model_id) == [0]
    assert alice.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "running"

    # Still the worker's: the file uploaded again, the same completion commits.
    _stage(worker, job_id, ADAPTER)
    committed = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert committed.status_code == 200, committed.text
    assert _steps(alice, model_id) == [0, 1]
    downloaded = alice.http.get(
        f"/v1/models/{model_id}/checkpoints/1/files/adapter_model.safetensors",
        follow_redirects=True,
    )
    assert downloaded.content == WEIGHTS


def test_a_completion_without_checksums_is_refused(
    who: Callable[[], Who], worker_client: Callable[..., WorkerClient]
) -> None:
    alice = who()
    model_id = str(alice.create_model()["id"])
    worker = worker_client(model_id)
    job_id = _leased_job(alice, worker, model_id)
    _stage(worker, job_id, ADAPTER)
    files = [{"name": name, "size": len(data)} for name, data in ADAPTER.items()]
    refused = worker.http.post(
        f"/jobs/{job_id}/complete", json={"attempt": 1, "step": 1, "metrics": {}, "files": files}
    )
    assert refused.status_code == 400, refused.text
    assert "sha256" in refused.json()["error"]["message"]
    assert _steps(alice, model_id) == [0]


class _WatchedStore(LocalObjectStore):
    """The control plane's own store (the same directory), which runs ``watch`` each time it
    is about to copy an object: an observer, not a fake, so that the test sees what the
    database holds while the store works."""

    def __init__(self, root: Path, watch: Callable[[], None]) -> None:
        super().__init__(root)
        self._watch = watch

    def copy(self, source_key: str, dest_key: str) -> int:
        self._watch()
        return super().copy(source_key, dest_key)


@contextmanager
def _watched(app: FastAPI, watch: Callable[[], None]) -> Iterator[None]:
    real = app.state.store
    app.state.store = _WatchedStore(real.root, watch)
    try:
        yield
    finally:
        app.state.store = real


def test_no_row_lock_is_held_while_the_commit_copies_the_files(
    lifecycle_settings: Settings,
    lifecycle_app: FastAPI,
    lifecycle_db: sessionmaker[Session],
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
) -> None:
    if lifecycle_settings.resolved_database_url.startswith("sqlite"):
        pytest.skip("row locks are PostgreSQL's: SQLite has none to hold")
    alice = who()
    model_id = str(alice.create_model()["id"])
    worker = worker_client(model_id)
    job_id = _leased_job(alice, worker, model_id)
    _stage(worker, job_id, ADAPTER)
    locked: list[bool] = []

    def watch() -> None:
        # Another connection asks for the job's row, as a renewal or a cancel would.
        with lifecycle_db() as session:
            try:
                session.execute(
                    text("SELECT id FROM training_jobs WHERE id = :id FOR UPDATE NOWAIT"),
                    {"id": job_id},
                )
                locked.append(False)
            except OperationalError:
                locked.append(True)
            session.rollback()

    with _watched(lifecycle_app, watch):
        committed = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert committed.status_code == 200, committed.text
    assert locked == [False] * len(ADAPTER)

"""A job's checkpoint is committed only as the worker has it: ``complete`` carries each staged
file's size and SHA-256, the control plane compares them with the staged objects' (a listing,
and the digests it recorded as each upload streamed through), and a file that
differs (cut short, or the same length with other bytes) commits nothing, with a 400 naming
it; the job stays the worker's, so uploading it again and completing works. And the store's
work happens with no transaction open: nothing holds the job's row while its files are
checked and copied."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy import text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant, TrainingJob, utcnow
from skytrain_backend.scheduler import garbage, queue
from skytrain_backend.storage import LocalObjectStore
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import (
    OnWorker,
    Who,
    WorkerClient,
    leased_job,
    store_watched,
)

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


def _steps(alice: Who, model_id: str) -> list[int]:
    listed = alice.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
    return sorted(int(checkpoint["step"]) for checkpoint in listed)


def _still_running_with_nothing_committed(alice: Who, model_id: str, job_id: str) -> None:
    """A refused completion: no step committed, and the job is still its worker's."""
    assert _steps(alice, model_id) == [0]
    assert alice.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "running"


def _uploads_again_and_commits(
    alice: Who, worker: WorkerClient, model_id: str, job_id: str
) -> None:
    """The worker uploads the adapter again; the same completion commits step 1."""
    worker.stage(job_id, ADAPTER)
    committed = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert committed.status_code == 200, committed.text
    assert _steps(alice, model_id) == [0, 1]


WEIGHTS = ADAPTER["adapter_model.safetensors"]
DAMAGED = {
    "cut short": (WEIGHTS[:-100], "is staged with 16284 bytes, not 16384"),
    "other bytes": (b"\xff" + WEIGHTS[1:], "is staged with a SHA-256 other than"),
}


@pytest.mark.parametrize("damage", list(DAMAGED))
def test_a_staged_file_that_differs_from_the_workers_commits_nothing(
    on_worker: OnWorker,
    damage: str,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    staged, message = DAMAGED[damage]
    worker.stage(job_id, {**ADAPTER, "adapter_model.safetensors": staged})

    refused = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert refused.status_code == 400, refused.text
    error = refused.json()["error"]["message"]
    assert "the checkpoint of step 1 of job" in error and "was not committed" in error
    assert f"adapter_model.safetensors {message}" in error
    assert "adapter_config.json" not in error  # the good file is not blamed
    assert str(lifecycle_store.root) not in refused.text
    _still_running_with_nothing_committed(alice, model_id, job_id)

    # Still the worker's: the file uploaded again, the same completion commits.
    _uploads_again_and_commits(alice, worker, model_id, job_id)
    downloaded = alice.http.get(
        f"/v1/models/{model_id}/checkpoints/1/files/adapter_model.safetensors",
        follow_redirects=True,
    )
    assert downloaded.content == WEIGHTS


def test_a_completion_without_checksums_is_refused(on_worker: OnWorker) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    files = [{"name": name, "size": len(data)} for name, data in ADAPTER.items()]
    refused = worker.http.post(
        f"/jobs/{job_id}/complete", json={"attempt": 1, "step": 1, "metrics": {}, "files": files}
    )
    assert refused.status_code == 400, refused.text
    assert "sha256" in refused.json()["error"]["message"]
    assert _steps(alice, model_id) == [0]


def _job_row_locked(db: sessionmaker[Session], job_id: str) -> bool:
    """Whether another connection holds the job's row, asked as a renewal or a cancel would."""
    with db() as session:
        try:
            session.execute(
                text("SELECT id FROM training_jobs WHERE id = :id FOR UPDATE NOWAIT"),
                {"id": job_id},
            )
            return False
        except OperationalError:
            return True
        finally:
            session.rollback()


def test_no_row_lock_is_held_while_the_commit_copies_the_files(
    on_worker: OnWorker,
    lifecycle_settings: Settings,
    lifecycle_plane: ServedPlane,
) -> None:
    if lifecycle_settings.storage.resolved_database_url.startswith("sqlite"):
        pytest.skip("row locks are PostgreSQL's: SQLite has none to hold")
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    locked: list[bool] = []

    def watch() -> None:
        locked.append(_job_row_locked(lifecycle_plane.sessions, job_id))

    with store_watched(lifecycle_plane.app, watch, on="copy"):
        committed = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert committed.status_code == 200, committed.text
    assert locked == [False] * len(ADAPTER)


def test_no_row_lock_is_held_while_a_refused_commit_removes_its_files(
    on_worker: OnWorker,
    lifecycle_settings: Settings,
    lifecycle_plane: ServedPlane,
) -> None:
    """A commit the storage quota refuses fails the job and removes the files it copied and
    staged: it held the job's row lock while the store deleted them."""
    if lifecycle_settings.storage.resolved_database_url.startswith("sqlite"):
        pytest.skip("row locks are PostgreSQL's: SQLite has none to hold")
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    with lifecycle_plane.sessions() as session:
        tenant = session.get_one(Tenant, alice.tenant_id)
        values = {"max_storage_bytes": tenant.storage_bytes}  # nothing more fits
        tenants.set_limits(session, tenant_name=tenant.name, values=values, reset=[])
    locked: list[bool] = []

    def watch() -> None:
        locked.append(_job_row_locked(lifecycle_plane.sessions, job_id))

    with store_watched(lifecycle_plane.app, watch, on="delete_prefix"):
        refused = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert refused.status_code == 403, refused.text
    assert locked == [False, False]  # the copied files, then the staged ones
    assert alice.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "failed"
    assert _steps(alice, model_id) == [0]


class _HeldStore(LocalObjectStore):
    """The control plane's own store, which holds the first copy of the weights in flight
    (the source read, the destination not yet written) until the test lets it go, as a
    slow store's copy would be: an observer that stretches the copy in time, not a fake."""

    def __init__(self, root: Path, copying: threading.Event, go: threading.Event) -> None:
        super().__init__(root)
        self._copying, self._go = copying, go
        self._held = False

    def copy(self, source_key: str, dest_key: str) -> int:
        if self._held or not source_key.endswith("/adapter_model.safetensors"):
            return super().copy(source_key, dest_key)
        self._held = True
        data = self.get_bytes(source_key)
        self._copying.set()
        assert self._go.wait(60)
        self.put_bytes(dest_key, data)
        return len(data)


def test_a_stale_attempt_copying_after_the_commit_leaves_the_committed_files(
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
) -> None:
    """Attempt 1 passes the lease check and starts copying; its lease runs out, attempt 2
    commits the step; attempt 1's copy then goes on. It must not land on attempt 2's files
    (the same sizes: only the bytes differ)."""
    alice = who()
    model_id = str(alice.create_model()["id"])
    first = worker_client(model_id)
    job_id = leased_job(alice, first, model_id)
    stale = {**ADAPTER, "adapter_model.safetensors": b"\x00" * len(WEIGHTS)}
    first.stage(job_id, stale)
    stale_completion = _completion()
    stale_completion["files"] = [
        {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
        for name, data in stale.items()
    ]
    copying, go = threading.Event(), threading.Event()
    answers: list[int] = []
    real = lifecycle_plane.app.state.store
    lifecycle_plane.app.state.store = _HeldStore(real.root, copying, go)
    try:
        late = threading.Thread(
            target=lambda: answers.append(
                first.http.post(f"/jobs/{job_id}/complete", json=stale_completion).status_code
            )
        )
        late.start()
        assert copying.wait(60)
        # Attempt 1 is copying; its worker went silent and the lease ran out.
        with lifecycle_plane.sessions() as session:
            job = session.get_one(TrainingJob, job_id)
            job.lease_expires_at = utcnow() - timedelta(seconds=1)
            session.commit()
            queue.expire_leases(session)
        second = worker_client(model_id)
        leased = second.lease()
        assert (leased["id"], leased["attempt"]) == (job_id, 2)
        for name, data in ADAPTER.items():
            staged = second.http.put(
                f"/jobs/{job_id}/files/{name}", params={"attempt": 2}, content=data
            )
            assert staged.status_code == 204, staged.text
        committed = second.http.post(
            f"/jobs/{job_id}/complete", json={**_completion(), "attempt": 2}
        )
        assert committed.status_code == 200, committed.text
        go.set()  # attempt 1's copy goes on, after the commit
        late.join(60)
    finally:
        go.set()
        lifecycle_plane.app.state.store = real
    assert answers == [409]  # its lease is lost: it commits nothing
    assert _steps(alice, model_id) == [0, 1]
    downloaded = alice.http.get(
        f"/v1/models/{model_id}/checkpoints/1/files/adapter_model.safetensors",
        follow_redirects=True,
    )
    assert downloaded.content == WEIGHTS
    listed = second.http.get(f"/models/{model_id}/checkpoints/1/files")
    assert listed.status_code == 200, listed.text
    assert [item["name"] for item in listed.json()["data"]] == sorted(ADAPTER)
    loaded = second.http.get(f"/models/{model_id}/checkpoints/1/files/adapter_model.safetensors")
    assert loaded.content == WEIGHTS
    # What attempt 1 copied lies beside the committed files: the sweep takes it, not them.
    with lifecycle_plane.sessions() as session:
        garbage.collect_garbage(
            session, store=lifecycle_store, written_before=utcnow() + timedelta(minutes=1)
        )
    left = [
        info.key
        for info in lifecycle_store.list()
        if f"/models/{model_id}/checkpoints/" in info.key
    ]
    assert len(left) == len(ADAPTER)
    assert len({key.rpartition("/")[0] for key in left}) == 1
    downloaded = alice.http.get(
        f"/v1/models/{model_id}/checkpoints/1/files/adapter_model.safetensors",
        follow_redirects=True,
    )
    assert downloaded.content == WEIGHTS


class _ReadCountingStore(LocalObjectStore):
    """The control plane's own store, noting the keys of every object read back whole: an
    observer, not a fake."""

    def __init__(self, root: Path, reads: list[str]) -> None:
        super().__init__(root)
        self._reads = reads

    def iter_chunks(self, key: str, *, chunk_size: int = 1 << 20) -> Iterator[bytes]:
        self._reads.append(key)
        return super().iter_chunks(key, chunk_size=chunk_size)


def test_the_commit_checks_the_digests_recorded_at_staging_without_reading_the_files_back(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
) -> None:
    """complete() read every staged byte back to hash it (0.44 s per 64 MiB on SeaweedFS):
    the size and SHA-256 are now recorded as the upload streams through the control plane."""
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    reads: list[str] = []
    real = lifecycle_plane.app.state.store
    lifecycle_plane.app.state.store = _ReadCountingStore(real.root, reads)
    try:
        committed = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    finally:
        lifecycle_plane.app.state.store = real
    assert committed.status_code == 200, committed.text
    assert [key for key in reads if "/attempts/1/" in key] == []
    assert _steps(alice, model_id) == [0, 1]


def test_a_staged_file_removed_while_the_commit_copies_is_a_conflict_that_a_retry_fixes(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    """The file gone between the check and its copy answered 404, as if the job or the route
    did not exist; it is a 409 now, nothing committed, and the job stays the worker's."""
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    staged = [
        info.key
        for info in lifecycle_store.list()
        if f"jobs/{job_id}/attempts/1/" in info.key and info.key.endswith(".safetensors")
    ]

    def remove_the_weights() -> None:
        for key in staged:
            lifecycle_store.delete(key)

    with store_watched(lifecycle_plane.app, remove_the_weights, on="copy"):
        refused = worker.http.post(f"/jobs/{job_id}/complete", json=_completion())
    assert refused.status_code == 409, refused.text
    message = refused.json()["error"]["message"]
    assert "adapter_model.safetensors was removed from the staged files" in message
    assert str(lifecycle_store.root) not in refused.text
    _still_running_with_nothing_committed(alice, model_id, job_id)

    _uploads_again_and_commits(alice, worker, model_id, job_id)

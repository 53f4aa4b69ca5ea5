"""An object lost or damaged after its row was committed is reported by the next read, never
served as if whole: the checkpoint's file listing and downloads (a tenant's) and the worker's
listing (how a worker loads a step) answer 500 ``object_damaged`` naming the step and what to
do, with no key or path of the store; and ``skytrain storage check`` lists the row."""

from __future__ import annotations

import asyncio
import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from skytrain_backend.config import Settings
from skytrain_backend.errors import ObjectDamaged
from skytrain_backend.storage import LocalObjectStore, keys
from skytrain_backend.worker.client import ControlPlaneClient
from tests.api.support import sft_trajectory
from tests.fixtures.cli import run_cli
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import OnWorker, Who, WorkerClient, committed_prefix, leased_job

ADAPTER = {
    "adapter_config.json": b'{"r": 8}',
    "adapter_model.safetensors": bytes(range(256)) * 16,
}


def _committed_step(alice: Who, worker: WorkerClient, model_id: str) -> str:
    """Train step 1 as a worker does (lease, upload, complete); the checkpoint's id."""
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    completed = worker.complete(job_id, ADAPTER, step=1)
    assert completed.status_code == 200, completed.text
    return str(completed.json()["checkpoint_id"])


def _damaged(response: httpx.Response, store: LocalObjectStore) -> str:
    """A 500 ``object_damaged`` answer naming no path or key of the store: its text."""
    assert response.status_code == 500, response.text
    assert response.json()["error"]["type"] == "object_damaged"
    assert str(store.root) not in response.text and "tenants/" not in response.text
    return response.text


def _delete_one(store: LocalObjectStore, prefix: str) -> None:
    store.delete(prefix + "adapter_model.safetensors")


def _delete_all(store: LocalObjectStore, prefix: str) -> None:
    store.delete_prefix(prefix)


def _cut_short(store: LocalObjectStore, prefix: str) -> None:
    store.put_bytes(
        prefix + "adapter_model.safetensors", ADAPTER["adapter_model.safetensors"][:100]
    )


LOST_FILE = {
    "one file deleted": "adapter_model.safetensors is missing",
    "every file deleted": "adapter_config.json is missing",
    "a file cut short": "adapter_model.safetensors holds 100 bytes, not 4096",
}
LOSSES: dict[str, Callable[[LocalObjectStore, str], None]] = {
    "one file deleted": _delete_one,
    "every file deleted": _delete_all,
    "a file cut short": _cut_short,
}


@pytest.mark.parametrize("loss", list(LOSSES))
def test_a_checkpoint_lost_after_its_commit_is_reported_by_the_next_read(
    on_worker: OnWorker,
    loss: str,
    lifecycle_store: LocalObjectStore,
    lifecycle_settings: Settings,
    lifecycle_plane: ServedPlane,
) -> None:
    alice, model_id, worker = on_worker
    checkpoint_id = _committed_step(alice, worker, model_id)
    listing = f"/v1/models/{model_id}/checkpoints/1/files"
    assert alice.http.get(listing).status_code == 200
    assert checkpoint_id not in run_cli(lifecycle_settings, "storage", "check").stdout

    prefix = committed_prefix(
        lifecycle_plane.sessions, tenant_id=alice.tenant_id, model_id=model_id, step=1
    )
    LOSSES[loss](lifecycle_store, prefix)

    message = _damaged(alice.http.get(listing), lifecycle_store)
    assert f"step 1 of model {model_id} is damaged in the object store since its commit" in (
        message
    )
    assert LOST_FILE[loss] in message
    assert "skytrain storage check" in message
    downloaded = alice.http.get(f"{listing}/adapter_config.json", params={"redirect": "false"})
    _damaged(downloaded, lifecycle_store)
    # The worker asked to load the step (it moved, or restarted) is told the same.
    loading = worker.http.get(f"/models/{model_id}/checkpoints/1/files")
    _damaged(loading, lifecycle_store)

    checked = run_cli(lifecycle_settings, "storage", "check")
    assert checked.exit_code == 1, checked.stdout
    lines = [line for line in checked.stdout.splitlines() if checkpoint_id in line]
    assert len(lines) == (2 if loss == "every file deleted" else 1)
    state = "wrong size" if loss == "a file cut short" else "missing"
    assert all("checkpoint" in line and state in line for line in lines)


def test_storage_check_lists_a_pending_jobs_and_an_uploaded_files_lost_objects(
    who: Callable[[], Who],
    lifecycle_store: LocalObjectStore,
    lifecycle_settings: Settings,
) -> None:
    alice = who()
    model_id = str(alice.create_model()["id"])
    job_id = alice.queue_job(model_id)
    file_id = alice.http.post(
        "/v1/files", files={"file": ("d.jsonl", json.dumps(sft_trajectory()).encode())}
    ).json()["id"]
    lifecycle_store.delete(
        keys.job_input_key(tenant_id=alice.tenant_id, model_id=model_id, job_id=job_id)
    )
    lifecycle_store.delete(keys.file_key(tenant_id=alice.tenant_id, file_id=file_id))
    checked = run_cli(lifecycle_settings, "storage", "check")
    assert checked.exit_code == 1, checked.stdout
    (line,) = [line for line in checked.stdout.splitlines() if job_id in line]
    assert "job input" in line and "missing" in line
    (line,) = [line for line in checked.stdout.splitlines() if file_id in line]
    assert line.split()[1:4] == ["file", "-", "missing"], line  # kind, model, state


def test_a_file_changed_in_place_after_its_commit_is_refused_by_the_worker_loading_it(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
    lifecycle_settings: Settings,
    tmp_path: Path,
) -> None:
    """The same length, other bytes: no listing can tell, so the worker checks the SHA-256
    committed with the step as it downloads, and `storage check --read` reads it back."""
    alice, model_id, worker = on_worker
    checkpoint_id = _committed_step(alice, worker, model_id)
    prefix = committed_prefix(
        lifecycle_plane.sessions, tenant_id=alice.tenant_id, model_id=model_id, step=1
    )
    weights = ADAPTER["adapter_model.safetensors"]
    lifecycle_store.put_bytes(prefix + "adapter_model.safetensors", b"\xff" + weights[1:])
    token = worker.http.headers["Authorization"].removeprefix("Bearer ")

    async def load() -> None:
        client = ControlPlaneClient(lifecycle_plane.url, token, retry_for_s=0)
        try:
            listing = await client.list_checkpoint_files(model_id, 1)
            committed = {item["name"]: item["sha256"] for item in listing}
            assert committed == {n: hashlib.sha256(d).hexdigest() for n, d in ADAPTER.items()}
            good = await client.download_checkpoint_file(
                model_id,
                1,
                "adapter_config.json",
                tmp_path / "adapter_config.json",
                sha256=committed["adapter_config.json"],
            )
            assert good.read_bytes() == ADAPTER["adapter_config.json"]
            with pytest.raises(ObjectDamaged, match="SHA-256 other than the one committed"):
                await client.download_checkpoint_file(
                    model_id,
                    1,
                    "adapter_model.safetensors",
                    tmp_path / "adapter_model.safetensors",
                    sha256=committed["adapter_model.safetensors"],
                )
        finally:
            await client.aclose()

    asyncio.run(load())
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json"]  # no damaged file

    assert (
        checkpoint_id not in run_cli(lifecycle_settings, "storage", "check").stdout
    )  # sizes all match
    checked = run_cli(lifecycle_settings, "storage", "check", "--read")
    assert checked.exit_code == 1, checked.stdout
    (line,) = [line for line in checked.stdout.splitlines() if checkpoint_id in line]
    assert "corrupt" in line


def test_storage_check_lists_an_uploaded_file_cut_short_or_changed_after_its_upload(
    who: Callable[[], Who],
    lifecycle_store: LocalObjectStore,
    lifecycle_settings: Settings,
) -> None:
    alice = who()
    uploaded = [
        alice.http.post(
            "/v1/files", files={"file": (name, json.dumps(sft_trajectory()).encode())}
        ).json()
        for name in ("short.jsonl", "changed.jsonl")
    ]
    short, changed = (file["id"] for file in uploaded)
    assert short not in run_cli(lifecycle_settings, "storage", "check", "--read").stdout
    short_key, changed_key = (
        keys.file_key(tenant_id=alice.tenant_id, file_id=file_id) for file_id in (short, changed)
    )
    whole = lifecycle_store.get_bytes(short_key)
    lifecycle_store.put_bytes(short_key, whole[:10])
    # Changed in place, the same size: only reading it back tells.
    same_size = lifecycle_store.get_bytes(changed_key).replace(b'"4"', b'"5"')
    lifecycle_store.put_bytes(changed_key, same_size)

    checked = run_cli(lifecycle_settings, "storage", "check")
    assert checked.exit_code == 1, checked.stdout
    (line,) = [line for line in checked.stdout.splitlines() if short in line]
    # kind, model, state, bytes recorded, bytes found
    assert line.split()[1:7] == ["file", "-", "wrong", "size", str(len(whole)), "10"], line
    assert changed not in checked.stdout

    read = run_cli(lifecycle_settings, "storage", "check", "--read")
    assert read.exit_code == 1, read.stdout
    (line,) = [line for line in read.stdout.splitlines() if changed in line]
    assert line.split()[1:4] == ["file", "-", "corrupt"], line


def _file_cut_at_a_line(store: LocalObjectStore, key: str) -> None:
    store.put_bytes(key, store.get_bytes(key).split(b"\n")[0] + b"\n")


def _file_changed_in_place(store: LocalObjectStore, key: str) -> None:
    store.put_bytes(key, store.get_bytes(key).replace(b'"4"', b'"5"'))


FILE_LOSSES: dict[str, Callable[[LocalObjectStore, str], None]] = {
    "deleted": LocalObjectStore.delete,
    "cut short at a line": _file_cut_at_a_line,
    "changed in place": _file_changed_in_place,
}


@pytest.mark.parametrize("loss", list(FILE_LOSSES))
def test_an_uploaded_file_damaged_after_its_upload_is_reported_by_the_job_reading_it(
    who: Callable[[], Who], lifecycle_store: LocalObjectStore, loss: str
) -> None:
    """A file cut short at a line boundary, or changed in place, read as fewer or other
    trajectories: the SFT job trained on them as if they were what was uploaded."""
    alice = who()
    model_id = str(alice.create_model()["id"])
    lines = b"".join(json.dumps(sft_trajectory(answer)).encode() + b"\n" for answer in "47")
    uploaded = alice.http.post("/v1/files", files={"file": ("d.jsonl", lines)}).json()
    key = keys.file_key(tenant_id=alice.tenant_id, file_id=uploaded["id"])
    FILE_LOSSES[loss](lifecycle_store, key)

    job = alice.http.post(
        "/v1/sft-training-jobs",
        json={"model_id": model_id, "training_data_url": uploaded["uri"]},
    )
    _damaged(job, lifecycle_store)
    message = job.json()["error"]["message"]
    assert f"file {uploaded['id']} is damaged in the object store since its upload" in message
    assert "POST /v1/files" in message
    assert "skytrain storage check" in message
    listed = alice.http.get("/v1/training-jobs", params={"model_id": model_id}).json()["data"]
    assert listed == []
    prefix = keys.model_prefix(tenant_id=alice.tenant_id, model_id=model_id)
    assert lifecycle_store.list(prefix) == []


def test_a_job_input_lost_after_it_was_queued_is_reported_to_the_worker_reading_it(
    on_worker: OnWorker, lifecycle_store: LocalObjectStore
) -> None:
    """A job whose input the store lost answered the worker 404 "the object store lacks an
    object this needs: retry shortly", as if it might come back."""
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    lifecycle_store.delete(
        keys.job_input_key(tenant_id=alice.tenant_id, model_id=model_id, job_id=job_id)
    )
    read = worker.http.get(f"/jobs/{job_id}/input", headers={"Accept-Encoding": "zstd"})
    _damaged(read, lifecycle_store)
    message = read.json()["error"]["message"]
    assert f"the input of job {job_id} is gone from the object store since it was queued" in message
    assert "skytrain storage check" in message

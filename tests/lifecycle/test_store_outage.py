"""The object store stopping in the middle of an upload loses nothing: the request is answered
503 with a reference to the control plane's log (never the store's address or keys), nothing
is half stored, and the same request succeeds once the store is back. The store is a real S3
server (SeaweedFS) that the test stops and starts again; the control plane is the real app
over HTTP, on SQLite (the database is not what these tests test)."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import timedelta

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.storage import ObjectStore, open_object_store
from skytrain_backend.storage import keys as object_keys
from skytrain_backend.storage.s3 import MULTIPART_THRESHOLD
from tests.api.support import group
from tests.fixtures.seaweedfs import SeaweedFS
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread

pytestmark = [pytest.mark.e2e, pytest.mark.s3]

ADAPTER = {
    "adapter_config.json": b'{"r": 8}',
    "adapter_model.safetensors": os.urandom(3 * 1024 * 1024),
}


@dataclass
class Plane:
    """A control plane on a store the test can stop: a tenant's client, rows and objects."""

    http: httpx.Client
    url: str
    tenant_id: str
    sessions: sessionmaker[Session]
    store: ObjectStore
    s3: SeaweedFS
    bucket: str

    def create_model(self) -> str:
        response = self.http.post(
            "/v1/models", json={"project": "outage", "name": "m", "base_model": "tests/base"}
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])

    def objects(self, model_id: str) -> list[str]:
        prefix = object_keys.model_prefix(tenant_id=self.tenant_id, model_id=model_id)
        return [info.key.removeprefix(prefix) for info in self.store.list(prefix)]


@pytest.fixture
def plane(private_seaweedfs: SeaweedFS, make_settings: MakeSettings) -> Iterator[Plane]:
    bucket = private_seaweedfs.make_bucket()
    # S3 on the test's own server, which the tests stop and start again.
    settings = make_settings(
        storage={
            "object_store_url": f"s3://{bucket}/skytrain",
            "s3_endpoint_url": private_seaweedfs.endpoint,
        },
        # The worker of these tests is the test itself, which neither heartbeats nor renews.
        scheduler={"worker_heartbeat_timeout_s": 3600, "job_lease_s": 3600},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    sessions = session_factory(engine)
    with sessions() as session:
        row, key = api_keys.create_key(session, tenant_name="alice")
    with (
        serve_in_thread(create_app(settings)) as url,
        httpx.Client(base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120) as http,
    ):
        yield Plane(
            http=http,
            url=url,
            tenant_id=row.tenant_id,
            sessions=sessions,
            store=open_object_store(settings.storage.resolved_object_store_url, settings),
            s3=private_seaweedfs,
            bucket=bucket,
        )
    engine.dispose()


def _assert_store_unreachable(response: httpx.Response, plane: Plane) -> None:
    """A 503 that says the store cannot be reached, with a reference for the operator's log,
    and nothing of the store's own words (its address, bucket or keys)."""
    assert response.status_code == 503, response.text
    error = response.json()["error"]
    assert error["type"] == "storage_unavailable"
    assert error["message"].startswith("the object store cannot be reached (reference ")
    assert int(response.headers["retry-after"]) >= 1
    for secret in (plane.s3.endpoint, f"{plane.s3.ports['s3']}", plane.bucket, "tenants/"):
        assert secret not in response.text


@pytest.mark.slow
def test_a_batch_sent_while_the_store_stops_is_refused_whole_and_taken_once_it_is_back(
    plane: Plane,
) -> None:
    model_id = plane.create_model()
    body = json.dumps(
        {"model_id": model_id, "trajectory_groups": [group(1.0, 0.0) for _ in range(400)]}
    ).encode()

    def sent_while_the_store_stops() -> Iterator[bytes]:
        yield body[: len(body) // 2]
        plane.s3.stop()  # the client is still sending the batch
        yield body[len(body) // 2 :]

    refused = plane.http.post(
        "/v1/training-jobs",
        content=sent_while_the_store_stops(),
        headers={"content-type": "application/json"},
    )
    _assert_store_unreachable(refused, plane)
    listed = plane.http.get("/v1/training-jobs", params={"model_id": model_id})
    assert listed.status_code == 200 and listed.json()["data"] == []  # no row for it

    plane.s3.start_again()
    assert plane.objects(model_id) == []  # and no object
    accepted = plane.http.post(
        "/v1/training-jobs", content=body, headers={"content-type": "application/json"}
    )
    assert accepted.status_code == 201, accepted.text
    job = accepted.json()
    listed = plane.http.get("/v1/training-jobs", params={"model_id": model_id}).json()["data"]
    assert [(j["id"], j["status"]) for j in listed] == [(job["id"], "queued")]
    assert plane.objects(model_id) == [f"jobs/{job['id']}/input.jsonl"]


@pytest.mark.slow
def test_a_checkpoint_uploaded_while_the_store_stops_is_committed_once_it_is_back(
    plane: Plane,
) -> None:
    model_id = plane.create_model()
    with plane.sessions() as session:
        worker, token = worker_rows.create_worker(
            session, provider="manual", base_model="tests/base", max_models=8, status="ready"
        )
        session.get_one(Model, model_id).worker_id = worker.id
        session.commit()
    job_id = plane.http.post(
        "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
    ).json()["id"]
    with httpx.Client(
        base_url=f"{plane.url}/v1/worker",
        headers={"Authorization": f"Bearer {token}"},
        timeout=120,
    ) as as_worker:
        assert as_worker.post("/jobs/lease", json={}).json()["job"]["id"] == job_id
        (first, data), (second, big) = ADAPTER.items()
        staged = as_worker.put(f"/jobs/{job_id}/files/{first}", params={"attempt": 1}, content=data)
        assert staged.status_code == 204, staged.text

        plane.s3.stop()  # between the checkpoint's files, as a worker uploads them
        refused = as_worker.put(
            f"/jobs/{job_id}/files/{second}", params={"attempt": 1}, content=big
        )
        _assert_store_unreachable(refused, plane)
        files = [
            {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in ADAPTER.items()
        ]
        completion = {"attempt": 1, "step": 1, "metrics": {}, "files": files}
        not_committed = as_worker.post(f"/jobs/{job_id}/complete", json=completion)
        _assert_store_unreachable(not_committed, plane)
        # The job is still the worker's, and no step was committed: its retries can finish it.
        assert plane.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "running"
        steps = plane.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
        assert [checkpoint["step"] for checkpoint in steps] == [0]

        plane.s3.start_again()  # the worker's retries, once the store is back
        staged = as_worker.put(f"/jobs/{job_id}/files/{second}", params={"attempt": 1}, content=big)
        assert staged.status_code == 204, staged.text
        committed = as_worker.post(f"/jobs/{job_id}/complete", json=completion)
        assert committed.status_code == 200, committed.text
        assert committed.json()["step"] == 1

    assert plane.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "succeeded"
    listed = plane.http.get(f"/v1/models/{model_id}/checkpoints/1/files").json()["data"]
    assert {item["name"]: item["size"] for item in listed} == {
        name: len(data) for name, data in ADAPTER.items()
    }
    for name, data in ADAPTER.items():
        # A presigned redirect to the store: the bytes come from S3 itself.
        downloaded = plane.http.get(
            f"/v1/models/{model_id}/checkpoints/1/files/{name}", follow_redirects=True
        )
        assert downloaded.status_code == 200 and downloaded.content == data
    # Nothing of the attempt's staging is left once the step is committed.
    # The step's files lie in the committing attempt's own directory of it.
    step = f"checkpoints/1-{object_keys.attempt_writer(job_id=job_id, attempt=1)}/"
    assert sorted(plane.objects(model_id)) == sorted(
        [f"jobs/{job_id}/input.jsonl"] + [f"{step}{name}" for name in ADAPTER]
    )


def _incompressible_groups(count: int, text_bytes: int) -> list[dict[str, object]]:
    """Groups whose prompts are random text: zstd cannot shrink them much, so the stored
    batch is about as large as the JSON (over the store's multipart threshold)."""
    groups = []
    for _ in range(count):
        made = group(1.0, 0.0)
        for trajectory in made["trajectories"]:
            prompt = base64.b64encode(os.urandom(text_bytes * 3 // 4)).decode()
            trajectory["messages_and_choices"][1]["content"] = prompt
        groups.append(made)
    return groups


def _stop_once_a_part_is_in(plane: Plane, stopped: list[bool]) -> None:
    """Stop the store as soon as the control plane's multipart upload of the batch has a
    part in it: frozen at once (SIGSTOP: the parts still to come can go nowhere), then
    killed. ``stopped`` says whether that happened."""
    client = plane.s3.client()
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        for upload in client.list_multipart_uploads(Bucket=plane.bucket).get("Uploads", []):
            parts = client.list_parts(
                Bucket=plane.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
            )
            if parts.get("Parts"):
                assert plane.s3.process is not None
                plane.s3.process.send_signal(signal.SIGSTOP)
                plane.s3.stop()
                stopped.append(True)
                return
        time.sleep(0.05)


@pytest.mark.slow
def test_a_multipart_batch_cut_by_the_store_stopping_commits_nothing_and_retries_whole(
    plane: Plane,
) -> None:
    model_id = plane.create_model()
    groups = _incompressible_groups(128, 176 * 1024)  # ~45 MB of JSON: a multipart batch
    body = json.dumps({"model_id": model_id, "trajectory_groups": groups}).encode()
    assert len(body) > 2.5 * MULTIPART_THRESHOLD
    stopped: list[bool] = []
    watcher = threading.Thread(target=_stop_once_a_part_is_in, args=(plane, stopped))
    watcher.start()
    try:
        refused = plane.http.post(
            "/v1/training-jobs", content=body, headers={"content-type": "application/json"}
        )
    finally:
        watcher.join()
    assert stopped == [True]
    _assert_store_unreachable(refused, plane)
    plane.s3.start_again()
    listed = plane.http.get("/v1/training-jobs", params={"model_id": model_id})
    assert listed.status_code == 200 and listed.json()["data"] == []  # no row
    assert plane.objects(model_id) == []  # and no object: the parts never became one

    accepted = plane.http.post(
        "/v1/training-jobs", content=body, headers={"content-type": "application/json"}
    )
    assert accepted.status_code == 201, accepted.text
    job_id = accepted.json()["id"]
    assert plane.objects(model_id) == [f"jobs/{job_id}/input.jsonl"]
    prefix = object_keys.model_prefix(tenant_id=plane.tenant_id, model_id=model_id)
    assert plane.store.list(prefix)[0].size > MULTIPART_THRESHOLD  # in parts this time too
    # What the cut upload left (its parts) is the sweep's: aborted as a stale upload.
    assert plane.store.abort_stale_uploads(started_before=utcnow() + timedelta(hours=1)) >= 1

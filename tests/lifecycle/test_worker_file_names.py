"""The worker routes name stored files by one path segment: any other name is a 400 that says
so, before the store is asked (it used to reach the store and come back as a 502), and an
upload under such a name stores nothing."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from skytrain_backend.storage import LocalObjectStore, keys
from tests.api.support import add_checkpoint
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import OnWorker, Who, WorkerClient

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x00" * 64}
# As sent in the path: "..", "." and a backslash, percent-encoded so that the client sends
# them as they are.
BAD_NAMES = ["%2E%2E", "%2E", "a%5Cb"]


@pytest.mark.parametrize("raw", BAD_NAMES)
def test_a_worker_reading_a_checkpoint_file_by_a_bad_name_gets_a_400(
    raw: str,
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice = who()
    model_id = str(alice.create_model()["id"])
    add_checkpoint(
        lifecycle_plane.sessions,
        lifecycle_store,
        tenant_id=alice.tenant_id,
        model_id=model_id,
        step=1,
        files=ADAPTER,
    )
    worker = worker_client(model_id)
    good = worker.http.get(f"/models/{model_id}/checkpoints/1/files/adapter_config.json")
    assert good.status_code == 200, good.text
    assert good.content == ADAPTER["adapter_config.json"]

    bad = worker.http.get(f"/models/{model_id}/checkpoints/1/files/{raw}")
    assert bad.status_code == 400, bad.text
    assert "is not a checkpoint file name" in bad.json()["error"]["message"]


def test_a_worker_uploading_under_a_bad_name_gets_a_400_and_nothing_is_stored(
    on_worker: OnWorker,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice, model_id, worker = on_worker
    alice.queue_job(model_id)
    job_id = worker.lease()["id"]

    bad = worker.http.put(f"/jobs/{job_id}/files/%2E%2E", params={"attempt": 1}, content=b"x")
    assert bad.status_code == 400, bad.text
    assert "is not a checkpoint file name" in bad.json()["error"]["message"]
    prefix = keys.model_prefix(tenant_id=alice.tenant_id, model_id=model_id) + "jobs/"
    assert [info.key for info in lifecycle_store.list(prefix)] == [
        keys.job_input_key(tenant_id=alice.tenant_id, model_id=model_id, job_id=job_id)
    ]

"""A store that fails while a job's checkpoint is being committed ends the job with that
cause, and leaves neither staged files nor half a checkpoint behind."""

from __future__ import annotations

from sqlalchemy import select

from skytrain_backend.db.models import Checkpoint
from skytrain_backend.storage import LocalObjectStore, keys
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import OnWorker, leased_job, undeletable

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x01" * 512}


def test_a_store_failure_during_commit_fails_the_job_with_its_cause_and_no_leftovers(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)

    model_prefix = keys.model_prefix(tenant_id=alice.tenant_id, model_id=model_id)
    # The model's directory takes no new entry: its checkpoints/ directory cannot be made.
    with undeletable(lifecycle_store.root / model_prefix):
        completed = worker.complete(job_id, ADAPTER, step=1)
    assert completed.status_code == 502
    # The worker is told the store failed, with a reference to the control plane's log: never
    # the store's own words (its paths and keys).
    assert completed.json()["error"]["type"] == "storage_error"
    assert str(lifecycle_store.root) not in completed.text

    job = alice.http.get(f"/v1/training-jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert "the object store failed while saving the checkpoint of step 1" in job["error"]
    events = alice.http.get(f"/v1/training-jobs/{job_id}/events").json()["data"]
    assert events[-1]["type"] == "training_failed"
    assert events[-1]["data"]["error_message"] == job["error"]
    assert [info.key for info in lifecycle_store.list(model_prefix + "checkpoints/")] == []
    assert [info.key for info in lifecycle_store.list(f"{model_prefix}jobs/{job_id}/")] == [
        f"{model_prefix}jobs/{job_id}/input.jsonl"  # the job's input stays with its row
    ]
    with lifecycle_plane.sessions() as session:
        steps = session.scalars(select(Checkpoint.step).where(Checkpoint.model_id == model_id))
        assert list(steps) == [0]
    # The worker's own report of the failure finds the job already ended.
    reported = worker.http.post(
        f"/jobs/{job_id}/fail", json={"attempt": 1, "error_message": "502", "retryable": True}
    )
    assert reported.status_code == 409
    assert alice.http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "failed"

"""Training jobs: RL and SFT creation (input stored, job queued), listing, cancel, events."""

from __future__ import annotations

import json

import httpx
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import jobs
from skytrain_backend.storage import ObjectStore, compression, keys
from tests.api.support import add_checkpoint, group, sft_trajectory
from tests.fixtures.callers import Caller
from tests.fixtures.services import ON_EVERY_BACKEND

pytestmark = ON_EVERY_BACKEND


def test_rl_job_is_queued_with_its_input_stored(caller: Caller, object_store: ObjectStore) -> None:
    model_id = caller.create_model()["id"]
    response = caller.http.post(
        "/v1/training-jobs",
        json={
            "model_id": model_id,
            "trajectory_groups": [group(1.0, 0.0), group(0.2, 0.8, 0.5)],
            "config": {"learning_rate": 1e-5},
        },
    )
    assert response.status_code == 201
    job = response.json()
    assert (job["status"], job["kind"], job["step"]) == ("queued", "rl", None)
    assert (job["num_groups"], job["num_trajectories"]) == (2, 5)
    assert job["config"]["learning_rate"] == 1e-5
    key = keys.job_input_key(tenant_id=caller.key.tenant_id, model_id=model_id, job_id=job["id"])
    stored = object_store.get_bytes(key)
    assert stored.startswith(compression.MAGIC)  # zstd-compressed JSONL
    lines = compression.decompress(stored).splitlines()
    assert [len(json.loads(line)["trajectories"]) for line in lines] == [2, 3]
    assert caller.http.get(f"/v1/training-jobs/{job['id']}").json() == job


def test_experimental_config_is_translated_and_unknown_keys_refused(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    accepted = caller.http.post(
        "/v1/training-jobs",
        json={
            "model_id": model_id,
            "trajectory_groups": [group()],
            "experimental_config": {"learning_rate": 2e-6, "ppo": False, "epsilon": None},
        },
    )
    assert accepted.status_code == 201
    assert accepted.json()["config"]["loss_fn"] == "cispo"
    assert accepted.json()["config"]["learning_rate"] == 2e-6
    refused = caller.http.post(
        "/v1/training-jobs",
        json={
            "model_id": model_id,
            "trajectory_groups": [group()],
            "experimental_config": {"kl_ref_adapter_path": "/tmp/adapter"},
        },
    )
    assert refused.status_code == 400
    assert "kl_ref_adapter_path" in refused.json()["error"]["message"]


ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x00" * 64}


def test_art_kl_reference_is_a_checkpoint_of_the_jobs_own_model(
    caller: Caller,
    other: Caller,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    """ART's KL reference keys: a step or a checkpoint id of the job's model is taken (the id
    as its step); a missing step, a path, another model's or another tenant's checkpoint is a
    400 naming the key; two of the keys at once are refused."""
    mine = caller.create_model(name="mine")["id"]
    sibling = caller.create_model(name="sibling")["id"]
    theirs = other.create_model(name="theirs")["id"]
    for tenant, model_id in ((caller, mine), (caller, sibling), (other, theirs)):
        add_checkpoint(
            db_sessions,
            object_store,
            tenant_id=tenant.key.tenant_id,
            model_id=model_id,
            step=1,
            files=ADAPTER,
        )

    def send(tenant: Caller, model_id: str, **art: object) -> httpx.Response:
        return tenant.http.post(
            "/v1/training-jobs",
            json={
                "model_id": model_id,
                "trajectory_groups": [group()],
                "experimental_config": {"kl_penalty_coef": 0.1, **art},
            },
        )

    def checkpoint_id(tenant: Caller, model_id: str) -> str:
        listed = tenant.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
        (step_1,) = [checkpoint for checkpoint in listed if checkpoint["step"] == 1]
        return str(step_1["id"])

    by_step = send(caller, mine, kl_penalty_reference_step=1)
    assert by_step.status_code == 201, by_step.text
    assert by_step.json()["config"]["kl_penalty_reference_step"] == 1
    by_id = send(caller, mine, kl_ref_adapter_path=checkpoint_id(caller, mine))
    assert by_id.status_code == 201, by_id.text
    assert by_id.json()["config"]["kl_penalty_reference_step"] == 1
    lagged = send(caller, mine, kl_penalty_step_lag=1)
    assert lagged.status_code == 201 and lagged.json()["config"]["kl_penalty_step_lag"] == 1

    missing = send(caller, mine, kl_penalty_reference_step=7)
    assert missing.status_code == 400
    assert (
        f"kl_penalty_reference_step=7: model {mine} has no checkpoint at step 7"
        in (missing.json()["error"]["message"])
    )
    for reference in (
        "/etc/passwd",
        "../../checkpoints/1",
        checkpoint_id(caller, sibling),
        checkpoint_id(other, theirs),
    ):
        refused = send(caller, mine, kl_ref_adapter_path=reference)
        assert refused.status_code == 400, reference
        message = refused.json()["error"]["message"]
        assert "kl_ref_adapter_path" in message and "is not a checkpoint of model" in message
        assert "/etc" not in message and "../" not in message
    both = send(caller, mine, kl_penalty_reference_step=1, kl_penalty_step_lag=1)
    assert both.status_code == 400
    assert (
        "only one of kl_penalty_reference_step and kl_penalty_step_lag"
        in (both.json()["error"]["message"])
    )
    # Nothing of the refused jobs was kept: the three accepted ones are the model's jobs.
    listed = caller.http.get("/v1/training-jobs", params={"model_id": mine}).json()["data"]
    assert len(listed) == 3


def test_jobs_list_by_model_and_status(caller: Caller) -> None:
    first = caller.create_model(name="a")["id"]
    second = caller.create_model(name="b")["id"]
    created = [
        caller.http.post(
            "/v1/training-jobs", json={"model_id": m, "trajectory_groups": [group()]}
        ).json()["id"]
        for m in (first, second, first)
    ]
    caller.http.post(f"/v1/training-jobs/{created[2]}/cancel")
    of_first = caller.http.get("/v1/training-jobs", params={"model_id": first}).json()
    assert [j["id"] for j in of_first["data"]] == [created[0], created[2]]
    queued = caller.http.get("/v1/training-jobs", params={"status": "queued"}).json()
    assert [j["id"] for j in queued["data"]] == created[:2]
    newest = caller.http.get("/v1/training-jobs", params={"order": "desc", "limit": 1}).json()
    assert newest["data"][0]["id"] == created[2]
    assert newest["has_more"] is True


def test_cancel_queued_job_ends_it_with_a_failed_event(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    job = caller.http.post(
        "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
    ).json()
    cancelled = caller.http.post(f"/v1/training-jobs/{job['id']}/cancel")
    assert cancelled.status_code == 200
    assert cancelled.json()["status"] == "cancelled"
    assert cancelled.json()["finished_at"] is not None
    events = caller.http.get(f"/v1/training-jobs/{job['id']}/events").json()["data"]
    assert [e["type"] for e in events] == ["training_failed"]
    again = caller.http.post(f"/v1/training-jobs/{job['id']}/cancel")
    assert again.status_code == 409


def test_cancel_running_job_asks_its_worker_to_stop(
    caller: Caller, db_sessions: sessionmaker[Session]
) -> None:
    job_id = caller.queue_job()
    with db_sessions() as session:
        job = jobs.get_job(session, tenant_id=caller.key.tenant_id, job_id=job_id)
        job.status = "running"
        session.commit()
    response = caller.http.post(f"/v1/training-jobs/{job_id}/cancel")
    assert response.json()["status"] == "running"
    with db_sessions() as session:
        assert jobs.get_job(session, tenant_id=caller.key.tenant_id, job_id=job_id).cancel_requested


def test_events_page_with_string_cursors(
    caller: Caller, db_sessions: sessionmaker[Session]
) -> None:
    job_id = caller.queue_job()
    with db_sessions() as session:
        jobs.add_event(session, job_id=job_id, type="training_started", data={"num_sequences": 2})
        for step in range(2):
            jobs.add_event(session, job_id=job_id, type="gradient_step", data={"loss": step})
        jobs.add_event(session, job_id=job_id, type="training_ended", data={"step": 1})
        session.commit()
    url = f"/v1/training-jobs/{job_id}/events"
    first = caller.http.get(url, params={"limit": 2}).json()
    assert [e["type"] for e in first["data"]] == ["training_started", "gradient_step"]
    assert all(isinstance(e["id"], str) for e in first["data"])
    assert first["has_more"] is True
    rest = caller.http.get(url, params={"after": first["data"][-1]["id"]}).json()
    assert [e["type"] for e in rest["data"]] == ["gradient_step", "training_ended"]
    assert rest["data"][0]["data"] == {"loss": 1}
    bad = caller.http.get(url, params={"after": "abc"})
    assert bad.status_code == 400


def test_sft_job_from_trajectories(caller: Caller, object_store: ObjectStore) -> None:
    model_id = caller.create_model()["id"]
    response = caller.http.post(
        "/v1/sft-training-jobs",
        json={
            "model_id": model_id,
            "trajectories": [sft_trajectory("4"), sft_trajectory("four")],
            "config": {"learning_rate": 1e-4, "batch_size": 2},
        },
    )
    assert response.status_code == 201
    job = response.json()
    assert (job["kind"], job["num_trajectories"], job["status"]) == ("sft", 2, "queued")
    assert job["config"]["batch_size"] == 2
    key = keys.job_input_key(tenant_id=caller.key.tenant_id, model_id=model_id, job_id=job["id"])
    answers = [
        json.loads(line)["messages_and_choices"][-1]["content"]
        for line in compression.decompress(object_store.get_bytes(key)).splitlines()
    ]
    assert answers == ["4", "four"]


def test_sft_job_from_an_uploaded_file(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    jsonl = "\n".join(json.dumps(sft_trajectory(str(n))) for n in range(3)) + "\n"
    upload = caller.http.post(
        "/v1/files", files={"file": ("data.jsonl", jsonl.encode(), "application/jsonl")}
    )
    assert upload.status_code == 201
    uploaded = upload.json()
    assert uploaded["uri"] == f"skytrain-file://{uploaded['id']}"
    response = caller.http.post(
        "/v1/sft-training-jobs", json={"model_id": model_id, "training_data_url": uploaded["uri"]}
    )
    assert response.status_code == 201
    assert response.json()["num_trajectories"] == 3


def test_sft_job_refuses_urls_it_cannot_read(caller: Caller) -> None:
    model_id = caller.create_model()["id"]
    artifact = caller.http.post(
        "/v1/sft-training-jobs",
        json={"model_id": model_id, "training_data_url": "wandb-artifact:///e/p/data:v0"},
    )
    assert artifact.status_code == 400
    assert "POST /v1/files" in artifact.json()["error"]["message"]
    unknown = caller.http.post(
        "/v1/sft-training-jobs",
        json={"model_id": model_id, "training_data_url": "skytrain-file://" + "0" * 32},
    )
    assert unknown.status_code == 404
    both = caller.http.post(
        "/v1/sft-training-jobs",
        json={
            "model_id": model_id,
            "trajectories": [sft_trajectory()],
            "training_data_url": "skytrain-file://x",
        },
    )
    assert both.status_code == 400
    assert "exactly one" in both.json()["error"]["message"]

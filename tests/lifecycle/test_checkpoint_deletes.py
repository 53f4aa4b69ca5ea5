"""Checkpoint deletes are all or nothing, and every part of the system agrees on a model's
latest step: the rows are committed deleted first (no ``uri`` left to read) and the files
removed after (again by the scheduler's sweep when the store fails), so no checkpoint row,
live or deleted, ever points at files that are gone."""

from __future__ import annotations

from collections.abc import Callable

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import Checkpoint
from skytrain_backend.storage import LocalObjectStore, keys
from tests.api.support import add_checkpoint
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import wait_until
from tests.lifecycle.conftest import Who, WorkerClient, step_files, undeletable

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x00" * 512}


def _trained(
    who: Who, sessions: sessionmaker[Session], store: LocalObjectStore, last_step: int
) -> dict[str, object]:
    model = who.create_model()
    for step in range(1, last_step + 1):
        add_checkpoint(
            sessions,
            store,
            tenant_id=who.tenant_id,
            model_id=str(model["id"]),
            step=step,
            files=ADAPTER,
        )
    return model


def _files(store: LocalObjectStore, who: Who, model_id: str, step: int) -> list[str]:
    return step_files(store, tenant_id=who.tenant_id, model_id=model_id, step=step)


def _deleted_rows(
    sessions: sessionmaker[Session], model_id: str
) -> dict[int, tuple[str | None, bool]]:
    """step -> (uri, purge_pending) of the model's deleted checkpoints."""
    with sessions() as session:
        rows = session.execute(
            select(Checkpoint.step, Checkpoint.uri, Checkpoint.purge_pending).where(
                Checkpoint.model_id == model_id, Checkpoint.deleted_at.is_not(None)
            )
        ).all()
    return {step: (uri, pending) for step, uri, pending in rows}


def test_a_store_failure_while_deleting_leaves_no_live_checkpoint_without_files(
    who: Callable[[], Who],
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice = who()
    model = _trained(alice, lifecycle_plane.sessions, lifecycle_store, 4)
    model_id, name = str(model["id"]), str(model["inference_name"])
    step4 = lifecycle_store.root / keys.checkpoint_prefix(
        tenant_id=alice.tenant_id, model_id=model_id, step=4
    )

    with undeletable(step4):
        response = alice.http.request(
            "DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [3, 4]}
        )
        assert response.status_code == 200, response.text
        assert response.json() == {"deleted_count": 2, "not_found_steps": []}

        listed = alice.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
        assert [c["step"] for c in listed] == [0, 1, 2]
        for step in (1, 2):  # every live checkpoint still has its files
            assert _files(lifecycle_store, alice, model_id, step)
        assert alice.http.get(f"/v1/models/{model_id}").json()["latest_step"] == 2
        for step in (3, 4):
            pinned = alice.http.get(f"/v1/models/{model_id}/checkpoints/{step}")
            assert pinned.status_code == 404
            assert "was deleted" in pinned.json()["error"]["message"]
            served = alice.http.post(
                "/v1/chat/completions",
                json={
                    "model": f"{name}:step{step}",
                    "messages": [{"role": "user", "content": "x"}],
                },
            )
            assert served.status_code == 404, served.text
            assert f"step {step} of model {name} was deleted" in served.json()["error"]["message"]
            assert "its latest step is 2" in served.json()["error"]["message"]
        assert not _files(lifecycle_store, alice, model_id, 3)
        assert _files(lifecycle_store, alice, model_id, 4)  # the store refused
        # The rows were committed before any file was touched: neither points at files, and
        # step 4 waits for the sweep (the old order, files first, left its uri in place).
        assert _deleted_rows(lifecycle_plane.sessions, model_id) == {
            3: (None, False),
            4: (None, True),
        }

    # Once the store works again, the scheduler's sweep removes what it could not, and only
    # then clears the mark.
    wait_until(
        lambda: _deleted_rows(lifecycle_plane.sessions, model_id)[4] == (None, False),
        what="the sweep deleting step 4's files",
        timeout_s=30,
    )
    assert not _files(lifecycle_store, alice, model_id, 4)


def test_heartbeat_and_next_job_use_the_latest_live_step(
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice = who()
    model_id = str(_trained(alice, lifecycle_plane.sessions, lifecycle_store, 2)["id"])
    worker = worker_client(model_id)
    deleted = alice.http.request(
        "DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [2]}
    )
    assert deleted.json() == {"deleted_count": 1, "not_found_steps": []}

    beat = worker.http.post("/heartbeat", json={"status": "ready", "served": []})
    assert beat.status_code == 200, beat.text
    (placed,) = beat.json()["models"]
    assert placed["latest_step"] == 1
    assert placed["steps"] == [1]  # never the deleted step 2

    alice.queue_job(model_id)
    assigned = worker.lease()
    assert assigned["base_step"] == 1  # trains from the live latest...
    assert assigned["step"] == 3  # ...into a new step number: 2 named other weights

    job_id = assigned["id"]
    worker.stage(job_id, ADAPTER)
    completed = worker.complete(job_id, ADAPTER, step=3)
    assert completed.status_code == 200, completed.text
    assert alice.http.get(f"/v1/models/{model_id}").json()["latest_step"] == 3
    assert _files(lifecycle_store, alice, model_id, 3)


def test_step_zero_cannot_be_deleted_while_it_is_the_only_checkpoint(
    who: Callable[[], Who],
    lifecycle_plane: ServedPlane,
    lifecycle_store: LocalObjectStore,
) -> None:
    alice = who()
    fresh = str(alice.create_model()["id"])
    refused = alice.http.request("DELETE", f"/v1/models/{fresh}/checkpoints", json={"steps": [0]})
    assert refused.status_code == 409
    message = refused.json()["error"]["message"]
    assert "would leave model" in message and "with no checkpoint" in message
    assert alice.http.get(f"/v1/models/{fresh}/checkpoints/0").status_code == 200

    trained = str(_trained(alice, lifecycle_plane.sessions, lifecycle_store, 1)["id"])
    both = alice.http.request("DELETE", f"/v1/models/{trained}/checkpoints", json={"steps": [0, 1]})
    assert both.status_code == 409
    listed = alice.http.get(f"/v1/models/{trained}/checkpoints").json()["data"]
    assert [c["step"] for c in listed] == [0, 1]  # nothing of the refused request happened
    step0 = alice.http.request("DELETE", f"/v1/models/{trained}/checkpoints", json={"steps": [0]})
    assert step0.json() == {"deleted_count": 1, "not_found_steps": []}
    assert alice.http.get(f"/v1/models/{trained}").json()["latest_step"] == 1

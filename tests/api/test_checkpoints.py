"""Checkpoints: list, get, delete (files gone, rows kept), files listing and download."""

from __future__ import annotations

from collections.abc import Callable

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import Checkpoint
from skytrain_backend.storage import ObjectStore, keys
from tests.api.support import add_checkpoint
from tests.fixtures.callers import Caller
from tests.fixtures.services import ON_EVERY_BACKEND

pytestmark = ON_EVERY_BACKEND

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x00" * 2048}


@pytest.fixture
def trained(
    caller: Caller, db_sessions: sessionmaker[Session], object_store: ObjectStore
) -> Callable[[int], str]:
    """``trained(n)``: a model of the caller's with checkpoints at steps 0..n."""

    def make(last_step: int) -> str:
        model_id = caller.create_model()["id"]
        for step in range(1, last_step + 1):
            add_checkpoint(
                db_sessions,
                object_store,
                tenant_id=caller.key.tenant_id,
                model_id=model_id,
                step=step,
                files=ADAPTER,
            )
        return model_id

    return make


@pytest.mark.slow
def test_checkpoints_page_by_id_cursor_in_step_order(
    caller: Caller, trained: Callable[[int], str]
) -> None:
    model_id = trained(4)
    first = caller.http.get(f"/v1/models/{model_id}/checkpoints", params={"limit": 2}).json()
    assert [c["step"] for c in first["data"]] == [0, 1]
    assert first["has_more"] is True
    rest = caller.http.get(
        f"/v1/models/{model_id}/checkpoints", params={"after": first["data"][-1]["id"]}
    ).json()
    assert [c["step"] for c in rest["data"]] == [2, 3, 4]
    assert rest["has_more"] is False
    latest = caller.http.get(
        f"/v1/models/{model_id}/checkpoints", params={"order": "desc", "limit": 1}
    ).json()
    assert latest["data"][0]["step"] == 4
    assert latest["data"][0]["metrics"] == {"train/reward": 0.5}
    assert caller.http.get(f"/v1/models/{model_id}").json()["latest_step"] == 4


def test_delete_checkpoints_removes_files_keeps_rows_and_reports_missing_steps(
    caller: Caller,
    trained: Callable[[int], str],
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    model_id = trained(3)
    response = caller.http.request(
        "DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [1, 3, 7]}
    )
    assert response.status_code == 200
    assert response.json() == {"deleted_count": 2, "not_found_steps": [7]}

    steps = caller.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"]
    assert [c["step"] for c in steps] == [0, 2]
    tenant_id = caller.key.tenant_id
    for step, kept in ((1, False), (2, True), (3, False)):
        prefix = keys.checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step)
        assert bool(object_store.list(prefix)) is kept
    with db_sessions() as session:
        deleted = session.scalars(
            select(Checkpoint.step).where(
                Checkpoint.model_id == model_id, Checkpoint.deleted_at.is_not(None)
            )
        ).all()
    assert sorted(deleted) == [1, 3]
    pinned = caller.http.get(f"/v1/models/{model_id}/checkpoints/3")
    assert pinned.status_code == 404
    assert "was deleted" in pinned.json()["error"]["message"]
    again = caller.http.request("DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [3]})
    assert again.json() == {"deleted_count": 0, "not_found_steps": [3]}
    assert caller.http.get(f"/v1/models/{model_id}").json()["latest_step"] == 2


def test_deleted_steps_are_listed_with_their_metrics_on_request(
    caller: Caller, trained: Callable[[int], str]
) -> None:
    model_id = trained(3)
    caller.http.request("DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [1, 2]})
    url = f"/v1/models/{model_id}/checkpoints"

    live = caller.http.get(url).json()["data"]
    assert [(c["step"], c["deleted_at"]) for c in live] == [(0, None), (3, None)]
    first = caller.http.get(url, params={"include_deleted": "true", "limit": 2}).json()
    assert [c["step"] for c in first["data"]] == [0, 1]
    assert first["has_more"] is True
    deleted = first["data"][1]
    assert deleted["deleted_at"] is not None
    assert deleted["metrics"] == {"train/reward": 0.5}  # the step's history outlives its files
    rest = caller.http.get(
        url, params={"include_deleted": "true", "after": deleted["id"], "order": "asc"}
    ).json()
    assert [(c["step"], c["deleted_at"] is None) for c in rest["data"]] == [(2, False), (3, True)]


def test_checkpoint_files_are_listed_and_downloaded(
    caller: Caller, trained: Callable[[int], str]
) -> None:
    model_id = trained(1)
    files = caller.http.get(f"/v1/models/{model_id}/checkpoints/1/files").json()["data"]
    assert files == [
        {"name": "adapter_config.json", "size": 8},
        {"name": "adapter_model.safetensors", "size": 2048},
    ]
    url = f"/v1/models/{model_id}/checkpoints/1/files/adapter_model.safetensors"
    streamed = caller.http.get(url, params={"redirect": "false"})
    assert streamed.status_code == 200
    assert streamed.content == ADAPTER["adapter_model.safetensors"]
    # On S3 the default answer is a redirect to a presigned URL; on a directory, the bytes.
    followed = caller.http.get(url, follow_redirects=False)
    if followed.status_code == 307:
        followed = httpx.get(followed.headers["location"])
    assert followed.status_code == 200
    assert followed.content == ADAPTER["adapter_model.safetensors"]


def test_step_zero_has_no_files_and_unknown_files_are_404(
    caller: Caller, trained: Callable[[int], str]
) -> None:
    model_id = trained(1)
    assert caller.http.get(f"/v1/models/{model_id}/checkpoints/0/files").json() == {"data": []}
    missing = caller.http.get(f"/v1/models/{model_id}/checkpoints/1/files/optimizer.pt")
    assert missing.status_code == 404
    assert "adapter_config.json" in missing.json()["error"]["message"]
    climbing = caller.http.get(f"/v1/models/{model_id}/checkpoints/1/files/..%2F..%2Fsecret")
    assert climbing.status_code == 404
    assert caller.http.get(f"/v1/models/{model_id}/checkpoints/9").status_code == 404

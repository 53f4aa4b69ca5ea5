"""Models over real HTTP, once per {sqlite, postgres} x {local, s3}."""

from __future__ import annotations

from typing import Any

from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import Checkpoint
from skytrain_backend.storage import ObjectStore, keys
from tests.fixtures.callers import Caller
from tests.fixtures.services import ON_EVERY_BACKEND, ControlPlane

pytestmark = ON_EVERY_BACKEND


def test_health_answers_without_a_key(control_plane: ControlPlane) -> None:
    import httpx

    response = httpx.get(f"{control_plane.url}/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


def test_create_model_defaults_entity_to_tenant_and_starts_at_step_zero(caller: Caller) -> None:
    model = caller.create_model(config={"lora_rank": 4})
    assert model["entity"] == caller.key.tenant_name
    assert model["inference_name"] == f"{caller.key.tenant_name}/tests/agent"
    assert model["latest_step"] == 0
    assert model["config"]["lora_rank"] == 4
    assert model["config"]["lora_alpha"] == 16  # defaults filled in and stored
    checkpoints = caller.http.get(f"/v1/models/{model['id']}/checkpoints").json()
    assert [c["step"] for c in checkpoints["data"]] == [0]


def test_models_report_their_last_activity(caller: Caller) -> None:
    created = caller.create_model()
    assert created["last_active_at"] is not None  # registering a model is using it
    (listed,) = caller.http.get("/v1/models").json()["data"]
    fetched = caller.http.get(f"/v1/models/{created['id']}").json()
    assert listed["last_active_at"] == fetched["last_active_at"] == created["last_active_at"]


def test_create_existing_model_conflicts_unless_return_existing(caller: Caller) -> None:
    first = caller.create_model()
    body = {"project": "tests", "name": "agent", "base_model": "tiny/llama"}
    again = caller.http.post("/v1/models", json=body)
    assert again.status_code == 409
    assert "return_existing" in again.json()["error"]["message"]
    existing = caller.http.post("/v1/models", json={**body, "return_existing": True})
    assert existing.status_code == 200
    assert existing.json()["id"] == first["id"]


def test_return_existing_with_another_base_model_conflicts(caller: Caller) -> None:
    caller.create_model()
    response = caller.http.post(
        "/v1/models",
        json={"project": "tests", "name": "agent", "base_model": "other", "return_existing": True},
    )
    assert response.status_code == 409
    assert "'tiny/llama'" in response.json()["error"]["message"]


def test_list_models_filters_and_pages(caller: Caller) -> None:
    ids = [caller.create_model(name=f"m{i}")["id"] for i in range(5)]
    caller.http.post(
        "/v1/models", json={"project": "other", "name": "x", "base_model": "tiny/llama"}
    )
    first = caller.http.get("/v1/models", params={"project": "tests", "limit": 2}).json()
    assert [m["id"] for m in first["data"]] == ids[:2]
    assert first["has_more"] is True
    rest = caller.http.get(
        "/v1/models", params={"project": "tests", "limit": 10, "after": ids[1]}
    ).json()
    assert [m["id"] for m in rest["data"]] == ids[2:]
    assert rest["has_more"] is False
    newest = caller.http.get(
        "/v1/models", params={"project": "tests", "order": "desc", "limit": 1}
    ).json()
    assert newest["data"][0]["id"] == ids[-1]
    by_name = caller.http.get("/v1/models", params={"name": "m3"}).json()
    assert [m["id"] for m in by_name["data"]] == [ids[3]]


def test_delete_model_removes_rows_and_objects(
    caller: Caller,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    from tests.api.support import group

    model = caller.create_model()
    logged = caller.http.post(
        f"/v1/models/{model['id']}/log", json={"trajectory_groups": [group()]}
    )
    assert logged.status_code == 201
    prefix = keys.model_prefix(tenant_id=caller.key.tenant_id, model_id=model["id"])
    assert object_store.list(prefix)

    assert caller.http.delete(f"/v1/models/{model['id']}").status_code == 204
    assert caller.http.get(f"/v1/models/{model['id']}").status_code == 404
    assert object_store.list(prefix) == []
    with db_sessions() as session:
        left = session.scalar(
            select(func.count()).select_from(Checkpoint).where(Checkpoint.model_id == model["id"])
        )
    assert left == 0


def test_model_names_with_slashes_are_refused(caller: Caller) -> None:
    response = caller.http.post(
        "/v1/models", json={"project": "a/b", "name": "agent", "base_model": "x"}
    )
    assert response.status_code == 400
    assert response.json()["error"]["message"].startswith("project:")


def _error(response: Any) -> str:
    return str(response.json()["error"]["message"])


def test_requests_without_a_valid_key_get_401(control_plane: ControlPlane) -> None:
    import httpx

    missing = httpx.get(f"{control_plane.url}/v1/models")
    assert missing.status_code == 401
    assert "Authorization: Bearer" in _error(missing)
    wrong = httpx.get(
        f"{control_plane.url}/v1/models", headers={"Authorization": "Bearer sk-st-nope"}
    )
    assert wrong.status_code == 401
    assert wrong.json()["error"]["type"] == "authentication_error"

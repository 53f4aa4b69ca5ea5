"""Two tenants: every route tried with the other tenant's ids answers 404 and changes nothing."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import jobs
from skytrain_backend.storage import ObjectStore
from tests.api.support import add_checkpoint, group, sft_trajectory
from tests.fixtures.callers import Caller
from tests.fixtures.services import ON_EVERY_BACKEND, ApiKey, ControlPlane

pytestmark = ON_EVERY_BACKEND


@dataclass
class Owned:
    model_id: str
    batch_id: str
    job_id: str
    file_uri: str
    checkpoint_id: str


@pytest.fixture
def owned(other: Caller, db_sessions: sessionmaker[Session], object_store: ObjectStore) -> Owned:
    """A model of the other tenant's with a checkpoint with files, a log, a job with an event
    and an uploaded file."""
    model_id = other.create_model()["id"]
    add_checkpoint(
        db_sessions,
        object_store,
        tenant_id=other.key.tenant_id,
        model_id=model_id,
        step=1,
        files={"adapter_config.json": b"{}"},
    )
    batch_id = other.http.post(
        f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]}
    ).json()["id"]
    job_id = other.http.post(
        "/v1/training-jobs", json={"model_id": model_id, "trajectory_groups": [group()]}
    ).json()["id"]
    with db_sessions() as session:
        jobs.add_event(session, job_id=job_id, type="training_started", data={})
        session.commit()
    upload = other.http.post(
        "/v1/files", files={"file": ("d.jsonl", json.dumps(sft_trajectory()).encode())}
    ).json()
    checkpoint_id = other.http.get(f"/v1/models/{model_id}/checkpoints").json()["data"][0]["id"]
    return Owned(model_id, batch_id, job_id, upload["uri"], checkpoint_id)


def _requests(o: Owned, own_model: str) -> list[tuple[str, str, dict[str, Any]]]:
    m, log = f"/models/{o.model_id}", {"trajectory_groups": [group()]}
    return [
        ("GET", m, {}),
        ("DELETE", m, {}),
        ("GET", f"{m}/checkpoints", {}),
        ("GET", f"{m}/checkpoints", {"params": {"include_deleted": "true"}}),
        ("GET", f"{m}/checkpoints/1", {}),
        ("DELETE", f"{m}/checkpoints", {"json": {"steps": [0, 1]}}),
        ("GET", f"{m}/checkpoints/1/files", {}),
        ("GET", f"{m}/checkpoints/1/files/adapter_config.json", {}),
        ("POST", f"{m}/log", {"json": log}),
        ("GET", f"{m}/logs", {}),
        ("GET", f"{m}/logs/{o.batch_id}", {}),
        ("GET", f"{m}/metrics", {}),
        ("POST", "/training-jobs", {"json": {"model_id": o.model_id, **log}}),
        (
            "POST",
            "/sft-training-jobs",
            {"json": {"model_id": o.model_id, "trajectories": [sft_trajectory()]}},
        ),
        (
            "POST",
            "/sft-training-jobs",
            {"json": {"model_id": own_model, "training_data_url": o.file_uri}},
        ),
        ("GET", "/training-jobs", {"params": {"model_id": o.model_id}}),
        ("GET", f"/training-jobs/{o.job_id}", {}),
        ("POST", f"/training-jobs/{o.job_id}/cancel", {}),
        ("GET", f"/training-jobs/{o.job_id}/events", {}),
        ("DELETE", f"/files/{o.file_uri.rsplit('/', 1)[-1]}", {}),
    ]


@pytest.mark.parametrize("prefix", ["/v1", "/v1/preview"])
@pytest.mark.slow
def test_every_route_hides_the_other_tenants_rows(
    caller: Caller,
    other: Caller,
    owned: Owned,
    stored: Callable[[Caller], Any],
    prefix: str,
) -> None:
    own_model = caller.create_model()["id"]
    before = stored(caller), stored(other)
    for method, path, options in _requests(owned, own_model):
        response = caller.http.request(method, prefix + path, **options)
        assert response.status_code == 404, (method, path, response.text)
        assert response.json()["error"]["type"] == "not_found_error"
    assert (stored(caller), stored(other)) == before


def test_lists_and_cursors_never_show_the_other_tenants_rows(
    caller: Caller, other: Caller, owned: Owned
) -> None:
    own_model = caller.create_model()["id"]
    models = caller.http.get("/v1/models").json()["data"]
    assert owned.model_id not in [m["id"] for m in models]
    assert caller.http.get("/v1/training-jobs").json()["data"] == []
    assert caller.http.get("/v1/models", params={"after": owned.model_id}).status_code == 400
    assert caller.http.get("/v1/training-jobs", params={"after": owned.job_id}).status_code == 400
    checkpoints = caller.http.get(
        f"/v1/models/{own_model}/checkpoints", params={"after": owned.checkpoint_id}
    )
    assert checkpoints.status_code == 400


def test_tenants_can_use_the_same_model_names_under_their_own_entities(
    caller: Caller, other: Caller
) -> None:
    mine = caller.create_model()
    theirs = other.create_model()
    assert mine["inference_name"] == f"{caller.key.tenant_name}/tests/agent"
    assert theirs["inference_name"] == f"{other.key.tenant_name}/tests/agent"


def test_an_entity_belongs_to_the_tenant_that_used_it_first(
    caller: Caller, other: Caller, stored: Callable[[Caller], Any]
) -> None:
    """Two tenants could both register `ta/p/m0`: one's models passed for the other's."""
    entity = f"team-{uuid.uuid4().hex[:8]}"
    caller.create_model(entity=entity)
    before = stored(other)
    for taken in (entity, caller.key.tenant_name):  # first used, or the tenant's own name
        response = other.http.post(
            "/v1/models",
            json={"entity": taken, "project": "tests", "name": "agent", "base_model": "m"},
        )
        assert response.status_code == 409, response.text
        message = response.json()["error"]["message"]
        assert f"entity {taken!r} belongs to another tenant" in message
        assert other.key.tenant_name in message  # where to create it instead
    assert stored(other) == before
    caller.create_model(entity=entity, name="second")  # still the first tenant's


def test_a_create_refused_by_the_quota_claims_no_entity(
    caller: Caller, other: Caller, set_limits: Callable[..., None]
) -> None:
    """A tenant at its quota (or creating and deleting in a loop) took any number of names."""
    set_limits(caller, max_models=1)
    caller.create_model()
    entity = f"team-{uuid.uuid4().hex[:8]}"
    refused = caller.http.post(
        "/v1/models",
        json={"entity": entity, "project": "tests", "name": "agent", "base_model": "m"},
    )
    assert refused.status_code == 403, refused.text
    assert "the most its quota allows (1)" in refused.json()["error"]["message"]
    other.create_model(entity=entity)  # the name is still free


def test_creating_and_deleting_claims_no_more_entity_names_than_max_models(
    caller: Caller, other: Caller, set_limits: Callable[..., None]
) -> None:
    set_limits(caller, max_models=2)
    names = [f"loop-{uuid.uuid4().hex[:8]}" for _ in range(3)]
    for entity in names[:2]:
        model = caller.create_model(entity=entity)
        assert caller.http.delete(f"/v1/models/{model['id']}").status_code in (200, 204)
    refused = caller.http.post(
        "/v1/models",
        json={"entity": names[2], "project": "tests", "name": "agent", "base_model": "m"},
    )
    assert refused.status_code == 403, refused.text
    assert "claimed 2 entity names" in refused.json()["error"]["message"]
    caller.create_model(entity=names[0])  # a name it holds, and its own, still serve
    caller.create_model(name="own")
    other.create_model(entity=names[2])


def test_tenants_racing_for_a_new_entity_leave_it_to_one(
    control_plane: ControlPlane, api_key: Callable[..., ApiKey]
) -> None:
    entity = f"race-{uuid.uuid4().hex[:8]}"
    keys = [api_key() for _ in range(8)]
    barrier = threading.Barrier(len(keys))

    def create(key: ApiKey) -> int:
        with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as http:
            body = {"entity": entity, "project": "p", "name": "m0", "base_model": "m"}
            barrier.wait()
            return http.post("/v1/models", json=body).status_code

    with ThreadPoolExecutor(len(keys)) as pool:
        statuses = sorted(pool.map(create, keys))
    assert statuses == [201] + [409] * (len(keys) - 1)

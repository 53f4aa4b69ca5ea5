"""An upload is bounded by its tenant's storage quota as it streams (issue 38): on a real S3
server (SeaweedFS), with a multipart threshold small enough that a job's input goes up in
parts while it is read, no byte past the quota reaches the store, even when another upload of
the same tenant is committed while the first one streams. The control plane is the real app
over HTTP on PostgreSQL (the quota is held under the tenant's row lock there)."""

from __future__ import annotations

import json
import random
import string
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db.models import UploadReservation
from skytrain_backend.storage import s3
from tests.api.support import sft_trajectory
from tests.fixtures.services import MakeSettings, database_sessions, serve_in_thread

pytestmark = [pytest.mark.s3, pytest.mark.postgres]

QUOTA = 12 * 1024 * 1024
PART = 5 * 1024 * 1024  # S3's least (SeaweedFS refuses smaller parts, as AWS does)


def _sft_body(model_id: str, *, size: int) -> bytes:
    """An SFT job of about ``size`` bytes of JSON whose answers are random letters: zstd
    shrinks them by a fifth or so, so the stored input is most of the JSON's size."""
    rng = random.Random(size)
    trajectories: list[dict[str, Any]] = []
    for _ in range(size // (64 * 1024)):
        answer = "".join(rng.choices(string.ascii_letters + string.digits, k=64 * 1024))
        trajectories.append(sft_trajectory(answer))
    return json.dumps({"model_id": model_id, "trajectories": trajectories}).encode()


@pytest.fixture
def plane(
    make_settings: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> Iterator[tuple[Any, str, sessionmaker[Session], str]]:
    """The app (its store's S3 client to watch), its URL, its database and a tenant's key."""
    monkeypatch.setattr(s3, "MULTIPART_THRESHOLD", PART)
    monkeypatch.setattr(s3, "STREAM_PART_BYTES", PART)
    settings = make_settings(database="postgres", store="s3")
    app = create_app(settings)
    with database_sessions(settings) as sessions, serve_in_thread(app) as url:
        with sessions() as session:
            _, key = api_keys.create_key(session, tenant_name="alice")
            tenants.set_limits(
                session, tenant_name="alice", values={"max_storage_bytes": QUOTA}, reset=[]
            )
        yield app, url, sessions, key


def test_an_upload_committed_while_another_streams_leaves_no_byte_past_the_quota_in_the_store(
    plane: tuple[Any, str, sessionmaker[Session], str],
) -> None:
    app, url, sessions, key = plane
    headers = {"Authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=url, headers=headers, timeout=120) as first:
        created = first.post(
            "/v1/models", json={"project": "quota", "name": "m", "base_model": "tests/base"}
        )
        assert created.status_code == 201, created.text
        model_id = created.json()["id"]
        body = _sft_body(model_id, size=QUOTA * 9 // 10)
        # Every byte the control plane sends the store: parts of multipart uploads and objects.
        sent: list[int] = []
        second: list[httpx.Response] = []

        def watch(params: dict[str, Any], **_: Any) -> None:
            sent.append(len(params["Body"]))
            if not second:  # the first upload's first part: the second upload runs now
                second.append(httpx.Response(0))
                with httpx.Client(base_url=url, headers=headers, timeout=120) as other:
                    second[0] = other.post("/v1/sft-training-jobs", content=body)

        events = app.state.store._client.meta.events
        events.register("before-parameter-build.s3.UploadPart", watch)
        events.register("before-parameter-build.s3.PutObject", watch)
        try:
            response = first.post("/v1/sft-training-jobs", content=body)
        finally:
            events.unregister("before-parameter-build.s3.UploadPart", watch)
            events.unregister("before-parameter-build.s3.PutObject", watch)

        statuses = sorted([response.status_code, second[0].status_code])
        assert statuses == [201, 403], (response.text, second[0].text)
        refused = response if response.status_code == 403 else second[0]
        assert refused.json()["error"]["type"] == "quota_exceeded"
        assert "max_storage_bytes" in refused.json()["error"]["message"]
        assert sum(sent) <= QUOTA, f"{sum(sent)} bytes sent to the store under a quota of {QUOTA}"
        jobs = first.get("/v1/training-jobs", params={"model_id": model_id}).json()["data"]
        assert len(jobs) == 1
    with sessions() as session:
        tenant = tenants.get_tenant_by_name(session, name="alice")
        held = tenants.usage_of(session, tenant_id=tenant.id).storage_bytes
        # Nothing reserved is left behind, and the running total is the sum over the rows.
        assert list(session.scalars(select(UploadReservation))) == []
        assert tenants.recount_storage(session, fix=False) == []
    assert 0 < held <= QUOTA
    store = app.state.store  # the refused upload's parts are aborted, not left in S3
    assert store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []) == []

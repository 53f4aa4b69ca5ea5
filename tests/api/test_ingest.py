"""Storing a batch is all or nothing: a failed insert removes the object it had written."""

from __future__ import annotations

import gc
import json
from typing import Any

import msgspec
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import LARGE_BODY_BYTES, LargeBodyRoute, gc_paused
from skytrain_backend.api.routes import logs, training_jobs
from skytrain_backend.db import batches
from skytrain_backend.db.models import TrajectoryBatch, new_id
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import parse_trajectory_groups
from skytrain_backend.storage import ObjectStore
from skytrain_backend.storage.s3 import STREAM_PART_BYTES, S3ObjectStore
from tests.api.support import group
from tests.fixtures.services import ON_EVERY_BACKEND


@ON_EVERY_BACKEND
def test_a_failed_insert_deletes_the_object_it_wrote(
    db_sessions: sessionmaker[Session], object_store: ObjectStore
) -> None:
    key = f"tests/{new_id()}.jsonl"
    with db_sessions() as session:

        def insert(uri: str) -> TrajectoryBatch:
            # The database refuses it: there is no such model (a real foreign key violation).
            return batches.add_batch(
                session,
                batch_id=new_id(),
                model_id="no-such-model",
                split="val",
                step=0,
                uri=uri,
                num_groups=1,
                num_trajectories=1,
                metrics={},
            )

        with pytest.raises(IntegrityError):
            ingest.store_then_commit(object_store, session, key=key, data=b"{}\n", insert=insert)
        count = session.scalar(
            select(func.count())
            .select_from(TrajectoryBatch)
            .where(TrajectoryBatch.model_id == "no-such-model")
        )
    assert count == 0
    assert not object_store.exists(key)


def _pending_uploads(store: ObjectStore) -> list[object]:
    if not isinstance(store, S3ObjectStore):
        return []
    return list(store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []))


def _fill(batch: ingest.Batch, *, parts: float) -> list[bytes]:
    """Add groups to ``batch`` until its lines fill ``parts`` S3 parts; returns the lines."""
    raw = json.dumps(group(*[1.0] * 50)).encode()
    lines: list[bytes] = []
    while sum(map(len, lines)) < parts * STREAM_PART_BYTES:
        parsed = ingest.parse_group(raw, f"trajectory_groups[{len(lines)}]")
        batch.add(parsed)
        lines.append(msgspec.json.encode(parsed) + b"\n")
    return lines


@ON_EVERY_BACKEND
def test_a_batch_streamed_in_parts_is_stored_whole(
    db_sessions: sessionmaker[Session], object_store: ObjectStore
) -> None:
    key = f"tests/{new_id()}.jsonl"
    batch = ingest.Batch(limit=1_000_000)
    try:
        batch.stream_to(object_store, key)
        lines = _fill(batch, parts=2.5)
        with db_sessions() as session:
            uri = ingest.store_then_commit(
                object_store, session, key=key, data=batch.output, insert=lambda uri: uri
            )
    finally:
        batch.close()
    assert uri == object_store.uri(key)
    assert object_store.get_bytes(key) == b"".join(lines)
    assert _pending_uploads(object_store) == []


@ON_EVERY_BACKEND
def test_a_batch_refused_midway_leaves_no_object_and_no_parts(object_store: ObjectStore) -> None:
    key = f"tests/{new_id()}.jsonl"
    batch = ingest.Batch(limit=1_000_000)
    try:
        batch.stream_to(object_store, key)
        _fill(batch, parts=1.5)  # one part up, the next begun
        with pytest.raises(InvalidRequest, match=r"trajectory_groups\[9\]\.trajectories"):
            batch.add(ingest.parse_group(b'{"trajectories": []}', "trajectory_groups[9]"))
    finally:
        batch.close()
    assert not object_store.exists(key)
    assert _pending_uploads(object_store) == []


def test_summary_of_one_batch_combines_to_itself_and_pools_two() -> None:
    first = ingest.summarize(parse_trajectory_groups([group(0.0, 1.0, score=2.0)]))
    second = ingest.summarize(parse_trajectory_groups([group(1.0, 1.0, 1.0, 1.0)]))
    assert ingest.combine([first]) == first
    both = ingest.combine([first, second])
    together = ingest.summarize(
        parse_trajectory_groups([group(0.0, 1.0, score=2.0), group(1.0, 1.0, 1.0, 1.0)])
    )
    for key in ("reward", "reward_std_dev", "reward/min", "reward/max", "num_trajectories"):
        assert both[key] == pytest.approx(together[key])
    # A metric only the first batch has is the mean over the trajectories that have it.
    assert both["score"] == pytest.approx(2.0)


def test_overlapping_pauses_resume_the_collector_after_the_last() -> None:
    assert gc.isenabled()
    first, second = gc_paused(), gc_paused()
    first.__enter__()
    second.__enter__()
    first.__exit__(None, None, None)
    assert not gc.isenabled()  # the second request is still parsing
    second.__exit__(None, None, None)
    assert gc.isenabled()


def test_a_collector_paused_by_someone_else_stays_paused() -> None:
    gc.disable()
    try:
        with gc_paused():
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()


def test_large_bodies_are_parsed_with_the_collector_paused() -> None:
    """A real FastAPI app with one route of the class: it reports the collector's state."""
    router = APIRouter(route_class=LargeBodyRoute)

    @router.post("/echo")
    def echo(body: list[Any]) -> dict[str, Any]:
        return {"items": len(body), "collector_running": gc.isenabled()}

    app = FastAPI()
    app.include_router(router)
    small, large = [0] * 10, [{"token": "token_id:1", "logprob": -0.5}] * 20_000
    assert len(json.dumps(large)) >= LARGE_BODY_BYTES > len(json.dumps(small))
    with TestClient(app) as client:
        assert client.post("/echo", json=small).json() == {"items": 10, "collector_running": True}
        answer = client.post("/echo", json=large).json()
    assert answer == {"items": 20_000, "collector_running": False}
    assert gc.isenabled()


def test_the_routes_that_take_trajectories_pause_the_collector_for_large_bodies() -> None:
    for router in (training_jobs.router, logs.router):
        posts = [r for r in router.routes if isinstance(r, APIRoute) and "POST" in r.methods]
        assert posts and all(isinstance(route, LargeBodyRoute) for route in posts)

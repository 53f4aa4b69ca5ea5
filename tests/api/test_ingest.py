"""Storing a batch is all or nothing: a failed insert removes the object it had written."""

from __future__ import annotations

import base64
import gc
import json
import os
from typing import Any

import msgspec
import pytest
from fastapi import APIRouter, FastAPI
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import BaseModel, ConfigDict, Field, model_validator
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import LARGE_BODY_BYTES, LargeBodyRoute, gc_paused
from skytrain_backend.api.ingest import body as ingest_body
from skytrain_backend.api.routes import logs, training_jobs
from skytrain_backend.db import batches
from skytrain_backend.db.models import TrajectoryBatch, new_id
from skytrain_backend.errors import InvalidRequest, PayloadTooLarge
from skytrain_backend.protocol import parse_trajectory_groups
from skytrain_backend.storage import ObjectStore, compression
from skytrain_backend.storage.s3 import MULTIPART_THRESHOLD, STREAM_PART_BYTES, S3ObjectStore
from tests.api.support import group
from tests.fixtures.services import ON_EVERY_BACKEND


@ON_EVERY_BACKEND
@pytest.mark.slow
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


def _pending_uploads(store: ObjectStore) -> list[dict[str, Any]]:
    if not isinstance(store, S3ObjectStore):
        return []
    return list(store._client.list_multipart_uploads(Bucket=store.bucket).get("Uploads", []))


def _fill(batch: ingest.IngestBatch, *, size: float) -> list[bytes]:
    """Add groups to ``batch`` until its stored (compressed) bytes reach about ``size``;
    returns the lines. Each group carries random base64 text, which zstd shrinks to about
    3/4 (6 bits of every 8), so the lines fill their parts compressed too."""
    lines: list[bytes] = []
    while sum(map(len, lines)) * 0.8 < size:
        raw = json.dumps(
            {**group(*[1.0] * 4), "metadata": {"noise": base64.b64encode(os.urandom(64 * 1024))}},
            default=bytes.decode,
        ).encode()
        parsed = ingest.parse_group(raw, f"trajectory_groups[{len(lines)}]")
        batch.add(parsed)
        lines.append(msgspec.json.encode(parsed) + b"\n")
    return lines


@ON_EVERY_BACKEND
@pytest.mark.slow
def test_a_batch_streamed_in_parts_is_stored_whole(
    db_sessions: sessionmaker[Session], object_store: ObjectStore
) -> None:
    key = f"tests/{new_id()}.jsonl"
    batch = ingest.IngestBatch(limit=1_000_000)
    try:
        batch.stream_to(object_store, key)
        lines = _fill(batch, size=MULTIPART_THRESHOLD + 1.5 * STREAM_PART_BYTES)
        with db_sessions() as session:
            uri = ingest.store_then_commit(
                object_store, session, key=key, data=batch.output, insert=lambda uri: uri
            )
    finally:
        batch.close()
    assert uri == object_store.uri(key)
    stored = object_store.get_bytes(key)
    assert len(stored) > MULTIPART_THRESHOLD + STREAM_PART_BYTES  # went up in three parts
    assert compression.decompress(stored) == b"".join(lines)
    assert _pending_uploads(object_store) == []


@ON_EVERY_BACKEND
def test_a_batch_refused_midway_leaves_no_object_and_no_parts(object_store: ObjectStore) -> None:
    key = f"tests/{new_id()}.jsonl"
    batch = ingest.IngestBatch(limit=1_000_000)
    try:
        batch.stream_to(object_store, key)
        _fill(batch, size=MULTIPART_THRESHOLD + 0.5 * STREAM_PART_BYTES)  # a part up, one begun
        if isinstance(object_store, S3ObjectStore):  # the multipart upload had begun
            assert [u for u in _pending_uploads(object_store) if str(u["Key"]).endswith(key)]
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


_GROUP = json.dumps(group(1.0, 0.0))
_BIG = "x" * ingest_body.MAX_FIELDS_BYTES


@pytest.mark.parametrize(
    "body",
    [
        f'{{"model_id": "m", "trajectory_groups": [{_GROUP}, {_GROUP}]}}',
        f'{{"trajectory_groups":[{_GROUP}],"model_id":"m","unknown":{{"a":[1,2]}}}}',
        '{"model_id": "m", "config": {"learning_rate": 1e-5}, "trajectory_groups": []}',
        '{"model_id": "m"}',  # no list
        '{"model_id": "m", "trajectory_groups": null}',
        '{"model_id": "m", "trajectory_groups": 5}',
        '{"model_id": 7, "trajectory_groups": []}',
        f'{{"model_id": "m", "trajectory_groups": [{_GROUP}], "trajectory_groups": 5}}',
        f'{{"model_id": "m", "trajectory_groups": 5, "trajectory_groups": [{_GROUP}]}}',
        '{"model_id": "a", "model_id": "b", "trajectory_groups": []}',
        f'{{"model_id": "m", "trajectory_groups": [], "extra": "{_BIG}"}}',
        f'{{"model_id": "m", "trajectory_groups": [{_GROUP}], "extra": "{_BIG[:-200]}"}}',
        f'{{"model_id": "{_BIG}", "trajectory_groups": []}}',
        "[1, 2]",
        '{"model_id": "m", "trajectory_groups": [',
        '{"model_id": "m", "trajectory_groups": [{"reward": NaN}]}',
        '{"model_id": "m", "config": {"learning_rate": Infinity}, "trajectory_groups": []}',
        '{"model_id": "m", "trajectory_groups": [' + "[" * 5000 + "]" * 5000 + "]}",
    ],
)
def test_one_pass_split_reads_a_body_as_the_exact_split_does(
    body: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The body is split in one pass of the parser when it is as expected, else by the way
    that names the problem: both must read every body alike, fields, items and errors (but
    for the bytes of a field the schema ignores, which the one pass skips unread)."""

    def split() -> object:
        try:
            header, items = ingest.split_body(
                body.encode(),
                schema=training_jobs.TrainingJobCreate,
                list_field="trajectory_groups",
            )
        except (InvalidRequest, PayloadTooLarge) as exc:
            return type(exc), str(exc)
        return header, None if items is None else [bytes(item) for item in items]

    at_once = split()
    monkeypatch.setattr(ingest_body, "_split_at_once", lambda *_, **__: None)
    assert split() == at_once


def test_a_body_as_expected_is_split_in_one_pass() -> None:
    body = f'{{"model_id": "m", "trajectory_groups": [{_GROUP}, {_GROUP}], "unknown": 1}}'
    split = ingest_body._split_at_once(
        body.encode(), schema=training_jobs.TrainingJobCreate, list_field="trajectory_groups"
    )
    assert split is not None
    fields, items = split
    assert fields == [b'"model_id":"m"'] and items is not None
    assert [bytes(item) for item in items] == [_GROUP.encode()] * 2


def test_the_one_pass_split_skips_a_field_the_schema_ignores_unread() -> None:
    # Not UTF-8: pydantic, reading every field, refuses the body; the one pass never reads it.
    body = b'{"model_id": "m", "trajectory_groups": [], "ignored": "\xff\xfe"}'
    header, items = ingest.split_body(
        body, schema=training_jobs.TrainingJobCreate, list_field="trajectory_groups"
    )
    assert header.model_id == "m" and items == []


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")
    model_id: str
    trajectory_groups: list[dict[str, Any]]


class _Kept(BaseModel):
    model_config = ConfigDict(extra="allow")
    model_id: str
    trajectory_groups: list[dict[str, Any]]


class _Aliased(BaseModel):
    model_id: str
    step: int | None = Field(default=None, validation_alias="at_step")
    trajectory_groups: list[dict[str, Any]]


class _Whole(BaseModel):
    model_id: str
    keys: list[str] = []
    trajectory_groups: list[dict[str, Any]]

    @model_validator(mode="before")
    @classmethod
    def _keys(cls, body: Any) -> Any:
        return {**body, "keys": sorted(body)}


@pytest.mark.parametrize(
    ("schema", "body", "read", "expected"),
    [
        (_Strict, '{"model_id": "m", "typo": 1, "trajectory_groups": []}', None, "Extra inputs"),
        (
            _Kept,
            '{"model_id": "m", "kept": 1, "trajectory_groups": []}',
            "model_extra",
            {"kept": 1},
        ),
        (_Aliased, '{"model_id": "m", "at_step": 3, "trajectory_groups": []}', "step", 3),
        (
            _Whole,
            '{"model_id": "m", "seen": 1, "trajectory_groups": []}',
            "keys",
            ["model_id", "seen", "trajectory_groups"],
        ),
    ],
)
def test_a_schema_that_reads_more_than_its_own_fields_is_split_the_exact_way(
    schema: type[BaseModel], body: str, read: str | None, expected: object
) -> None:
    """Refusing or keeping unknown fields, renaming one, or validating the body as a whole:
    the one pass, which reads only the fields by name, would change what such a schema sees."""
    assert ingest_body._top_level_struct(schema, "trajectory_groups") is None
    try:
        header, _ = ingest.split_body(body.encode(), schema=schema, list_field="trajectory_groups")
    except InvalidRequest as exc:
        assert read is None and isinstance(expected, str) and expected in str(exc)
    else:
        assert read is not None and getattr(header, read) == expected

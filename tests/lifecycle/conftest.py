"""A control plane on a local object directory that tests can make fail.

- ``lifecycle_settings`` (session; SQLite, and PostgreSQL under the ``postgres`` marker): a
  local object store, provider ``none``, and a scheduler that sweeps every half second.
- ``lifecycle_plane``: that control plane under uvicorn (``.url``, ``.app``); its
  ``.sessions`` and ``lifecycle_store`` to check rows and objects.
- ``who()``: a new tenant with a key and an HTTP client, whose models get a base model of
  the test's own (the running scheduler places models on any ready worker of their base).
- ``worker_client(...)``: a worker row (placed models, a token) and an HTTP client that
  calls the worker routes as the worker agent does; ``on_worker``: ``who()`` with a model
  placed on a ``worker_client``; ``leased_job(who, worker, model_id)``: a job queued by one
  and leased by the other.
- ``store_watched(app, watch, on=method)``: the app's store runs ``watch`` before each call of
  ``method`` (``held_tables`` says what the watched request holds then, on PostgreSQL).
- ``undeletable(directory)``: entries of a real directory of the store cannot be removed,
  even by root (the immutable attribute as root, no write permission otherwise): the store
  fails for real.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select, text
from sqlalchemy.exc import OperationalError
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Checkpoint, Model
from skytrain_backend.storage import LocalObjectStore, ObjectStore, keys
from skytrain_backend.storage.base import CHUNK_BYTES, ObjectInfo
from tests.api.support import group
from tests.fixtures.services import MakeSettings, ServedPlane, served_plane

SWEEP_INTERVAL_S = 0.5


@pytest.fixture(
    scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def lifecycle_settings(request: pytest.FixtureRequest, make_settings: MakeSettings) -> Settings:
    return make_settings(database=request.param, scheduler={"sweep_interval_s": SWEEP_INTERVAL_S})


@pytest.fixture(scope="session")
def lifecycle_plane(lifecycle_settings: Settings) -> Iterator[ServedPlane]:
    with served_plane(lifecycle_settings) as plane:
        yield plane


@pytest.fixture(scope="session")
def lifecycle_store(lifecycle_settings: Settings) -> LocalObjectStore:
    return LocalObjectStore(lifecycle_settings.storage.home / "objects")


def new_base_model() -> str:
    """A base model name of one test's own: the running scheduler places that test's models
    only on that test's workers."""
    return f"tests/base-{uuid.uuid4().hex[:8]}"


@dataclass
class Who:
    name: str
    tenant_id: str
    http: httpx.Client
    base_model: str

    def create_model(self, **extra: Any) -> dict[str, Any]:
        response = self.post_model(**extra)
        assert response.status_code == 201, response.text
        return dict(response.json())

    def post_model(self, **extra: Any) -> httpx.Response:
        return self.http.post(
            "/v1/models",
            json={
                "project": "lifecycle",
                "name": f"m-{uuid.uuid4().hex[:8]}",
                "base_model": self.base_model,
                **extra,
            },
        )

    def queue_job(self, model_id: str, *groups: dict[str, Any]) -> str:
        """Queue an RL job of ``groups`` (one two-trajectory group if none) for ``model_id``;
        its id."""
        response = self.http.post(
            "/v1/training-jobs",
            json={"model_id": model_id, "trajectory_groups": list(groups) or [group()]},
        )
        assert response.status_code == 201, response.text
        return str(response.json()["id"])


@pytest.fixture
def who(lifecycle_plane: ServedPlane) -> Iterator[Callable[[], Who]]:
    """``who()``: a new tenant with its own key and HTTP client."""
    clients: list[httpx.Client] = []

    def make(base_model: str | None = None) -> Who:
        name = f"t-{uuid.uuid4().hex[:10]}"
        with lifecycle_plane.sessions() as session:
            row, key = api_keys.create_key(session, tenant_name=name)
        http = httpx.Client(
            base_url=lifecycle_plane.url, headers={"Authorization": f"Bearer {key}"}, timeout=60
        )
        clients.append(http)
        return Who(
            name=name,
            tenant_id=row.tenant_id,
            http=http,
            base_model=base_model or new_base_model(),
        )

    yield make
    for http in clients:
        http.close()


@dataclass
class WorkerClient:
    worker_id: str
    http: httpx.Client

    def lease(self) -> dict[str, Any]:
        """Lease the next job without waiting, as the agent does: the job handed over."""
        leased = self.http.post("/jobs/lease", json={})
        assert leased.status_code == 200, leased.text
        return dict(leased.json()["job"])

    def stage(self, job_id: str, files: dict[str, bytes]) -> None:
        """Upload ``files`` (name: bytes) for attempt 1 of the leased job, as a worker does."""
        for name, data in files.items():
            staged = self.http.put(
                f"/jobs/{job_id}/files/{name}", params={"attempt": 1}, content=data
            )
            assert staged.status_code == 204, staged.text

    def complete(self, job_id: str, files: dict[str, bytes], *, step: int) -> httpx.Response:
        """Complete attempt 1 with ``step``, listing ``files`` with their sizes and SHA-256s."""
        listed = [
            {"name": name, "size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            for name, data in files.items()
        ]
        return self.http.post(
            f"/jobs/{job_id}/complete",
            json={"attempt": 1, "step": step, "metrics": {}, "files": listed},
        )


@pytest.fixture
def worker_client(lifecycle_plane: ServedPlane) -> Iterator[Callable[..., WorkerClient]]:
    """``worker_client(*model_ids, base_model=, max_models=8)``: a ready worker row holding
    those models, and a client with its token (what a registered worker agent has)."""
    clients: list[httpx.Client] = []

    def make(*model_ids: str, base_model: str | None = None, max_models: int = 8) -> WorkerClient:
        with lifecycle_plane.sessions() as session:
            models = [session.get_one(Model, model_id) for model_id in model_ids]
            worker, token = worker_rows.create_worker(
                session,
                provider="manual",
                base_model=base_model or models[0].base_model,
                max_models=max_models,
                status="ready",
            )
            for model in models:
                model.worker_id = worker.id
            session.commit()
            worker_id = worker.id
        http = httpx.Client(
            base_url=f"{lifecycle_plane.url}/v1/worker",
            headers={"Authorization": f"Bearer {token}"},
            timeout=60,
        )
        clients.append(http)
        return WorkerClient(worker_id=worker_id, http=http)

    yield make
    for http in clients:
        http.close()


def leased_job(who: Who, worker: WorkerClient, model_id: str, *groups: dict[str, Any]) -> str:
    """A job of ``groups`` for ``model_id`` that ``who`` queued and ``worker`` leased (attempt
    1); its id."""
    job_id = who.queue_job(model_id, *groups)
    assert worker.lease()["id"] == job_id
    return job_id


class OnWorker(NamedTuple):
    """A new tenant, a model of its own, and a ready worker that model is placed on."""

    who: Who
    model_id: str
    worker: WorkerClient


@pytest.fixture
def on_worker(who: Callable[[], Who], worker_client: Callable[..., WorkerClient]) -> OnWorker:
    alice = who()
    model_id = str(alice.create_model()["id"])
    return OnWorker(alice, model_id, worker_client(model_id))


# How long a table must stay held to count as held by the watched request (``held_tables``).
HELD_FOR_S = 3.0


def held_tables(sessions: sessionmaker[Session], *tables: str) -> list[str]:
    """Which of ``tables`` (PostgreSQL) the request being watched holds: a table read by an
    open transaction cannot be locked exclusively by another. The request's thread waits in
    the watch meanwhile, so what its own transaction holds stays held; what the scheduler's
    pass holds at that moment is let go within its pass, so a table is only counted when it
    stays held for ``HELD_FOR_S``."""
    held = set(tables)
    deadline = time.monotonic() + HELD_FOR_S
    while held and time.monotonic() < deadline:
        with sessions() as session:
            for table in sorted(held):
                try:
                    session.execute(text(f"LOCK TABLE {table} IN ACCESS EXCLUSIVE MODE NOWAIT"))
                    held.discard(table)
                except OperationalError:
                    pass
                session.rollback()
        if held:
            time.sleep(0.1)
    return [table for table in tables if table in held]


class WatchedStore(LocalObjectStore):
    """The control plane's own store (its directory), which runs ``watch`` before each call of
    its method ``on`` (for ``iter_chunks``, before the first chunk is read: while the answer
    streams): an observer of the database while the store works, not a fake."""

    def __init__(self, root: Path, watch: Callable[[], None], *, on: str) -> None:
        super().__init__(root)
        self._watch = watch
        self._on = on

    def _watched(self, method: str) -> None:
        if method == self._on:
            self._watch()

    def put_bytes(self, key: str, data: bytes) -> None:
        self._watched("put_bytes")
        super().put_bytes(key, data)

    def get_bytes(self, key: str) -> bytes:
        self._watched("get_bytes")
        return super().get_bytes(key)

    def iter_chunks(self, key: str, *, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        chunks = super().iter_chunks(key, chunk_size=chunk_size)

        def watched() -> Iterator[bytes]:
            self._watched("iter_chunks")
            yield from chunks

        return watched()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        self._watched("list")
        return super().list(prefix)

    def copy(self, source_key: str, dest_key: str) -> int:
        self._watched("copy")
        return super().copy(source_key, dest_key)

    def delete_prefix(self, prefix: str) -> int:
        self._watched("delete_prefix")
        return super().delete_prefix(prefix)


@contextmanager
def store_watched(app: FastAPI, watch: Callable[[], None], *, on: str) -> Iterator[None]:
    """For the block, ``app``'s store runs ``watch`` each time its method ``on`` is called
    (``WatchedStore``), so that a test sees what the database holds while the store works."""
    with store_replaced(app, WatchedStore(app.state.store.root, watch, on=on)):
        yield


@contextmanager
def store_replaced(app: FastAPI, store: ObjectStore) -> Iterator[None]:
    """For the block, ``app`` uses ``store``: its routes and its Tinker service alike."""
    real = app.state.store
    app.state.store = app.state.tinker.store = store
    try:
        yield
    finally:
        app.state.store = app.state.tinker.store = real


@contextmanager
def undeletable(directory: Path) -> Iterator[None]:
    """Nothing in ``directory`` can be removed (or added) until the block ends."""
    if os.geteuid() == 0:
        subprocess.run(["chattr", "+i", str(directory)], check=True)
    else:
        directory.chmod(0o555)
    try:
        yield
    finally:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", str(directory)], check=True)
        else:
            directory.chmod(0o755)


def step_files(store: LocalObjectStore, *, tenant_id: str, model_id: str, step: int) -> list[str]:
    """The keys of every file of the step in the store, in whichever of its directories
    (``checkpoints/{step}/``, or a committing attempt's ``checkpoints/{step}-{writer}/``)."""
    root = keys.model_prefix(tenant_id=tenant_id, model_id=model_id) + "checkpoints/"
    return [
        info.key
        for info in store.list(root)
        if keys.checkpoint_step(info.key.removeprefix(root).partition("/")[0]) == step
    ]


def committed_prefix(
    sessions: sessionmaker[Session], *, tenant_id: str, model_id: str, step: int
) -> str:
    """Where the committed step's files lie, as its row records."""
    with sessions() as session:
        uri = session.scalars(
            select(Checkpoint.uri).where(Checkpoint.model_id == model_id, Checkpoint.step == step)
        ).one()
    assert uri is not None
    return keys.committed_prefix(tenant_id=tenant_id, model_id=model_id, uri=uri)

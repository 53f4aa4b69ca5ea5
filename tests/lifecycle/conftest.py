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
- ``copies_watched(app, watch)``: the app's store runs ``watch`` before each copy.
- ``undeletable(directory)``: entries of a real directory of the store cannot be removed,
  even by root (the immutable attribute as root, no write permission otherwise): the store
  fails for real.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, NamedTuple

import httpx
import pytest
from fastapi import FastAPI
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Checkpoint, Model
from skytrain_backend.storage import LocalObjectStore, ObjectStore, keys
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


class _CopyWatchedStore(LocalObjectStore):
    def __init__(self, root: Path, watch: Callable[[], None]) -> None:
        super().__init__(root)
        self._watch = watch

    def copy(self, source_key: str, dest_key: str) -> int:
        self._watch()
        return super().copy(source_key, dest_key)


@contextmanager
def copies_watched(app: FastAPI, watch: Callable[[], None]) -> Iterator[None]:
    """For the block, ``app``'s store runs ``watch`` each time it is about to copy an object:
    the same directory, an observer and not a fake, so that a test sees what the database
    holds while the store works."""
    with store_replaced(app, _CopyWatchedStore(app.state.store.root, watch)):
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

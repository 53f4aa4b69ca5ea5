"""What the SDK's tests do on the control plane's side, where a worker would act (there is none).

- ``commit_checkpoint``: a trained step, committed as the worker's commit path does (files
  into the real object store first, then the row), so listing, deleting and pulling it go
  through the real routes and the real store.
- ``add_events``: a job's events, written through the control plane's own job store as the
  worker routes do.
- ``JoinedWorker``: the worker's side of the worker protocol played over real HTTP (register,
  heartbeat), so the control plane's real scheduler places models on it and reports real
  serving states. Its front door is real TLS on loopback with a registered certificate, but
  answers only ``/health`` (which the control plane checks at registration): it has no
  engine, and nothing here serves a completion.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from contextlib import ExitStack
from typing import Any

import httpx
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

import skytrain
from skytrain_backend.db import jobs, workers
from skytrain_backend.db.models import TrainingJob
from skytrain_backend.protocol import EventType
from skytrain_backend.storage import ObjectStore, keys
from tests.api.support import add_checkpoint
from tests.client.test_trajectories import make_choice
from tests.fixtures.services import ApiKey
from tests.fixtures.tls import serve_tls


def sampled_trajectory(reward: float) -> skytrain.Trajectory:
    """A trajectory whose answer was sampled from skytrain's endpoint (it has logprobs)."""
    return skytrain.Trajectory(
        messages_and_choices=[{"role": "user", "content": "2+2?"}, make_choice("4")],
        reward=reward,
    )


def sampled_group(*rewards: float) -> skytrain.TrajectoryGroup:
    return skytrain.TrajectoryGroup([sampled_trajectory(r) for r in rewards])


def commit_checkpoint(
    db_sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    key: ApiKey,
    model_id: str,
    step: int,
    files: dict[str, bytes] | None = None,
    metrics: dict[str, float] | None = None,
) -> None:
    """Commit step ``step`` of the model as a worker's completed job does: files, then row."""
    add_checkpoint(
        db_sessions,
        store,
        tenant_id=key.tenant_id,
        model_id=model_id,
        step=step,
        files={"adapter_config.json": b'{"r": 8}'} if files is None else files,
        metrics=metrics or {},
    )


def stored_files(store: ObjectStore, *, key: ApiKey, model_id: str, step: int) -> list[str]:
    prefix = keys.checkpoint_prefix(tenant_id=key.tenant_id, model_id=model_id, step=step)
    return sorted(info.key.removeprefix(prefix) for info in store.list(prefix))


def add_events(
    db_sessions: sessionmaker[Session], job_id: str, *events: tuple[EventType, dict[str, Any]]
) -> list[str]:
    """Append the job's events as the worker routes do; their ids (the SDK's cursors)."""
    with db_sessions() as session:
        rows = [
            jobs.add_event(session, job_id=job_id, type=kind, data=data) for kind, data in events
        ]
        session.commit()
        return [str(row.id) for row in rows]


def end_job_silently(
    db_sessions: sessionmaker[Session], job_id: str, *, status: str, step: int | None = None
) -> None:
    """End the job by its status alone, with no event saying how. The control plane writes
    one whenever it ends a job; this is the state the SDK's status check is the fallback for."""
    with db_sessions() as session:
        job = session.get_one(TrainingJob, job_id)
        job.status = status
        job.result_step = step
        session.commit()


class JoinedWorker:
    """A worker row for ``base_model`` (as a provider's launch makes one) whose side of the
    worker protocol the test plays over HTTP: ``register()``, then ``heartbeat(...)``."""

    def __init__(
        self, db_sessions: sessionmaker[Session], *, control_plane_url: str, base_model: str
    ) -> None:
        with db_sessions() as session:
            row, token = workers.create_worker(
                session, provider="manual", base_model=base_model, max_models=4
            )
            session.commit()
            self.id = row.id
        self.base_model = base_model
        self._secret = secrets.token_urlsafe(24)
        self._http = httpx.Client(
            base_url=control_plane_url,
            headers={"Authorization": f"Bearer {token}"},
            timeout=30.0,
        )
        self._stack = ExitStack()
        self._front_door = self._stack.enter_context(serve_tls(self._health_only()))

    def _health_only(self) -> Starlette:
        async def health(request: Request) -> Response:
            authorized = request.headers.get("authorization") == f"Bearer {self._secret}"
            return Response(status_code=200 if authorized else 401)

        return Starlette(routes=[Route("/health", health)])

    def register(self) -> None:
        response = self._http.post(
            "/v1/worker/register",
            json={
                "base_model": self.base_model,
                "served_model_name": self.base_model,
                "engine_secret": self._secret,
                "port": self._front_door.port,
                "certificate": self._front_door.certificate,
                "capacity": {"max_models": 4, "max_lora_rank": 64},
            },
        )
        response.raise_for_status()
        assert response.json()["reachable"], response.json()

    def heartbeat(self, *, status: str = "ready", served: Sequence[tuple[str, int]] = ()) -> Any:
        response = self._http.post(
            "/v1/worker/heartbeat",
            json={
                "status": status,
                "served": [{"model_id": model_id, "step": step} for model_id, step in served],
            },
        )
        response.raise_for_status()
        return response.json()

    def close(self) -> None:
        self._http.close()
        self._stack.close()

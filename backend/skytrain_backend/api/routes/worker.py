"""The routes workers call (``/v1/worker/...``), authenticated with a worker token.

Workers pull: they register, heartbeat, lease jobs, report events and upload results. See the
"Worker <-> control plane" table in DEVELOPERS.md for the whole protocol.
"""

from __future__ import annotations

import tempfile
from datetime import timedelta
from typing import Annotated, Any, BinaryIO, cast

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import BaseModel, Field
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api.deps import SchedulerDep, SessionDep, SettingsDep, StoreDep
from skytrain_backend.db import registry, worker_tokens, workers
from skytrain_backend.db.models import Checkpoint, Model, TrainingJob, Worker, utcnow
from skytrain_backend.errors import AuthenticationFailed, NotFound
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.scheduler import queue
from skytrain_backend.storage import keys

router = APIRouter(prefix="/worker", tags=["workers"], include_in_schema=False)

_bearer = HTTPBearer(auto_error=False)
# How long a step a request was pinned to stays loaded on the model's worker.
PIN_TTL = timedelta(minutes=10)
HEARTBEAT_INTERVAL_S = 2.0
# Checkpoint uploads larger than this spill to a temporary file on their way to the store.
SPOOL_IN_MEMORY_BYTES = 16 * 1024 * 1024


def get_worker(
    session: SessionDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> Worker:
    if credentials is None:
        raise AuthenticationFailed("no worker token: send 'Authorization: Bearer swt-...'")
    return workers.authenticate_worker(session, token=credentials.credentials)


WorkerDep = Annotated[Worker, Depends(get_worker)]


class RegisterRequest(BaseModel):
    base_model: str
    served_model_name: str
    engine_endpoint: str
    engine_secret: str = Field(min_length=16)
    capacity: dict[str, Any] = Field(default_factory=dict)
    hardware: dict[str, Any] = Field(default_factory=dict)
    version: str = ""


class ServedCheckpoint(BaseModel):
    model_id: str
    step: int = Field(ge=0)


class HeartbeatRequest(BaseModel):
    status: str
    served: list[ServedCheckpoint] = Field(default_factory=list)
    job_id: str | None = None


class AttemptRequest(BaseModel):
    attempt: int = Field(ge=1)


class EventRequest(AttemptRequest):
    type: str
    data: dict[str, Any] = Field(default_factory=dict)


class CompleteRequest(AttemptRequest):
    step: int = Field(ge=1)
    metrics: dict[str, float] = Field(default_factory=dict)
    files: list[dict[str, Any]] = Field(min_length=1)


class FailRequest(AttemptRequest):
    error_message: str
    retryable: bool = False
    cancelled: bool = False


@router.post("/register")
def register(
    body: RegisterRequest,
    session: SessionDep,
    settings: SettingsDep,
    scheduler: SchedulerDep,
    credentials: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)],
) -> dict[str, Any]:
    """Register with a worker token, or join with an operator's join token (``swj-...``).

    A worker joining with a join token gets its own worker row and token (in the answer's
    ``worker_token``), which it uses from then on.
    """
    if credentials is None:
        raise AuthenticationFailed("no worker token: send 'Authorization: Bearer swt-...'")
    issued: str | None = None
    if worker_tokens.is_join_token(credentials.credentials):
        worker_tokens.verify_join_token(
            session, token=credentials.credentials, base_model=body.base_model
        )
        worker, issued = workers.create_worker(
            session,
            provider="manual",
            base_model=body.base_model,
            max_models=int(body.capacity.get("max_models", settings.worker_max_models)),
            status="starting",
        )
    else:
        worker = workers.authenticate_worker(session, token=credentials.credentials)
    workers.register(
        session,
        worker=worker,
        base_model=body.base_model,
        served_model_name=body.served_model_name,
        engine_endpoint=body.engine_endpoint,
        engine_secret=body.engine_secret,
        capacity=body.capacity,
        hardware={**body.hardware, "version": body.version},
    )
    scheduler.wake()
    answer: dict[str, Any] = {
        "worker_id": worker.id,
        "heartbeat_interval_s": HEARTBEAT_INTERVAL_S,
        "lease_s": settings.job_lease_s,
    }
    if issued is not None:
        answer["worker_token"] = issued
    return answer


@router.post("/heartbeat")
def heartbeat(body: HeartbeatRequest, worker: WorkerDep, session: SessionDep) -> dict[str, Any]:
    workers.heartbeat(
        session,
        worker=worker,
        status=body.status,
        served=[item.model_dump() for item in body.served],
    )
    return _assignments(session, worker=worker)


def _assignments(session: SessionDep, *, worker: Worker) -> dict[str, Any]:
    """The models placed on the worker and the steps it should serve; jobs to cancel."""
    placed = list(session.scalars(select(Model).where(Model.worker_id == worker.id)))
    pinned_since = utcnow() - PIN_TTL
    models = []
    for model in placed:
        latest = registry.latest_step(session, model_id=model.id)
        pinned = session.scalars(
            select(Checkpoint.step).where(
                Checkpoint.model_id == model.id,
                Checkpoint.deleted_at.is_(None),
                Checkpoint.last_requested_at > pinned_since,
            )
        )
        models.append(
            {
                "model_id": model.id,
                "latest_step": latest,
                "steps": sorted({latest, *pinned}),
                "model_config": ModelConfig.model_validate(model.config or {}).model_dump(),
            }
        )
    cancel = session.scalars(
        select(TrainingJob.id).where(
            TrainingJob.worker_id == worker.id,
            TrainingJob.status == "running",
            TrainingJob.cancel_requested.is_(True),
        )
    )
    return {
        "models": models,
        "cancel_job_ids": list(cancel),
        "drain": worker.status == "draining",
    }


@router.post("/jobs/lease")
def lease(worker: WorkerDep, session: SessionDep, settings: SettingsDep) -> Response:
    if worker.status == "draining":
        return Response(status_code=204)
    job = queue.lease_job(session, worker=worker, lease_s=settings.job_lease_s)
    if job is None:
        return Response(status_code=204)
    return JSONResponse({"job": queue.job_for_worker(session, job)})


@router.post("/jobs/{job_id}/renew")
def renew(
    job_id: str, body: AttemptRequest, worker: WorkerDep, session: SessionDep, settings: SettingsDep
) -> dict[str, Any]:
    job = queue.renew_lease(
        session, worker=worker, job_id=job_id, attempt=body.attempt, lease_s=settings.job_lease_s
    )
    return {"cancel_requested": job.cancel_requested}


@router.get("/jobs/{job_id}/input")
def job_input(
    job_id: str, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> StreamingResponse:
    job = _worker_job(session, worker=worker, job_id=job_id)
    model = session.get_one(Model, job.model_id)
    key = keys.job_input_key(tenant_id=model.tenant_id, model_id=model.id, job_id=job.id)
    return StreamingResponse(store.iter_chunks(key), media_type="application/x-ndjson")


@router.post("/jobs/{job_id}/events", status_code=201)
def job_event(job_id: str, body: EventRequest, worker: WorkerDep, session: SessionDep) -> None:
    queue.record_event(
        session, worker=worker, job_id=job_id, attempt=body.attempt, type=body.type, data=body.data
    )


@router.put("/jobs/{job_id}/files/{name}", status_code=204)
async def upload_file(
    job_id: str,
    name: str,
    request: Request,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    attempt: Annotated[int, Query(ge=1)],
) -> None:
    """Stage one checkpoint file under the attempt's own prefix (copied in on complete)."""
    job = await run_in_threadpool(
        queue.leased_job, session, worker=worker, job_id=job_id, attempt=attempt
    )
    model = await run_in_threadpool(session.get_one, Model, job.model_id)
    session.rollback()  # release the row lock while the bytes stream in
    key = queue.staged_file_key(job, tenant_id=model.tenant_id, attempt=attempt, name=name)
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
        async for chunk in request.stream():
            spool.write(chunk)
        spool.seek(0)
        await run_in_threadpool(store.put_stream, key, cast(BinaryIO, spool))


@router.post("/jobs/{job_id}/complete")
def complete(
    job_id: str, body: CompleteRequest, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> dict[str, Any]:
    checkpoint = queue.complete_job(
        session,
        store=store,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        step=body.step,
        metrics=body.metrics,
        files=[str(item["name"]) for item in body.files],
    )
    return {"step": checkpoint.step, "checkpoint_id": checkpoint.id}


@router.post("/jobs/{job_id}/fail")
def fail(
    job_id: str, body: FailRequest, worker: WorkerDep, session: SessionDep, scheduler: SchedulerDep
) -> dict[str, Any]:
    job = queue.fail_job(
        session,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        error_message=body.error_message,
        retryable=body.retryable,
        cancelled=body.cancelled,
    )
    scheduler.wake()
    return {"status": job.status}


@router.get("/models/{model_id}/checkpoints/{step}/files")
def checkpoint_files(
    model_id: str, step: int, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> dict[str, Any]:
    model = _placed_model(session, worker=worker, model_id=model_id)
    prefix = keys.checkpoint_prefix(tenant_id=model.tenant_id, model_id=model.id, step=step)
    return {
        "data": [
            {"name": info.key.removeprefix(prefix), "size": info.size}
            for info in store.list(prefix)
        ]
    }


@router.get("/models/{model_id}/checkpoints/{step}/files/{name}")
def checkpoint_file(
    model_id: str, step: int, name: str, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> StreamingResponse:
    model = _placed_model(session, worker=worker, model_id=model_id)
    key = keys.checkpoint_key(tenant_id=model.tenant_id, model_id=model.id, step=step, file=name)
    return StreamingResponse(store.iter_chunks(key), media_type="application/octet-stream")


def _worker_job(session: SessionDep, *, worker: Worker, job_id: str) -> TrainingJob:
    job = session.get(TrainingJob, job_id)
    if job is None or job.worker_id != worker.id:
        raise NotFound(f"training job {job_id!r} is not leased to this worker")
    return job


def _placed_model(session: SessionDep, *, worker: Worker, model_id: str) -> Model:
    model = session.get(Model, model_id)
    if model is None or model.worker_id != worker.id:
        raise NotFound(f"model {model_id!r} is not placed on worker {worker.id}")
    return model

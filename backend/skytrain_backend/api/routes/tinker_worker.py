"""The routes a worker's Tinker executor calls (``/v1/worker/tinker/...``), with its worker token.

A run is leased as a ``tinker`` training job (renewed and released through the job routes);
every call names the attempt it holds, so a worker that lost the run gets 409 and stops. A
save's checkpoint files are staged with the job routes' file upload, then committed here.
See ``scheduler.tinker`` for the queue and the rebuild plan.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from pydantic import BaseModel, Field
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api.deps import (
    NotifierDep,
    SessionDep,
    SettingsDep,
    StoreDep,
    TinkerDep,
    WaitS,
)
from skytrain_backend.api.longpoll import long_poll
from skytrain_backend.api.routes.worker import WorkerDep
from skytrain_backend.db import notify
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler import tinker as runs
from skytrain_backend.storage import keys

router = APIRouter(prefix="/worker/tinker", tags=["workers"], include_in_schema=False)

# The longest a worker's wait for the next operation is held.
MAX_WAIT_S = 20.0

Attempt = Annotated[int, Query(ge=1)]


class NextRequest(BaseModel):
    attempt: int = Field(ge=1)
    seq_id: int = Field(ge=0)
    wait_s: float = Field(default=10.0, ge=0, le=MAX_WAIT_S)


class CompleteRequest(BaseModel):
    attempt: int = Field(ge=1)
    result: dict[str, Any] = Field(default_factory=dict)
    has_output: bool = False


class FailRequest(BaseModel):
    attempt: int = Field(ge=1)
    error: str = Field(min_length=1)
    category: Literal["user", "server"] = "user"


class SaveRequest(BaseModel):
    attempt: int = Field(ge=1)
    files: list[str] = Field(default_factory=list)
    step: int = Field(ge=1)
    reuse_step: int | None = Field(default=None, ge=1)
    grads_pending: bool
    optim_steps: int = Field(ge=0)
    served: bool = False


@router.post("/lease")
async def lease(
    request: Request,
    worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    notifier: NotifierDep,
    wait_s: WaitS = 0.0,
) -> Response:
    """Lease a Tinker run placed on this worker, waiting up to ``wait_s`` for one (a run is a
    ``tinker`` training job: its queuing wakes the wait like any job's)."""
    worker_id = worker.id
    await run_in_threadpool(session.rollback)

    def claim() -> dict[str, Any] | None:
        try:
            current = session.get_one(Worker, worker_id)
            if current.status == "draining":
                return None
            return runs.lease_run(session, worker=current, lease_s=settings.job_lease_s)
        finally:
            session.rollback()

    def release(run: dict[str, Any]) -> None:
        queue.unlease(session, worker_id=worker_id, job_id=run["job_id"], attempt=run["attempt"])

    run = await long_poll(
        request,
        notifier,
        claim,
        channel=notify.JOBS,
        key=worker_id,
        wait_s=wait_s,
        release=release,
    )
    if run is None:
        return Response(status_code=204)
    return JSONResponse({"run": run})


@router.post("/runs/{job_id}/next")
async def next_operation(
    job_id: str, body: NextRequest, worker: WorkerDep, session: SessionDep, tinker: TinkerDep
) -> Response:
    """Operation ``seq_id`` of the run, waiting up to ``wait_s`` for it to arrive (holding no
    database connection meanwhile)."""
    worker_id = worker.id
    session.rollback()

    def look() -> tuple[bool, dict[str, Any] | None]:
        with tinker.sessions() as session:
            operation = runs.next_operation(
                session,
                worker=session.get_one(Worker, worker_id),
                job_id=job_id,
                attempt=body.attempt,
                seq_id=body.seq_id,
            )
            found = None if operation is None else runs.operation_for_worker(operation)
        return found is not None, found

    found = await tinker.watch(f"job:{job_id}", look, timeout_s=body.wait_s)
    if found is None:
        return Response(status_code=204)
    return JSONResponse({"operation": found})


@router.get("/runs/{job_id}/operations/{seq_id}")
def operation(
    job_id: str, seq_id: int, attempt: Attempt, worker: WorkerDep, session: SessionDep
) -> dict[str, Any]:
    _, found = runs.worker_operation(
        session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    return {"operation": runs.operation_for_worker(found)}


@router.get("/runs/{job_id}/operations/{seq_id}/input")
def operation_input(
    job_id: str,
    seq_id: int,
    attempt: Attempt,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
) -> StreamingResponse:
    run, found = runs.worker_operation(
        session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    if found.input_uri is None:
        raise InvalidRequest(f"operation {seq_id} has no input object")
    return StreamingResponse(
        store.iter_chunks(runs.input_key(run, seq_id)), media_type="application/octet-stream"
    )


@router.put("/runs/{job_id}/operations/{seq_id}/output", status_code=204)
async def operation_output(
    job_id: str,
    seq_id: int,
    attempt: Attempt,
    request: Request,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
) -> None:
    run, _ = await run_in_threadpool(
        runs.worker_operation, session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    key = runs.output_key(run, seq_id)
    session.rollback()
    await run_in_threadpool(store.put_bytes, key, await request.body())


@router.post("/runs/{job_id}/operations/{seq_id}/complete", status_code=204)
def complete(
    job_id: str,
    seq_id: int,
    body: CompleteRequest,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> None:
    request_id = runs.complete(
        session,
        store=store,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        seq_id=seq_id,
        result=body.result,
        has_output=body.has_output,
    )
    tinker.notify(f"request:{request_id}")


@router.post("/runs/{job_id}/operations/{seq_id}/fail", status_code=204)
def fail(
    job_id: str,
    seq_id: int,
    body: FailRequest,
    worker: WorkerDep,
    session: SessionDep,
    tinker: TinkerDep,
) -> None:
    request_id = runs.fail(
        session,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        seq_id=seq_id,
        error=body.error,
        category=body.category,
    )
    tinker.notify(f"request:{request_id}")


@router.post("/runs/{job_id}/operations/{seq_id}/save", status_code=204)
def save(
    job_id: str,
    seq_id: int,
    body: SaveRequest,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> None:
    request_id = runs.commit_save(
        session,
        store=store,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        seq_id=seq_id,
        files=body.files,
        step=body.step,
        reuse_step=body.reuse_step,
        grads_pending=body.grads_pending,
        optim_steps=body.optim_steps,
        served=body.served,
    )
    tinker.notify(f"request:{request_id}")


def _readable(
    session: SessionDep, *, worker: WorkerDep, job_id: str, attempt: int, model_id: str, step: int
) -> tuple[Model, str]:
    run = runs.leased_run(session, worker=worker, job_id=job_id, attempt=attempt)
    runs.readable_checkpoint(session, run=run, model_id=model_id, step=step)
    model = session.get_one(Model, model_id)
    return model, keys.checkpoint_prefix(tenant_id=model.tenant_id, model_id=model.id, step=step)


@router.get("/runs/{job_id}/checkpoints/{model_id}/{step}/files")
def checkpoint_files(
    job_id: str,
    model_id: str,
    step: int,
    attempt: Attempt,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
) -> dict[str, Any]:
    _, prefix = _readable(
        session, worker=worker, job_id=job_id, attempt=attempt, model_id=model_id, step=step
    )
    return {
        "data": [
            {"name": info.key.removeprefix(prefix), "size": info.size}
            for info in store.list(prefix)
        ]
    }


@router.get("/runs/{job_id}/checkpoints/{model_id}/{step}/files/{name}")
def checkpoint_file(
    job_id: str,
    model_id: str,
    step: int,
    name: str,
    attempt: Attempt,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
) -> StreamingResponse:
    _, prefix = _readable(
        session, worker=worker, job_id=job_id, attempt=attempt, model_id=model_id, step=step
    )
    return StreamingResponse(
        store.iter_chunks(prefix + _file_name(name)), media_type="application/octet-stream"
    )


def _file_name(name: str) -> str:
    """A checkpoint file's name: one path segment, never a way out of the prefix."""
    if not name or "/" in name or name in (".", ".."):
        raise InvalidRequest(f"{name!r} is not a checkpoint file name")
    return name

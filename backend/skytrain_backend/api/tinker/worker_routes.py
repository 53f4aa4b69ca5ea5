"""The routes a worker's Tinker executor calls (``/v1/worker/tinker/...``), with its worker token.

A run is leased as a ``tinker`` training job (renewed and released through the job routes);
every call names the attempt it holds, so a worker that lost the run gets 409 and stops. A
save's checkpoint files are staged with the job routes' file upload, then committed here.
See ``scheduler.tinker.worker_ops`` for the queue and the rebuild plan.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import StreamingResponse
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api import stored_files
from skytrain_backend.api.deps import (
    NotifierDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    StoreDep,
    WaitS,
    WorkerDep,
    in_thread,
)
from skytrain_backend.api.longpoll import long_poll
from skytrain_backend.api.tinker.deps import TinkerDep
from skytrain_backend.db import notify
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import tinker_ops
from skytrain_backend.scheduler import integrity, queue
from skytrain_backend.scheduler.tinker import runs, worker_ops

router = APIRouter(
    prefix="/worker/tinker", tags=["workers"], include_in_schema=False, route_class=SessionRoute
)

Attempt = Annotated[int, Query(ge=1)]


@router.post(
    "/lease", response_model=tinker_ops.TinkerLease, responses={204: {"description": "No run"}}
)
async def lease(
    request: Request,
    worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    notifier: NotifierDep,
    wait_s: WaitS = 0.0,
) -> tinker_ops.TinkerLease | Response:
    """Lease a Tinker run placed on this worker, waiting up to ``wait_s`` for one (a run is a
    ``tinker`` training job: its queuing wakes the wait like any job's)."""
    worker_id = worker.id

    def claim() -> tinker_ops.LeasedRun | None:
        try:
            current = session.get_one(Worker, worker_id)
            if current.status == "draining":
                return None
            return worker_ops.lease_run(
                session, worker=current, lease_s=settings.scheduler.job_lease_s
            )
        finally:
            session.rollback()

    def release(run: tinker_ops.LeasedRun) -> None:
        queue.unlease(session, worker_id=worker_id, job_id=run.job_id, attempt=run.attempt)

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
    return tinker_ops.TinkerLease(run=run)


@router.post(
    "/runs/{job_id}/next",
    response_model=tinker_ops.LeasedOperation,
    responses={204: {"description": "Not arrived yet"}},
)
async def next_operation(
    job_id: str,
    body: tinker_ops.NextOperationRequest,
    worker: WorkerDep,
    session: SessionDep,
    tinker: TinkerDep,
) -> tinker_ops.LeasedOperation | Response:
    """Operation ``seq_id`` of the run, waiting up to ``wait_s`` for it to arrive (holding no
    database connection meanwhile)."""
    worker_id = worker.id
    session.rollback()

    def look() -> tuple[bool, tinker_ops.LeasedOperation | None]:
        with tinker.sessions() as session:
            operation = worker_ops.next_operation(
                session,
                worker=session.get_one(Worker, worker_id),
                job_id=job_id,
                attempt=body.attempt,
                seq_id=body.seq_id,
            )
            found = None if operation is None else worker_ops.operation_for_worker(operation)
        return found is not None, found

    found = await tinker.watch(f"job:{job_id}", look, turn=worker_id, timeout_s=body.wait_s)
    if found is None:
        return Response(status_code=204)
    return found


@dataclass(frozen=True)
class _At:
    """The operation a route's path names, and the worker asking."""

    worker: Worker
    job_id: str
    seq_id: int

    def held(self, attempt: int) -> worker_ops.Held:
        return worker_ops.Held(self.worker, self.job_id, attempt, self.seq_id)


async def _at(job_id: str, seq_id: int, worker: WorkerDep) -> _At:
    return _At(worker, job_id, seq_id)


async def _held(at: Annotated[_At, Depends(_at)], attempt: Attempt) -> worker_ops.Held:
    return at.held(attempt)


At = Annotated[_At, Depends(_at)]
# The operation as a GET or PUT names it, with its attempt in the query.
HeldDep = Annotated[worker_ops.Held, Depends(_held)]


@router.get("/runs/{job_id}/operations/{seq_id}")
def operation(held: HeldDep, session: SessionDep) -> tinker_ops.LeasedOperation:
    _, found = worker_ops.worker_operation(session, held)
    return worker_ops.operation_for_worker(found)


@router.get("/runs/{job_id}/operations/{seq_id}/input")
def operation_input(held: HeldDep, session: SessionDep, store: StoreDep) -> StreamingResponse:
    run, found = worker_ops.worker_operation(session, held)
    if found.input_uri is None:
        raise InvalidRequest(f"operation {held.seq_id} has no input object")
    return StreamingResponse(
        store.iter_chunks(runs.input_key(run, held.seq_id)), media_type="application/octet-stream"
    )


@router.put("/runs/{job_id}/operations/{seq_id}/output", status_code=204)
async def operation_output(
    held: HeldDep,
    request: Request,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    tinker: TinkerDep,
) -> None:
    """Store the output of the operation the worker ran, its bytes taken from the tenant's
    storage quota first. An output that does not fit is not stored: the operation is failed
    with the quota's error instead (the worker's ``complete`` then finds it over)."""
    body = await request.body()
    request_id, key = await in_thread(
        session, worker_ops.take_output, session, held, size=len(body), settings=settings
    )
    if key is None:
        tinker.notify(f"request:{request_id}")
        return
    await run_in_threadpool(store.put_bytes, key, body)


@router.post("/runs/{job_id}/operations/{seq_id}/complete", status_code=204)
def complete(
    body: tinker_ops.OperationCompletion,
    at: At,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> None:
    request_id = worker_ops.complete(session, at.held(body.attempt), body, store=store)
    tinker.notify(f"request:{request_id}")


@router.post("/runs/{job_id}/operations/{seq_id}/fail", status_code=204)
def fail(body: tinker_ops.OperationFailure, at: At, session: SessionDep, tinker: TinkerDep) -> None:
    request_id = worker_ops.fail(session, at.held(body.attempt), body)
    tinker.notify(f"request:{request_id}")


@router.post("/runs/{job_id}/operations/{seq_id}/save", status_code=204)
def save(
    body: tinker_ops.SaveCommit,
    at: At,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
    settings: SettingsDep,
) -> None:
    request_id = worker_ops.commit_save(
        session, at.held(body.attempt), body, store=store, settings=settings
    )
    tinker.notify(f"request:{request_id}")


async def _readable_prefix(
    job_id: str, model_id: str, step: int, attempt: Attempt, worker: WorkerDep, session: SessionDep
) -> str:
    def find() -> str:
        run = worker_ops.leased_run(session, worker=worker, job_id=job_id, attempt=attempt)
        checkpoint = worker_ops.readable_checkpoint(session, run=run, model_id=model_id, step=step)
        model = session.get_one(Model, model_id)
        expected = integrity.committed(checkpoint)
        return integrity.files_prefix(
            tenant_id=model.tenant_id, model_id=model.id, step=step, expected=expected
        )

    return await in_thread(session, find)


# The store prefix of the checkpoint a GET names, which the worker's leased run may read.
ReadablePrefix = Annotated[str, Depends(_readable_prefix)]


@router.get("/runs/{job_id}/checkpoints/{model_id}/{step}/files")
def checkpoint_files(prefix: ReadablePrefix, store: StoreDep) -> tinker_ops.CheckpointFileList:
    return tinker_ops.CheckpointFileList(
        data=[
            tinker_ops.CheckpointFileInfo(name=info.key.removeprefix(prefix), size=info.size)
            for info in store.list(prefix)
        ]
    )


@router.get("/runs/{job_id}/checkpoints/{model_id}/{step}/files/{name}")
def checkpoint_file(name: str, prefix: ReadablePrefix, store: StoreDep) -> StreamingResponse:
    return stored_files.download(store, prefix, name)

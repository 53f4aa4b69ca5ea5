"""The routes workers call (``/v1/worker/...``), authenticated with a worker token.

Workers pull: they install the control plane's own wheel, register, heartbeat, lease jobs,
report events and upload results. Bodies and answers are the worker protocol's types in
``protocol/worker.py``. See the "Worker <-> control plane" table in DEVELOPERS.md for the whole
protocol.
"""

from __future__ import annotations

import functools
import tempfile
from datetime import timedelta
from typing import Annotated, BinaryIO, cast

from fastapi import APIRouter, Header, Query, Request, Response
from fastapi.responses import FileResponse, StreamingResponse
from sqlalchemy import or_, select
from starlette.concurrency import run_in_threadpool

from skytrain_backend import protocol, tls
from skytrain_backend.api import stored_files
from skytrain_backend.api.deps import (
    NotifierDep,
    PackageDep,
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    StoreDep,
    WaitS,
    WorkerCredentialsDep,
    WorkerDep,
    in_thread,
)
from skytrain_backend.api.longpoll import long_poll
from skytrain_backend.db import notify, registry, worker_tokens, workers
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    ModelReplica,
    ServedStep,
    TrainingJob,
    Worker,
    utcnow,
)
from skytrain_backend.errors import (
    AuthenticationFailed,
    InvalidRequest,
    NotFound,
    ObjectDamaged,
    ObjectMissing,
)
from skytrain_backend.observability import metrics
from skytrain_backend.protocol.worker import FileListing
from skytrain_backend.scheduler import integrity, queue
from skytrain_backend.storage import compression, keys

router = APIRouter(
    prefix="/worker", tags=["workers"], include_in_schema=False, route_class=SessionRoute
)

# How long a step a request was pinned to stays loaded on the model's worker.
PIN_TTL = timedelta(minutes=10)
HEARTBEAT_INTERVAL_S = 2.0
# Checkpoint uploads larger than this spill to a temporary file on their way to the store.
SPOOL_IN_MEMORY_BYTES = 16 * 1024 * 1024


def _endpoint(worker: Worker | None, body: protocol.WorkerRegistration, request: Request) -> str:
    """Where the control plane reaches the worker's front door.

    The worker's own ``advertise_url`` first; then the endpoint the provider found for the
    worker's cluster (SkyPilot's ``sky endpoints``); else the address the registration came
    from, on the port the worker listens on.
    """
    if body.advertise_url:
        return body.advertise_url.rstrip("/")
    if worker is not None and worker.provider == "skypilot" and worker.engine_endpoint:
        return worker.engine_endpoint
    host = request.client.host if request.client else "127.0.0.1"
    return f"https://[{host}]:{body.port}" if ":" in host else f"https://{host}:{body.port}"


def unreachable_message(endpoint: str, problem: str) -> str:
    return (
        f"the control plane cannot reach the worker's front door at {endpoint} ({problem}): "
        "open that port to the control plane, or start the worker with --advertise-url "
        "https://HOST:PORT at an address the control plane reaches"
    )


@router.get("/check", status_code=204, responses={204: {"description": "It may"}})
def check(
    session: SessionDep,
    credentials: WorkerCredentialsDep,
    base_model: Annotated[str, Query(min_length=1, max_length=512)],
) -> Response:
    """Whether this token may register a worker for ``base_model``: 204, or the refusal
    registering would get. A worker asks before it starts its engine (minutes for a large
    model on a GPU), so a wrong or revoked token fails at once."""
    if credentials is None:
        raise AuthenticationFailed(
            "no token: send 'Authorization: Bearer swj-...' (a join token) or a worker token"
        )
    _admit(session, token=credentials.credentials, base_model=base_model)
    session.rollback()
    return Response(status_code=204)


def _admit(session: SessionDep, *, token: str, base_model: str) -> Worker | None:
    """The worker ``token`` registers a worker for ``base_model`` as (None: a join token,
    which makes a new one); AuthenticationFailed or InvalidRequest saying why it may not."""
    if worker_tokens.is_join_token(token):
        worker_tokens.verify_join_token(session, token=token, base_model=base_model)
        return None
    worker = workers.authenticate_worker(session, token=token)
    workers.check_base_model(worker, base_model=base_model)
    return worker


@router.post("/register", response_model=protocol.WorkerRegistered)
def register(
    body: protocol.WorkerRegistration,
    request: Request,
    session: SessionDep,
    settings: SettingsDep,
    scheduler: SchedulerDep,
    credentials: WorkerCredentialsDep,
) -> protocol.WorkerRegistered:
    """Register with a worker token, or join with an operator's join token (``swj-...``).

    A worker joining with a join token gets its own worker row and token (in the answer's
    ``worker_token``), which it uses from then on. The control plane reaches the worker's
    front door (pinned to the certificate it registers) before answering; a worker it cannot
    reach is recorded as ``unreachable`` with the address tried, and is not routed to.
    """
    if credentials is None:
        raise AuthenticationFailed("no worker token: send 'Authorization: Bearer swt-...'")
    if body.advertise_url is not None and not body.advertise_url.startswith("https://"):
        raise InvalidRequest(
            f"advertise_url {body.advertise_url!r} must be an https:// URL: the worker's "
            "front door speaks TLS only"
        )
    try:
        tls.check_certificate(body.certificate)
    except ValueError as exc:
        raise InvalidRequest(f"certificate: {exc}") from None
    worker = _admit(session, token=credentials.credentials, base_model=body.base_model)
    endpoint = _endpoint(worker, body, request)
    # Nothing is locked while the worker is reached: that takes up to a few seconds.
    session.rollback()
    problem = tls.probe(endpoint, certificate_pem=body.certificate, secret=body.engine_secret)
    issued: str | None = None
    if worker is None:  # joined with a join token: a worker of its own
        worker, issued = workers.create_worker(
            session,
            provider="manual",
            base_model=body.base_model,
            max_models=body.capacity.max_models,
            status="starting",
        )
    assert worker is not None
    workers.register(
        session,
        worker=worker,
        base_model=body.base_model,
        served_model_name=body.served_model_name,
        engine_endpoint=endpoint,
        engine_secret=body.engine_secret,
        engine_certificate=body.certificate,
        capacity=body.capacity.model_dump(),
        hardware={**body.hardware, "version": body.version},
        unreachable=None if problem is None else unreachable_message(endpoint, problem),
    )
    scheduler.wake()
    return protocol.WorkerRegistered(
        worker_id=worker.id,
        heartbeat_interval_s=HEARTBEAT_INTERVAL_S,
        lease_s=settings.scheduler.job_lease_s,
        worker_token=issued,
        endpoint=endpoint,
        reachable=problem is None,
        message=worker.status_message,
    )


@router.post("/heartbeat", response_model=protocol.HeartbeatAnswer)
def heartbeat(
    body: protocol.Heartbeat, worker: WorkerDep, session: SessionDep
) -> protocol.HeartbeatAnswer:
    """Record what the worker serves; an unreachable worker is tried again first."""
    unreachable = None
    if worker.status == "unreachable" and worker.engine_endpoint and worker.engine_certificate:
        endpoint, certificate = worker.engine_endpoint, worker.engine_certificate
        secret = worker.engine_secret
        session.rollback()
        problem = tls.probe(endpoint, certificate_pem=certificate, secret=secret)
        unreachable = None if problem is None else unreachable_message(endpoint, problem)
    workers.heartbeat(
        session,
        worker=worker,
        status=body.status,
        served=[ServedStep(model_id=item.model_id, step=item.step) for item in body.served],
        unreachable=unreachable,
        stats=None if body.stats is None else body.stats.model_dump(exclude_none=True),
    )
    return _assignments(session, worker=worker)


def _assignments(session: SessionDep, *, worker: Worker) -> protocol.HeartbeatAnswer:
    """The models placed on the worker and the steps it should serve; jobs to cancel."""
    # Its models' homes and replicas (a draining replica still serves its requests in flight).
    replicas = select(ModelReplica.model_id).where(ModelReplica.worker_id == worker.id)
    placed = list(
        session.scalars(
            select(Model).where(or_(Model.worker_id == worker.id, Model.id.in_(replicas)))
        )
    )
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
            protocol.PlacedModel(
                model_id=model.id,
                latest_step=latest,
                steps=sorted({latest, *pinned}),
                model_config_=protocol.ModelConfig.model_validate(model.config or {}),
            )
        )
    cancel = session.scalars(
        select(TrainingJob.id).where(
            TrainingJob.worker_id == worker.id,
            TrainingJob.status == "running",
            TrainingJob.cancel_requested.is_(True),
        )
    )
    return protocol.HeartbeatAnswer(
        models=models, cancel_job_ids=list(cancel), drain=worker.status == "draining"
    )


@router.post(
    "/jobs/lease", response_model=protocol.JobLease, responses={204: {"description": "No job"}}
)
async def lease(
    request: Request,
    worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
    notifier: NotifierDep,
    wait_s: WaitS = 0.0,
) -> Response | protocol.JobLease:
    """Lease a queued job of a model placed on this worker: at once if there is one, else as
    soon as one is queued (or its model placed here) within ``wait_s``; 204 if none."""
    worker_id = worker.id
    if worker.status == "draining":
        return Response(status_code=204)  # at once: a draining worker gets nothing to wait for

    # The wait of a job leased for the first time: observed once the lease is delivered (a
    # lease taken back because the worker left is leased again, and counted then).
    first_waits: list[float] = []

    def claim() -> protocol.JobLease | None:
        try:
            current = session.get_one(Worker, worker_id)
            if current.status == "draining":
                return None
            job = queue.lease_job(session, worker=current, lease_s=settings.scheduler.job_lease_s)
            if job is None:
                return None
            if job.attempts == 1 and job.preemptions == 0:
                first_waits.append((utcnow() - job.created_at).total_seconds())
            return protocol.JobLease(job=queue.job_for_worker(session, job))
        finally:
            session.rollback()

    def release(lease: protocol.JobLease) -> None:
        queue.unlease(session, worker_id=worker_id, job_id=lease.job.id, attempt=lease.job.attempt)

    leased = await long_poll(
        request,
        notifier,
        claim,
        channel=notify.JOBS,
        key=worker_id,
        wait_s=wait_s,
        release=release,
    )
    if leased is None:
        return Response(status_code=204)
    if first_waits:
        metrics.JOB_QUEUE_WAIT.observe(first_waits[-1])
    return leased


@router.post("/jobs/{job_id}/renew", response_model=protocol.LeaseRenewed)
def renew(
    job_id: str,
    body: protocol.JobAttempt,
    worker: WorkerDep,
    session: SessionDep,
    settings: SettingsDep,
) -> protocol.LeaseRenewed:
    job = queue.renew_lease(
        session,
        worker=worker,
        job_id=job_id,
        attempt=body.attempt,
        lease_s=settings.scheduler.job_lease_s,
    )
    return protocol.LeaseRenewed(
        cancel_requested=job.cancel_requested, yield_requested=job.yield_requested
    )


@router.get("/jobs/{job_id}/input")
def job_input(
    job_id: str,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    accept_encoding: Annotated[str, Header(max_length=1024)] = "",
) -> StreamingResponse:
    """The job's trajectories as JSONL: zstd-encoded as stored when the worker accepts it."""
    job = _worker_job(session, worker=worker, job_id=job_id)
    model = session.get_one(Model, job.model_id)
    key = keys.job_input_key(tenant_id=model.tenant_id, model_id=model.id, job_id=job.id)
    session.commit()  # no transaction open while the store reads its first chunk
    try:
        chunks, encoded = compression.for_client(
            store.iter_chunks(key), accept_encoding=accept_encoding
        )
    except ObjectMissing:
        # Written before the job was queued: gone since, it will not come back.
        raise ObjectDamaged(
            f"the input of job {job.id} is gone from the object store since it was queued: "
            "the job cannot run; submit it again. The operator's `skytrain storage check` "
            "lists every such job"
        ) from None
    headers = {"Vary": "Accept-Encoding"}  # the answer depends on it
    if encoded:
        headers["Content-Encoding"] = "zstd"
    return StreamingResponse(chunks, media_type="application/x-ndjson", headers=headers)


@router.post("/jobs/{job_id}/events", status_code=201, response_model=protocol.JobEventRecorded)
def job_event(
    job_id: str, body: protocol.JobEventReport, worker: WorkerDep, session: SessionDep
) -> protocol.JobEventRecorded:
    """Record an event; the answer says whether the job is to stop (a cancel, or a yield to
    another tenant's job), which the worker reads after each optimizer step."""
    job = queue.record_event(
        session, worker=worker, job_id=job_id, attempt=body.attempt, type=body.type, data=body.data
    )
    return protocol.JobEventRecorded(
        cancel_requested=job.cancel_requested, yield_requested=job.yield_requested
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
    stored_files.file_name(name)

    def staged_key() -> str:
        job = queue.leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
        model = session.get_one(Model, job.model_id)
        return queue.staged_file_key(job, tenant_id=model.tenant_id, attempt=attempt, name=name)

    # The row lock and the connection are released before the bytes stream in.
    key = await in_thread(session, staged_key)
    with tempfile.SpooledTemporaryFile(max_size=SPOOL_IN_MEMORY_BYTES) as spool:
        async for chunk in request.stream():
            spool.write(chunk)
        spool.seek(0)
        # Its size and SHA-256 are recorded as it goes to the store (in a thread: the spool is
        # hashed there, off the event loop), so the commit compares them without reading the
        # object back (0.44 s per 64 MiB on SeaweedFS).
        await run_in_threadpool(
            functools.partial(queue.stage_file, store, key=key, stream=cast(BinaryIO, spool))
        )


@router.post("/jobs/{job_id}/complete", response_model=protocol.JobCompleted)
def complete(
    job_id: str,
    body: protocol.JobCompletion,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
) -> protocol.JobCompleted:
    checkpoint = metrics.timed_phase(
        "commit",
        lambda: queue.complete_job(
            session, body, store=store, worker=worker, job_id=job_id, settings=settings
        ),
    )
    metrics.record_job_completion(body.metrics)
    return protocol.JobCompleted(step=checkpoint.step, checkpoint_id=checkpoint.id)


@router.post("/jobs/{job_id}/fail", response_model=protocol.JobFailed)
def fail(
    job_id: str,
    body: protocol.JobFailure,
    worker: WorkerDep,
    session: SessionDep,
    scheduler: SchedulerDep,
) -> protocol.JobFailed:
    job = queue.fail_job(session, body, worker=worker, job_id=job_id)
    scheduler.wake()
    return protocol.JobFailed(status=job.status)


@router.post("/jobs/{job_id}/preempt", response_model=protocol.JobPreempted)
def preempt(
    job_id: str,
    body: protocol.JobPreemption,
    worker: WorkerDep,
    session: SessionDep,
    store: StoreDep,
    scheduler: SchedulerDep,
) -> protocol.JobPreempted:
    """Hand back a job asked to yield, its state saved in the attempt's staged files: it is
    queued again behind the job it yielded to, and resumes from that state."""
    job = queue.preempt_job(session, body, store=store, worker=worker, job_id=job_id)
    scheduler.wake()
    return protocol.JobPreempted(status=job.status)


@router.get("/jobs/{job_id}/saved-state")
def saved_state_files(
    job_id: str, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> FileListing:
    """The files of the state the job saved when it last yielded, to resume from."""
    prefix = _saved_state_prefix(session, worker=worker, job_id=job_id)
    return stored_files.listing(store, prefix)


@router.get("/jobs/{job_id}/saved-state/{name}")
def saved_state_file(
    job_id: str, name: str, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> StreamingResponse:
    prefix = _saved_state_prefix(session, worker=worker, job_id=job_id)
    return stored_files.download(store, prefix, name)


def _saved_state_prefix(session: SessionDep, *, worker: Worker, job_id: str) -> str:
    job = _worker_job(session, worker=worker, job_id=job_id)
    tenant_id = session.get_one(Model, job.model_id).tenant_id
    prefix = queue.saved_state_prefix(job, tenant_id=tenant_id)
    session.commit()  # no transaction open while the store lists
    return prefix


@router.get("/models/{model_id}/checkpoints/{step}/files")
def checkpoint_files(
    model_id: str, step: int, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> FileListing:
    """A step's files, to load it: ``{data: [{name, size, sha256?}]}`` (the SHA-256 as
    committed, for the worker to check what it downloads), or ``ObjectDamaged`` (with the step
    named) when the store no longer holds what was committed."""
    tenant_id, expected = _committed(session, worker=worker, model_id=model_id, step=step)
    session.rollback()
    files = integrity.checkpoint_files(
        store, tenant_id=tenant_id, model_id=model_id, step=step, expected=expected
    )
    return FileListing(data=[files[name] for name in sorted(files)])


def _committed(
    session: SessionDep, *, worker: Worker, model_id: str, step: int
) -> tuple[str, integrity.Committed | None]:
    """The placed model's tenant, and what its step was committed with (None: no files)."""
    model = _placed_model(session, worker=worker, model_id=model_id)
    row = session.scalar(
        select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.step == step)
    )
    return model.tenant_id, None if row is None else integrity.committed(row)


@router.get("/models/{model_id}/checkpoints/{step}/files/{name}")
def checkpoint_file(
    model_id: str, step: int, name: str, worker: WorkerDep, session: SessionDep, store: StoreDep
) -> StreamingResponse:
    tenant_id, expected = _committed(session, worker=worker, model_id=model_id, step=step)
    prefix = integrity.files_prefix(
        tenant_id=tenant_id, model_id=model_id, step=step, expected=expected
    )
    return stored_files.download(store, prefix, name)


@router.get("/package", response_class=FileResponse)
def package(
    session: SessionDep,
    worker_package: PackageDep,
    credentials: WorkerCredentialsDep,
) -> FileResponse:
    """This control plane's own skytrain wheel, for a worker's setup to install.

    Any worker token or live join token may download it; its file name (in the
    ``Content-Disposition``) carries the version, as pip needs.
    """
    if credentials is None:
        raise AuthenticationFailed(
            "no token: send 'Authorization: Bearer swj-...' (a join token) or a worker token"
        )
    if worker_tokens.is_join_token(credentials.credentials):
        worker_tokens.live_join_token(session, token=credentials.credentials)
    else:
        workers.authenticate_worker(session, token=credentials.credentials)
    session.rollback()
    path = worker_package.path()
    return FileResponse(path, filename=path.name, media_type="application/octet-stream")


def _worker_job(session: SessionDep, *, worker: Worker, job_id: str) -> TrainingJob:
    job = session.get(TrainingJob, job_id)
    if job is None or job.worker_id != worker.id:
        raise NotFound(f"training job {job_id!r} is not leased to this worker")
    return job


def _placed_model(session: SessionDep, *, worker: Worker, model_id: str) -> Model:
    model = session.get(Model, model_id)
    if model is None or (
        model.worker_id != worker.id
        and session.scalar(
            select(ModelReplica.id).where(
                ModelReplica.model_id == model_id, ModelReplica.worker_id == worker.id
            )
        )
        is None
    ):
        raise NotFound(f"model {model_id!r} is not placed on worker {worker.id}")
    return model

"""The training-job queue: leases, renewals, results, retries.

A worker leases one queued job of a model placed on it; the lease lasts ``lease_s`` and the
worker renews it while it trains. Every call from the worker names the *attempt* it holds
(the job's ``attempts`` counter when it was leased), so a worker that lost its lease (it went
silent, the job was leased again) cannot touch the job any more: its calls get 409.

Exactly-once steps: a job's result is committed by ``complete_job`` in one transaction that
checks the lease, inserts the checkpoint row (unique per model and step) and finishes the job.
Its files were uploaded under the attempt's own staging prefix, are checked against the sizes
and SHA-256s the worker sent and copied into the attempt's own directory of the step before
that transaction, with no transaction open; the row records that directory. The lease is
checked before the copies and again in that transaction: a stale attempt commits nothing, and
what it copies (even after another attempt committed the step) lands beside the committed
files, never over them.

Time slices: a running job that has held its worker longer than ``job_time_slice_s`` while
another tenant's job waits for that worker is asked to yield (``request_yields``). Its worker
stops after the optimizer step in progress, uploads the job's state as the attempt's staged
files and hands the job back (``preempt_job``): queued again, not a failed attempt, with its
tenant's turn just used, so the waiting job is leased first. The next attempt resumes from
the saved state (``LeasedJob.steps_done``), on any worker.

PostgreSQL leases with ``FOR UPDATE SKIP LOCKED`` so concurrent workers never take the same
job; SQLite serializes writers, and a process lock keeps its read-then-write atomic.
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, BinaryIO

from pydantic import TypeAdapter
from sqlalchemy import Select, exists, func, select
from sqlalchemy.orm import Session, aliased

from skytrain_backend.config import Settings
from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import registry, tenants
from skytrain_backend.db.models import (
    Checkpoint,
    CommittedFile,
    Model,
    ServedStep,
    Tenant,
    TrainingJob,
    Worker,
    utcnow,
)
from skytrain_backend.errors import (
    Conflict,
    InvalidRequest,
    LeaseLost,
    NotFound,
    QuotaExceeded,
    SkytrainError,
    StorageError,
    StoreUnavailable,
)
from skytrain_backend.observability import metrics as observed
from skytrain_backend.protocol import (
    TERMINAL_JOB_STATUSES,
    JobCompletion,
    JobFailure,
    JobPreemption,
    LeasedJob,
    ModelConfig,
    StagedFile,
)
from skytrain_backend.storage import keys
from skytrain_backend.storage.base import CHUNK_BYTES, ObjectDigest, ObjectStore

logger = logging.getLogger(__name__)

_SQLITE_LEASE_LOCK = threading.Lock()

# What a worker reports during a job: the end events are the control plane's own.
WORKER_EVENT_TYPES = frozenset(
    {"training_started", "training_resumed", "gradient_step", "job_timeline"}
)
# The jobs a worker's training loop leases; ``tinker`` jobs (a Tinker training run's lease on
# its model) are leased by the worker's Tinker executor.
TRAINING_JOB_KINDS = ("rl", "sft")


def lease_job(
    session: Session,
    *,
    worker: Worker,
    lease_s: float,
    kinds: Sequence[str] = TRAINING_JOB_KINDS,
) -> TrainingJob | None:
    """Give ``worker`` a queued job (of ``kinds``) of a model placed on it, if any.

    Tenants take turns: the job goes to the tenant whose newest lease is oldest (one that
    never had a job first), and within a tenant to its oldest queued job. So one tenant's
    thirty queued jobs do not all run before another tenant's one. A job that yielded its
    worker counts as leased when it yielded, so the job it yielded to goes first. A model
    never has two running jobs: its next job waits until the running one ends. A worker the
    control plane cannot reach gets none: the adapter it trained could not be served.
    """
    if worker.status == "unreachable":
        session.rollback()
        return None
    if session.get_bind().dialect.name == "sqlite":
        with _SQLITE_LEASE_LOCK:
            return _lease(session, worker=worker, lease_s=lease_s, kinds=kinds, skip_locked=False)
    return _lease(session, worker=worker, lease_s=lease_s, kinds=kinds, skip_locked=True)


def _lease(
    session: Session, *, worker: Worker, lease_s: float, kinds: Sequence[str], skip_locked: bool
) -> TrainingJob | None:
    statement = _waiting_jobs(worker_id=worker.id, kinds=kinds).limit(1)
    if skip_locked:
        statement = statement.with_for_update(skip_locked=True, of=TrainingJob)
    job = session.scalar(statement)
    if job is None:
        session.rollback()
        return None
    now = utcnow()
    job.status = "running"
    job.worker_id = worker.id
    job.attempts += 1
    if job.saved_attempt is None:
        job.base_step = registry.latest_step(session, model_id=job.model_id)
    # else: the saved state was trained from the base step it started at.
    job.lease_expires_at = now + timedelta(seconds=lease_s)
    job.started_at = job.started_at or now
    job.leased_at = now
    job.yield_requested = False
    session.commit()
    return job


def _waiting_jobs(*, worker_id: str, kinds: Sequence[str]) -> Select[TrainingJob]:
    """The queued jobs ``worker_id`` may lease, in the order it leases them."""
    running = aliased(TrainingJob)
    leased, owned = aliased(TrainingJob), aliased(Model)
    tenant_last_leased = (
        select(func.max(leased.leased_at))
        .join(owned, owned.id == leased.model_id)
        .where(owned.tenant_id == Model.tenant_id)
        .scalar_subquery()
    )
    return (
        select(TrainingJob)
        .join(Model, Model.id == TrainingJob.model_id)
        .where(
            TrainingJob.status == "queued",
            TrainingJob.kind.in_(kinds),
            Model.worker_id == worker_id,
            ~exists().where(running.model_id == TrainingJob.model_id, running.status == "running"),
        )
        .order_by(tenant_last_leased.asc().nulls_first(), TrainingJob.created_at, TrainingJob.id)
    )


def request_yields(session: Session, *, slice_s: float) -> list[TrainingJob]:
    """Ask each running training job that has held its worker for more than ``slice_s`` to
    yield, when another tenant's job waits for that worker; the jobs asked.

    The worker learns it with its next event (one per optimizer step) or lease renewal,
    stops after the step in progress and hands the job back with its state saved, so the
    waiting job starts within ``slice_s`` + one step + the save (DEVELOPERS.md, "Time
    slices"). Only a job of another tenant counts: a tenant's own jobs take their turn
    after each other, and Tinker runs are not training jobs of the worker's job loop.
    """
    cutoff = utcnow() - timedelta(seconds=slice_s)
    holders = session.execute(
        select(TrainingJob, Model.tenant_id)
        .join(Model, Model.id == TrainingJob.model_id)
        .where(
            TrainingJob.status == "running",
            TrainingJob.kind.in_(TRAINING_JOB_KINDS),
            TrainingJob.worker_id.is_not(None),
            TrainingJob.yield_requested.is_(False),
            TrainingJob.leased_at <= cutoff,
        )
    ).all()
    asked = []
    for job, tenant_id in holders:
        assert job.worker_id is not None
        waiting = session.scalar(
            _waiting_jobs(worker_id=job.worker_id, kinds=TRAINING_JOB_KINDS)
            .where(Model.tenant_id != tenant_id)
            .limit(1)
        )
        if waiting is None:
            continue
        job.yield_requested = True
        asked.append(job)
        logger.info(
            "asking job %s to yield worker %s: job %s of another tenant waits for it",
            job.id,
            job.worker_id,
            waiting.id,
        )
    session.commit()
    return asked


def leased_job(session: Session, *, worker: Worker, job_id: str, attempt: int) -> TrainingJob:
    """The job ``worker`` holds as ``attempt``, locked for update; LeaseLost otherwise."""
    job = _locked_job(session, job_id=job_id)
    if job is None:
        raise NotFound(f"training job {job_id!r} not found")
    if not _held(job, worker_id=worker.id, attempt=attempt):
        raise LeaseLost(
            f"training job {job_id} attempt {attempt} is no longer held by this worker "
            f"(status {job.status}, attempt {job.attempts})"
        )
    return job


def _locked_job(session: Session, *, job_id: str) -> TrainingJob | None:
    return session.scalar(select(TrainingJob).where(TrainingJob.id == job_id).with_for_update())


def _held(job: TrainingJob, *, worker_id: str, attempt: int) -> bool:
    """Whether the job runs under the lease ``worker_id`` took as ``attempt``."""
    return job.status == "running" and job.worker_id == worker_id and job.attempts == attempt


def unlease(session: Session, *, worker_id: str, job_id: str, attempt: int) -> None:
    """Hand back a job leased as ``attempt`` to a worker that hung up before it got the
    answer: queued again, that attempt uncounted, as if never leased; cancelled if a cancel
    came meanwhile, as ``release_jobs`` does (a job no longer held that way is left alone)."""
    job = _locked_job(session, job_id=job_id)
    if job is None or not _held(job, worker_id=worker_id, attempt=attempt):
        session.rollback()
        return
    job.attempts -= 1
    if job.attempts == 0:
        # The tenant's turn is not used up by a lease nobody received.
        job.started_at = job.leased_at = None
    # A job is queued only with attempts to spare, so with that attempt taken back it has
    # some again: it is never failed here, and has no reason to give.
    _cancel_or_requeue(session, job)
    session.commit()


def renew_lease(
    session: Session, *, worker: Worker, job_id: str, attempt: int, lease_s: float
) -> TrainingJob:
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    job.lease_expires_at = utcnow() + timedelta(seconds=lease_s)
    session.commit()
    return job


def record_event(
    session: Session,
    *,
    worker: Worker,
    job_id: str,
    attempt: int,
    type: str,
    data: dict[str, Any],
) -> TrainingJob:
    """Record an event of the attempt; the job, whose flags say what is asked of it."""
    if type not in WORKER_EVENT_TYPES:
        raise InvalidRequest(
            f"workers report {sorted(WORKER_EVENT_TYPES)} events; {type!r} is not one of them"
        )
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    job_rows.add_event(session, job_id=job_id, type=type, data=data)  # type: ignore[arg-type]
    session.commit()
    return job


def staged_file_key(job: TrainingJob, *, tenant_id: str, attempt: int, name: str) -> str:
    return _staged_prefix(job, tenant_id=tenant_id, attempt=attempt) + name


def staged_digest_key(staged_key: str) -> str:
    """Where the size and SHA-256 of the staged file at ``staged_key`` are recorded, as its
    upload streamed through the control plane (``attempts/{n}.digests/{name}`` beside
    ``attempts/{n}/{name}``: out of the attempt's listing, gone with ``attempts/``)."""
    head, _, name = staged_key.rpartition("/")
    return f"{head}.digests/{name}"


def stage_file(store: ObjectStore, *, key: str, stream: BinaryIO) -> ObjectDigest:
    """Store a staged file from ``stream`` (a local spool, read twice) and record its size and
    SHA-256 beside it, so that the commit compares them with the worker's without reading
    the object back. The record is removed first: a file whose upload fails midway has none,
    and the commit reads that one back instead."""
    digest_key = staged_digest_key(key)
    store.delete(digest_key)
    sha256 = hashlib.sha256()
    size = 0
    while chunk := stream.read(CHUNK_BYTES):
        sha256.update(chunk)
        size += len(chunk)
    stream.seek(0)
    store.put_stream(key, stream)
    digest = ObjectDigest(size=size, sha256=sha256.hexdigest())
    store.put_bytes(digest_key, json.dumps({"size": size, "sha256": digest.sha256}).encode())
    return digest


def _recorded_digest(store: ObjectStore, key: str) -> ObjectDigest | None:
    """The size and SHA-256 recorded when the file at ``key`` was staged; None when there is
    no usable record (an upload cut short, or a store hiccup): the caller reads it back."""
    try:
        recorded = json.loads(store.get_bytes(staged_digest_key(key)))
        return ObjectDigest(size=int(recorded["size"]), sha256=str(recorded["sha256"]))
    except (SkytrainError, ValueError, KeyError, TypeError):
        return None


def _staged_prefix(job: TrainingJob, *, tenant_id: str, attempt: int) -> str:
    prefix = keys.model_prefix(tenant_id=tenant_id, model_id=job.model_id)
    return f"{prefix}jobs/{job.id}/attempts/{attempt}/"


def saved_state_prefix(job: TrainingJob, *, tenant_id: str) -> str:
    """Where the state the job saved when it last yielded lies (NotFound if it has none)."""
    if job.saved_attempt is None:
        raise NotFound(f"training job {job.id} has no saved state: it starts from the beginning")
    return _staged_prefix(job, tenant_id=tenant_id, attempt=job.saved_attempt)


def preempt_job(
    session: Session, report: JobPreemption, *, store: ObjectStore, worker: Worker, job_id: str
) -> TrainingJob:
    """Take back a job that yielded at a step boundary with its state in the attempt's
    staged files (``report``): queued again behind the job it yielded to, its attempt not counted as
    a failure, resumed from that state by its next attempt.

    Only a job asked to yield may: a worker cannot keep a job going for ever by handing it
    back. Its state must be further on than the one it resumed from, and every file must be
    in the store as named; otherwise nothing changes (InvalidRequest)."""
    attempt, steps_done, files = report.attempt, report.steps_done, report.files
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    if not job.yield_requested:
        # Not a 409: that tells a worker its lease is lost.
        raise InvalidRequest(
            f"training job {job_id} was not asked to yield its worker: finish it, or hand it "
            "back with POST .../fail"
        )
    if steps_done <= (job.saved_steps or 0):
        raise InvalidRequest(
            f"job {job_id} resumed after step {job.saved_steps}; a state saved after step "
            f"{steps_done} is no further on"
        )
    tenant_id = session.get_one(Model, job.model_id).tenant_id
    prefix = _staged_prefix(job, tenant_id=tenant_id, attempt=attempt)
    stored = {info.key.removeprefix(prefix): info.size for info in store.list(prefix)}
    missing = [f"{f.name} ({f.size} bytes)" for f in files if stored.get(f.name) != f.size]
    if missing:
        raise InvalidRequest(
            f"the saved state of job {job_id} is not in the store as named: {missing}; "
            "upload each file with PUT .../files/{name} first"
        )
    previous = job.saved_attempt
    job.saved_attempt, job.saved_steps = attempt, steps_done
    job.preemptions += 1
    # The tenant's turn ends now: the job it yielded to, whose tenant's newest lease is
    # older, goes first.
    job.leased_at = utcnow()
    job_rows.add_event(
        session,
        job_id=job.id,
        type="training_preempted",
        data={
            "steps_done": steps_done,
            "attempt": attempt,
            "message": f"another tenant's job was waiting for the worker: this job stopped "
            f"after step {steps_done}, saved its state, and resumes from there once that "
            "job has started",
        },
    )
    _cancel_or_requeue(session, job)
    _woke(worker)
    session.commit()
    if previous is not None and previous != attempt:
        _delete_quietly(store, _staged_prefix(job, tenant_id=tenant_id, attempt=previous))
    return job


def _woke(worker: Worker) -> None:
    """A worker that completes or hands back a job woke its engine first, and holds the GPU
    until the answer (worker/jobs.py: no Tinker operation puts it back to sleep meanwhile):
    routable now, not at its next heartbeat."""
    if worker.status == "sleeping":
        worker.status = "training"


def complete_job(
    session: Session,
    report: JobCompletion,
    *,
    store: ObjectStore,
    worker: Worker,
    job_id: str,
    settings: Settings,
) -> Checkpoint:
    """Commit the attempt's checkpoint (``report``: its step, metrics and staged files) and
    finish the job, once.

    Three phases, so that no transaction (nor the job's row lock) is held while the store
    works: a short transaction checks the lease and the step; then, with no connection held,
    each staged file is checked against the size and SHA-256 the worker sent (``check_staged``:
    a listing and the digests recorded at staging; a mismatch commits nothing: InvalidRequest)
    and copied into place (``copy_staged``: one gone meanwhile is a Conflict); then a short
    transaction checks the lease again, inserts the checkpoint row and finishes the job.

    The files are copied into the attempt's own directory of the step (``keys.
    checkpoint_prefix`` with the attempt as writer), recorded in the row's ``uri``: an
    attempt that lost its lease while copying, and is still copying when another attempt
    commits the step, writes beside the committed files, never over them (the garbage sweep
    takes what it wrote)."""
    attempt, step, metrics, files = report.attempt, report.step, report.metrics, report.files
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    model = session.get_one(Model, job.model_id)
    _check_next_step(session, job=job, step=step)
    if not files:
        raise InvalidRequest("a checkpoint needs its files")
    tenant_id, model_id = model.tenant_id, model.id
    writer = keys.attempt_writer(job_id=job.id, attempt=attempt)
    prefix = keys.checkpoint_prefix(
        tenant_id=tenant_id, model_id=model_id, step=step, writer=writer
    )
    staged = keys.model_prefix(tenant_id=tenant_id, model_id=model_id) + f"jobs/{job.id}/"
    attempt_prefix = _staged_prefix(job, tenant_id=tenant_id, attempt=attempt)
    session.rollback()  # the row lock and the connection go back before the store works

    def fail_commit(error: str) -> None:
        job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
        _fail_commit(
            session, store=store, job=job, step=step, prefixes=(prefix, staged), error=error
        )

    try:
        check_staged(store, prefix=attempt_prefix, files=files, job_id=job_id, step=step)
        total = copy_staged(
            store, source=attempt_prefix, dest=prefix, files=files, job_id=job_id, step=step
        )
    except StoreUnavailable as exc:
        # The store is away for now: nothing is committed, the job stays leased and its staged
        # files stay where they are, so the worker's retry commits once the store is back
        # (copying again over what was copied; the garbage sweep takes that if none comes).
        raise StoreUnavailable(
            f"the object store could not be reached while committing step {step} of job "
            f"{job_id}; nothing was committed: retry ({exc.message})"
        ) from exc
    except StorageError as exc:
        logger.error("committing step %d of job %s failed: %s", step, job_id, exc.message)
        fail_commit(
            f"the object store failed while saving the checkpoint of step {step}, so "
            "nothing was committed: submit the job again (the operator's log has the store's "
            "error)"
        )
        raise StorageError(
            f"the object store failed while committing step {step} of job {job_id}; the job "
            "has failed and its files were removed"
        ) from exc
    # The checkpoint's bytes are taken from the tenant's storage quota in the commit's
    # transaction (the tenant's row lock first, then the job's, as every writer takes them):
    # a checkpoint that does not fit fails the job, its files removed, rather than pass it.
    limits = tenants.limits_of(session.get_one(Tenant, tenant_id), settings)
    try:
        tenants.reserve_storage(
            session,
            tenant_id=tenant_id,
            limits=limits,
            adding=total,
            what=f"the checkpoint of step {step} of job {job_id}",
        )
    except QuotaExceeded as exc:
        fail_commit(f"nothing was committed: {exc.message}; then submit the job again")
        raise
    # The lease is checked again: a worker whose lease was lost while the files were copied
    # commits nothing (LeaseLost); what it copied lies in its own directory, for the sweep.
    job = leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    _check_next_step(session, job=job, step=step)
    checkpoint = Checkpoint(
        model_id=model_id,
        step=step,
        uri=store.uri(prefix.rstrip("/")),
        metrics=metrics,
        size_bytes=total,
        files=[CommittedFile(name=item.name, size=item.size, sha256=item.sha256) for item in files],
    )
    session.add(checkpoint)
    # The worker loaded and verified the new adapter before completing: it serves it now, so
    # the request that follows training_ended goes to the new step.
    served = [item for item in worker.served or [] if item.get("model_id") != model_id]
    worker.served = [*served, ServedStep(model_id=model_id, step=step)]
    _woke(worker)
    now = utcnow()
    observed.JOBS_ENDED.labels(status="succeeded").inc()
    job.status = "succeeded"
    job.result_step = step
    job.finished_at = now
    job.lease_expires_at = None
    job_rows.add_event(
        session, job_id=job.id, type="training_ended", data={"step": step, **metrics}
    )
    session.commit()
    _delete_quietly(store, staged + "attempts/")
    return checkpoint


def _check_next_step(session: Session, *, job: TrainingJob, step: int) -> None:
    expected = registry.next_step(session, model_id=job.model_id)
    if step != expected:
        raise InvalidRequest(f"job {job.id} trains step {expected}, not step {step}")


def check_staged(
    store: ObjectStore, *, prefix: str, files: Sequence[StagedFile], job_id: str, step: int
) -> None:
    """Each file is in the store under ``prefix`` with the size and SHA-256 the worker sent:
    one listing for the sizes (a truncated upload fails here, unread), then each file's
    SHA-256 as recorded while its upload streamed through (``stage_file``); only a file with
    no record of its size is read back and hashed. InvalidRequest naming every file that
    differs."""
    stored = {info.key.removeprefix(prefix): info.size for info in store.list(prefix)}
    wrong = []
    for item in files:
        size = stored.get(item.name)
        if size is None:
            wrong.append(f"{item.name} is not staged")
            continue
        if size != item.size:
            wrong.append(f"{item.name} is staged with {size} bytes, not {item.size}")
            continue
        recorded = _recorded_digest(store, prefix + item.name)
        if recorded is None or recorded.size != size:
            recorded = store.digest(prefix + item.name)
        if recorded.sha256 != item.sha256:
            wrong.append(f"{item.name} is staged with a SHA-256 other than {item.sha256}")
    if wrong:
        raise InvalidRequest(
            f"the checkpoint of step {step} of job {job_id} was not committed: "
            f"{'; '.join(wrong)}. Upload each file with PUT .../files/{{name}} again"
        )


def copy_staged(
    store: ObjectStore,
    *,
    source: str,
    dest: str,
    files: Sequence[StagedFile],
    job_id: str,
    step: int,
) -> int:
    """Copy the checked staged files from ``source`` to ``dest``; their total bytes. A staged
    file gone meanwhile (deleted while the commit copied: a worker's retry, or by hand) is a
    Conflict, nothing committed: upload it again."""
    total = 0
    for item in files:
        try:
            total += store.copy(source + item.name, dest + item.name)
        except NotFound:
            raise Conflict(
                f"the checkpoint of step {step} of job {job_id} was not committed: "
                f"{item.name} was removed from the staged files while they were copied. "
                "Upload each file with PUT .../files/{name} again and complete again"
            ) from None
    return total


def _fail_commit(
    session: Session,
    *,
    store: ObjectStore,
    job: TrainingJob,
    step: int,
    prefixes: tuple[str, str],
    error: str,
) -> None:
    """End a job whose checkpoint could not be committed (the store failed, or it did not fit
    the tenant's storage quota), saying why (``error``). ``prefixes``: the checkpoint's (files
    copied so far) and the job's (files staged by its attempts); both are deleted once the
    job's end is committed (no row lock is held while the store works), and the sweep
    collects what the store refuses now."""
    _finish(session, job, status="failed", error=error)
    session.commit()
    checkpoint_prefix, job_prefix = prefixes
    _delete_quietly(store, checkpoint_prefix)
    _delete_quietly(store, job_prefix + "attempts/")


def _delete_quietly(store: ObjectStore, prefix: str) -> None:
    try:
        store.delete_prefix(prefix)
    except StorageError as exc:
        logger.warning("could not delete %s (left to the sweep): %s", prefix, exc.message)


def fail_job(session: Session, report: JobFailure, *, worker: Worker, job_id: str) -> TrainingJob:
    """End the attempt the worker reports failed: cancelled, queued again while a retry may
    fix it and attempts are left, else failed with its message."""
    job = leased_job(session, worker=worker, job_id=job_id, attempt=report.attempt)
    if report.cancelled:
        _finish(session, job, status="cancelled", error="the job was cancelled")
    elif report.retryable and _failed_attempts(job) < job.max_attempts:
        _requeue(job)
    else:
        _finish(session, job, status="failed", error=report.error_message)
    session.commit()
    return job


def _failed_attempts(job: TrainingJob) -> int:
    """The attempts that ended in a failure or a lost worker (yields do not count)."""
    return job.attempts - job.preemptions


def _requeue(job: TrainingJob) -> None:
    job.status = "queued"
    job.worker_id = None
    job.lease_expires_at = None
    job.yield_requested = False


def _finish(session: Session, job: TrainingJob, *, status: str, error: str) -> None:
    observed.JOBS_ENDED.labels(status=status).inc()
    job.status = status
    job.error = error
    job.finished_at = utcnow()
    job.lease_expires_at = None
    job_rows.add_event(
        session, job_id=job.id, type="training_failed", data={"error_message": error}
    )


def release_jobs(session: Session, *, jobs: list[TrainingJob], reason: str) -> None:
    """Jobs whose worker is gone, for ``reason``: cancelled if a cancel came for them, else
    back to the queue, or failed with ``reason`` once out of attempts."""
    for job in jobs:
        if job.status in TERMINAL_JOB_STATUSES:
            continue
        if job.cancel_requested or _failed_attempts(job) < job.max_attempts:
            _cancel_or_requeue(session, job)
        else:
            _finish(
                session,
                job,
                status="failed",
                error=f"gave up after {_failed_attempts(job)} attempts; the last one: {reason}",
            )
    session.commit()


def _cancel_or_requeue(session: Session, job: TrainingJob) -> None:
    """A running job its worker no longer runs: cancelled if a cancel came for it, else
    queued again."""
    if job.cancel_requested:
        _finish(session, job, status="cancelled", error="the job was cancelled")
    else:
        _requeue(job)


def expire_leases(session: Session) -> int:
    """Release running jobs whose lease ran out (their worker stopped renewing)."""
    jobs = list(
        session.scalars(
            select(TrainingJob)
            .where(TrainingJob.status == "running", TrainingJob.lease_expires_at < utcnow())
            .with_for_update(skip_locked=True)
        )
    )
    release_jobs(session, jobs=jobs, reason="the worker stopped renewing its lease")
    return len(jobs)


_LEASED_JOB: TypeAdapter[LeasedJob] = TypeAdapter(LeasedJob)


def job_for_worker(session: Session, job: TrainingJob) -> LeasedJob:
    """What a worker needs to run a leased job, its config typed by the job's kind."""
    model = session.get_one(Model, job.model_id)
    return _LEASED_JOB.validate_python(
        {
            "id": job.id,
            "kind": job.kind,
            "model_id": job.model_id,
            "base_model": model.base_model,
            "config": job.config,
            "model_config": ModelConfig.model_validate(model.config or {}).model_dump(),
            "base_step": job.base_step,
            # Usually base_step + 1; higher when newer steps were deleted (never reused).
            "step": registry.next_step(session, model_id=job.model_id),
            "attempt": job.attempts,
            "steps_done": job.saved_steps or 0,
            "request_id": job.request_id,
        }
    )

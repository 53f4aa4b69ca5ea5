"""What a worker's Tinker executor runs (``api/tinker/worker_routes.py`` serves it): leasing a
run with the plan to rebuild its state, its operations in ``seq_id`` order, their results,
failures and saves. The runs themselves, their queue and their names: ``scheduler.tinker.runs``.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Any

from sqlalchemy import exists, select, update
from sqlalchemy.orm import Session

from skytrain_backend.config import Settings
from skytrain_backend.db import registry, tenants
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    TrainingJob,
    Worker,
    utcnow,
)
from skytrain_backend.errors import InvalidRequest, NotFound, QuotaExceeded
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.protocol import tinker_ops as ops
from skytrain_backend.protocol.tinker_ops import CREATIONS, STATE_CHANGES
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler.tinker.runs import (
    FINISHED,
    JOB_KIND,
    TinkerPath,
    fail_operation,
    name_refusal,
    named_checkpoint,
    output_key,
    stored_operation,
    was_refused,
)
from skytrain_backend.storage import keys
from skytrain_backend.storage.base import ObjectStore

# --- what a worker runs -------------------------------------------------------------------------


@dataclass(frozen=True)
class Held:
    """Operation ``seq_id`` of the run whose job ``worker`` holds as ``attempt``: what every
    call of a worker about an operation names."""

    worker: Worker
    job_id: str
    attempt: int
    seq_id: int


def lease_run(session: Session, *, worker: Worker, lease_s: float) -> ops.LeasedRun | None:
    """A queued run of a model placed on the worker, with the plan to rebuild its state."""
    job = queue.lease_job(session, worker=worker, lease_s=lease_s, kinds=(JOB_KIND,))
    if job is None:
        return None
    run = session.scalars(select(TinkerRun).where(TinkerRun.job_id == job.id)).one()
    model = session.get_one(Model, run.model_id)
    return ops.LeasedRun(
        job_id=job.id,
        attempt=job.attempts,
        run_id=run.id,
        model_id=model.id,
        base_model=model.base_model,
        model_config_=ModelConfig.model_validate(model.config),
        latest_step=registry.next_step(session, model_id=model.id) - 1,
        plan=plan(session, run=run),
    )


def plan(session: Session, *, run: TinkerRun) -> ops.RebuildPlan:
    """How a worker rebuilds the run's state: where from (``restore``), which finished
    operations to rerun (``replay``), and the first operation still to run (``next_seq``)."""
    operations = list(
        session.scalars(
            select(TinkerRequest)
            .where(TinkerRequest.run_id == run.id)
            .order_by(TinkerRequest.seq_id)
        )
    )
    finished: list[TinkerRequest] = []
    for operation in operations:
        if operation.seq_id != len(finished) or operation.status not in FINISHED:
            break
        finished.append(operation)
    if not finished or finished[0].status != "succeeded":
        return ops.RebuildPlan(restore=None, replay=[], next_seq=len(finished))
    restore_at = 0
    restore = _restore_from(finished[0])
    for operation in reversed(finished):
        if operation.status != "succeeded":
            continue
        point = _restore_point(session, run=run, operation=operation)
        if point is not None:
            restore_at, restore = operation.seq_id or 0, point
            break
    # Failed steps too (an optimizer step that failed still dropped the gradients it found),
    # but not those refused before they reached a worker.
    replay = [
        op.seq_id or 0
        for op in finished[restore_at + 1 :]
        if op.kind in STATE_CHANGES and not was_refused(op)
    ]
    return ops.RebuildPlan(restore=restore, replay=replay, next_seq=len(finished))


def _restore_from(row: TinkerRequest) -> ops.RestorePoint:
    """Where a creation, or a load into the run, starts the run's state."""
    operation = stored_operation(row)
    if isinstance(operation, ops.CreationOperation):
        return operation.params.restore()
    if isinstance(operation, ops.LoadOperation) and operation.params is not None:
        source = operation.params
        return ops.RestorePoint(checkpoint=source.source, optimizer=source.optimizer)
    raise ValueError(f"a {row.kind} is no restore point")


def _restore_point(
    session: Session, *, run: TinkerRun, operation: TinkerRequest
) -> ops.RestorePoint | None:
    if operation.kind in CREATIONS or operation.kind == "load_weights":
        return _restore_from(operation)
    save = stored_operation(operation)
    if not isinstance(save, ops.SaveOperation) or save.params.grads_pending is not False:
        return None
    step = save.params.committed_step
    live = session.scalar(
        select(Checkpoint.id).where(
            Checkpoint.model_id == run.model_id,
            Checkpoint.step == step,
            Checkpoint.deleted_at.is_(None),
        )
    )
    if live is None or step is None:
        return None
    return ops.RestorePoint(
        checkpoint=ops.CheckpointSource(model_id=run.model_id, step=int(step)), optimizer=True
    )


def leased_run(session: Session, *, worker: Worker, job_id: str, attempt: int) -> TinkerRun:
    """The run whose job ``worker`` holds as ``attempt`` (``LeaseLost`` otherwise)."""
    job = queue.leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    return session.scalars(select(TinkerRun).where(TinkerRun.job_id == job.id)).one()


def operation_for_worker(row: TinkerRequest) -> ops.LeasedOperation:
    """An operation as a worker runs it: the one the SDK's request made, where it stands."""
    return ops.LeasedOperation(
        seq_id=row.seq_id or 0,
        request_id=row.id,
        operation=stored_operation(row),
        has_input=row.input_uri is not None,
        # Refused on arrival: the worker only moves past it.
        finished=row.status in FINISHED,
    )


def next_operation(
    session: Session, *, worker: Worker, job_id: str, attempt: int, seq_id: int
) -> TinkerRequest | None:
    """Operation ``seq_id`` of the run, once it has arrived (marked running)."""
    run = leased_run(session, worker=worker, job_id=job_id, attempt=attempt)
    operation = session.scalar(
        select(TinkerRequest).where(TinkerRequest.run_id == run.id, TinkerRequest.seq_id == seq_id)
    )
    if operation is None:
        session.rollback()
        return None
    if operation.status == "queued":
        # One statement that checks the lease again: SQLite has no row locks, and the run
        # may be taken back from this worker since the check above (``hand_back_idle_run``
        # takes it only with no operation running, in one statement too).
        marked = session.execute(
            update(TinkerRequest)
            .where(
                TinkerRequest.id == operation.id,
                TinkerRequest.status == "queued",
                exists().where(
                    TrainingJob.id == job_id,
                    TrainingJob.status == "running",
                    TrainingJob.worker_id == worker.id,
                    TrainingJob.attempts == attempt,
                ),
            )
            .values(status="running")
            .execution_options(synchronize_session=False)
        )
        if marked.rowcount != 1:  # type: ignore[attr-defined]
            session.rollback()
            leased_run(session, worker=worker, job_id=job_id, attempt=attempt)  # LeaseLost
        session.refresh(operation)
    session.commit()
    return operation


def worker_operation(session: Session, held: Held) -> tuple[TinkerRun, TinkerRequest]:
    run = leased_run(session, worker=held.worker, job_id=held.job_id, attempt=held.attempt)
    operation = session.scalar(
        select(TinkerRequest).where(
            TinkerRequest.run_id == run.id, TinkerRequest.seq_id == held.seq_id
        )
    )
    if operation is None:
        raise NotFound(f"run {run.id} has no operation {held.seq_id}")
    return run, operation


def readable_checkpoint(
    session: Session, *, run: TinkerRun, model_id: str, step: int
) -> Checkpoint:
    """A checkpoint the run may load: its own model's, or one its operations named."""
    named = ops.CheckpointSource(model_id=model_id, step=step)
    allowed = model_id == run.model_id or any(
        _source(stored_operation(row)) == named
        for row in session.scalars(
            select(TinkerRequest).where(
                TinkerRequest.run_id == run.id,
                TinkerRequest.kind.in_(("load_create", "load_weights")),
            )
        )
    )
    checkpoint = session.scalar(
        select(Checkpoint).where(Checkpoint.model_id == model_id, Checkpoint.step == step)
    )
    if not allowed or checkpoint is None or checkpoint.uri is None:
        raise NotFound(f"run {run.id} has no checkpoint {model_id} step {step} to load")
    return checkpoint


def _source(operation: ops.TinkerOperation) -> ops.CheckpointSource | None:
    if isinstance(operation, ops.CreationOperation):
        return operation.params.source
    if isinstance(operation, ops.LoadOperation) and operation.params is not None:
        return operation.params.source
    return None


def _finish(operation: TinkerRequest, *, result: dict[str, Any] | None = None) -> None:
    operation.status = "succeeded"
    operation.result = result or {}
    operation.finished_at = utcnow()


def complete(
    session: Session, held: Held, completion: ops.OperationCompletion, *, store: ObjectStore
) -> str:
    """Record an operation's result (an output object already uploaded, if ``has_output``,
    and the size its upload took: checked before anything is recorded); the future's id."""
    stored = _output_size(session, held, store=store) if completion.has_output else None
    run, operation = worker_operation(session, held)
    if operation.status in FINISHED:
        session.rollback()
        return operation.id
    if completion.has_output:
        if stored is None:
            raise InvalidRequest(f"operation {held.seq_id}'s output was not uploaded")
        if stored != operation.output_bytes:
            raise InvalidRequest(
                f"operation {held.seq_id}'s output is stored with {stored} bytes, not the "
                f"{operation.output_bytes} uploaded: upload it again"
            )
        operation.result_uri = store.uri(output_key(run, held.seq_id))
    _finish(operation, result=_public_result(run, operation, completion.result))
    session.commit()
    return operation.id


def _output_size(session: Session, held: Held, *, store: ObjectStore) -> int | None:
    """The size of the output stored for ``held``'s operation (None: none is), read with no
    transaction open: the run's rows are locked only after the store has answered."""
    run = session.scalar(select(TinkerRun).where(TinkerRun.job_id == held.job_id))
    key = None if run is None else output_key(run, held.seq_id)
    session.rollback()
    if key is None:
        return None  # the lease check that follows says why
    return next((info.size for info in store.list(key) if info.key == key), None)


def take_output(
    session: Session, held: Held, *, size: int, settings: Settings
) -> tuple[str, str | None]:
    """Take the ``size`` bytes of an operation's output from its tenant's storage quota, before
    the worker's upload of them is stored: recorded as the operation's ``output_bytes`` in
    the transaction that takes them (an upload sent again takes only what it adds). Returns
    the operation's id and the key to store the output at; None for the key when nothing is
    to be stored: the operation is over already, or the output does not fit, and then the
    operation is failed saying so (committed)."""
    run, operation = worker_operation(session, held)
    if operation.status in FINISHED:
        session.rollback()
        return operation.id, None
    added = size - (operation.output_bytes or 0)
    if added > 0:
        limits = tenants.limits_of(session.get_one(Tenant, run.tenant_id), settings)
        what = f"operation {held.seq_id}'s output ({operation.kind})"
        try:
            tenants.reserve_storage(
                session, tenant_id=run.tenant_id, limits=limits, adding=added, what=what
            )
        except QuotaExceeded as exc:
            _, operation = worker_operation(session, held)
            ran = " (its gradients were accumulated all the same)"
            error = (
                f"nothing of it was stored{ran if operation.kind == 'forward_backward' else ''}: "
            )
            fail_operation(operation, error + exc.message, category="user")
            session.commit()
            return operation.id, None
    else:
        tenants.release_storage(session, tenant_id=run.tenant_id, freed=-added)
    operation.output_bytes = size
    session.commit()
    return operation.id, output_key(run, held.seq_id)


def _public_result(
    run: TinkerRun, operation: TinkerRequest, reported: ops.OperationResult
) -> dict[str, Any]:
    """What the future answers, in the SDK's response shape for the operation."""
    if operation.kind == "create_model":
        return {"model_id": run.id, "type": "create_model"}
    if operation.kind in ("load_create", "load_weights"):
        loaded = stored_operation(operation)
        params = (
            loaded.params if isinstance(loaded, ops.CreationOperation | ops.LoadOperation) else None
        )
        return {"model_id": run.id, "path": params and params.path, "type": "load_weights"}
    if operation.kind == "optim_step":
        return {"metrics": reported.metrics or {}}
    return {}


def fail(session: Session, held: Held, failure: ops.OperationFailure) -> str:
    """An operation the worker could not run (its inputs, or the trainer's refusal); the
    state it leaves is the one before it, so later operations run on. The future's id."""
    _, operation = worker_operation(session, held)
    fail_operation(operation, failure.error, category=failure.category)
    session.commit()
    return operation.id


def commit_save(
    session: Session,
    held: Held,
    commit: ops.SaveCommit,
    *,
    store: ObjectStore,
    settings: Settings,
) -> str:
    """Commit a save: the staged files as the model's next step (or ``reuse_step``, when the
    weights did not change since that save), its name, and the future's answer (its id).

    As ``queue.complete_job``, in three phases so that no transaction (nor the run's row
    lock) is held while the store works: a short transaction checks the lease, the name and
    the step and is rolled back; with no transaction open each staged file is checked against
    the size and SHA-256 the worker sent (a mismatch commits nothing: InvalidRequest) and
    copied into the attempt's own directory of the step; then a short transaction checks
    all of it again and commits. What a save that lost the race copied is the garbage
    sweep's."""
    check = functools.partial(_check_save, session, held, commit)
    job_id, attempt, step, files = held.job_id, held.attempt, commit.step, commit.files
    checked = check()
    if isinstance(checked, str):
        return checked
    tenant_id, model_id = checked
    staged = keys.model_prefix(tenant_id=tenant_id, model_id=model_id) + f"jobs/{job_id}/"
    prefix = keys.checkpoint_prefix(
        tenant_id=tenant_id,
        model_id=model_id,
        step=step,
        writer=keys.attempt_writer(job_id=job_id, attempt=attempt),
    )
    total = 0
    session.rollback()  # the row lock and the connection go back before the store works
    if commit.reuse_step is None:
        attempt_prefix = f"{staged}attempts/{attempt}/"
        queue.check_staged(store, prefix=attempt_prefix, files=files, job_id=job_id, step=step)
        total = queue.copy_staged(
            store, source=attempt_prefix, dest=prefix, files=files, job_id=job_id, step=step
        )
    checked = check()  # again, in the transaction that commits
    if isinstance(checked, str):
        return checked
    if total:
        refused = _reserve_save(session, held, tenant_id=tenant_id, size=total, settings=settings)
        if refused is not None:
            store.delete_prefix(prefix)
            store.delete_prefix(staged + "attempts/")
            return refused
    run, operation = worker_operation(session, held)
    model = session.get_one(Model, model_id)
    save = _save(operation)
    params, name, kind = save.params, save.params.name, save.checkpoint_kind
    existing = named_checkpoint(session, run=run, save=save)
    if commit.reuse_step is not None:
        step = commit.reuse_step
    else:
        session.add(
            Checkpoint(
                model_id=model.id,
                step=step,
                uri=store.uri(prefix.rstrip("/")),
                metrics={"tinker/optim_steps": float(commit.optim_steps)},
                size_bytes=total,
                files=[item.model_dump() for item in files],
            )
        )
    if commit.served:
        worker = held.worker
        others = [item for item in worker.served or [] if item.get("model_id") != model.id]
        worker.served = [*others, {"model_id": model.id, "step": step}]
    result: dict[str, Any]
    if name is not None:
        if existing is not None:
            existing.step = step
            existing.created_at = utcnow()
        else:
            session.add(
                TinkerCheckpoint(
                    run_id=run.id,
                    kind=kind,
                    name=name,
                    step=step,
                    user_metadata=params.user_metadata or {},
                )
            )
        result = {"path": TinkerPath.of(run.id, kind, name), "type": operation.kind}
    else:
        sampler = TinkerSampler(
            tenant_id=run.tenant_id, base_model=model.base_model, model_id=model.id, step=step
        )
        session.add(sampler)
        session.flush()
        result = {"sampling_session_id": sampler.id, "type": operation.kind}
    committed = params.model_copy(
        update={"committed_step": step, "grads_pending": commit.grads_pending}
    )
    operation.params = {**operation.params, **committed.model_dump(mode="json", exclude_none=True)}
    model.last_active_at = utcnow()
    _finish(operation, result=result)
    session.commit()
    if commit.reuse_step is None:
        store.delete_prefix(staged + "attempts/")
    return operation.id


def _save(row: TinkerRequest) -> ops.SaveOperation:
    save = stored_operation(row)
    if not isinstance(save, ops.SaveOperation):
        raise InvalidRequest(f"operation {row.seq_id} is a {row.kind}, not a save")
    return save


def _reserve_save(
    session: Session, held: Held, *, tenant_id: str, size: int, settings: Settings
) -> str | None:
    """Take a save's ``size`` bytes from the tenant's storage quota, in the transaction that
    commits it (after its checks: the run's rows, then the tenant's, as ``submit`` takes them).
    When they do not fit, the operation fails saying so (committed; the caller removes the
    files) and its future's id is returned."""
    limits = tenants.limits_of(session.get_one(Tenant, tenant_id), settings)
    try:
        tenants.reserve_storage(
            session, tenant_id=tenant_id, limits=limits, adding=size, what="this checkpoint"
        )
    except QuotaExceeded as exc:
        _, operation = worker_operation(session, held)
        fail_operation(operation, f"nothing was saved: {exc.message}", category="user")
        session.commit()
        return operation.id
    return None


def _check_save(session: Session, held: Held, commit: ops.SaveCommit) -> str | tuple[str, str]:
    """The checks of a save, run before its files are copied and again as it commits: the
    operation's id when it is over (done already, or failed here on its name: committed),
    else the model's tenant and id. LeaseLost, NotFound or InvalidRequest as the worker
    has it wrong."""
    run, operation = worker_operation(session, held)
    if operation.status in FINISHED:
        session.rollback()
        return operation.id
    model = session.get_one(Model, run.model_id)
    refused = name_refusal(session, run=run, save=_save(operation))
    if refused is not None:
        fail_operation(operation, refused, category="user")
        session.commit()
        return operation.id
    if commit.reuse_step is not None:
        reused = select(Checkpoint.id).where(
            Checkpoint.model_id == model.id,
            Checkpoint.step == commit.reuse_step,
        )
        if session.scalar(reused) is None:
            raise InvalidRequest(f"model {model.id} has no step {commit.reuse_step} to reuse")
    else:
        if not commit.files:
            raise InvalidRequest("a save needs its checkpoint files")
        expected = registry.next_step(session, model_id=model.id)
        if commit.step != expected:
            raise InvalidRequest(f"run {run.id} saves step {expected} next, not step {commit.step}")
    return model.tenant_id, model.id

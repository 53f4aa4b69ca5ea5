"""The Tinker protocol's training runs: an ordered operation queue per model, on workers.

- A *training run* (what the SDK calls a training client's model, ``<session>:train:<n>``) is
  an ordinary skytrain model plus a ``tinker`` training job. The job's lease, taken and renewed
  with ``queue``'s machinery, says which worker holds the run's state (the trainer, with any
  gradients not applied yet); a worker that goes silent or dies loses it like any job, and the
  job goes back to the queue with its attempts counted.
- Its operations are ``TinkerRequest`` rows numbered by ``seq_id``: 0 is the model's creation
  (a fresh adapter, or one loaded from a checkpoint), then the SDK's own numbering. The worker
  runs them strictly in that order, waiting for a gap to fill (the SDK sends the chunks of a
  large batch in parallel). Small inputs and results are JSON in SQL; a forward-backward's
  batch and output are protobuf objects in the store.
- Recovery: the worker that leases a run again rebuilds its state from the newest *restore
  point* among the finished operations (the creation, a load, or a save made with no gradients
  pending), then replays the forward-backward and optimizer steps that followed it, whose inputs
  are all stored. The replay recomputes the same state, so the futures of a run whose worker
  died still resolve, and nothing trained is lost.
- Saves commit ordinary checkpoints (adapter, optimizer state, trainer state) as the model's
  next step, listed by the REST API and served by the OpenAI gateway like any other; a name
  given to a save maps to its step (``tinker://<run>/weights/<name>``).
- A run ends with its session (``finish``, or heartbeats stopping): its job is finished, its
  worker lets the trainer go, and operations still queued fail with that reason.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Literal

from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import registry
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    TinkerSession,
    TrainingJob,
    Worker,
    new_id,
    utcnow,
)
from skytrain_backend.errors import InvalidRequest, NotFound
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES, ModelConfig, format_validation_error
from skytrain_backend.scheduler import queue
from skytrain_backend.scheduler.serving import serving_status
from skytrain_backend.storage import keys
from skytrain_backend.storage.base import ObjectStore

JOB_KIND = "tinker"
PROJECT = "tinker"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Tinker's adapters scale by alpha / rank with alpha fixed, whatever the rank.
LORA_ALPHA = 32
MAX_SEQ_LENGTH = 32768

CREATIONS = frozenset({"create_model", "load_create"})
SAVES = frozenset({"save_weights", "save_weights_for_sampler"})
# What a replay reruns: the operations that change a trainer's state.
STATE_CHANGES = frozenset({"forward_backward", "optim_step"})
FINISHED = frozenset({"succeeded", "failed"})
INPUT_OBJECT = "input.pb"
OUTPUT_OBJECT = "output.pb"

CheckpointKind = Literal["training", "sampler"]
_SEGMENTS: dict[str, CheckpointKind] = {"weights": "training", "sampler_weights": "sampler"}
_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


# --- tinker:// paths ----------------------------------------------------------------------------


@dataclass(frozen=True)
class TinkerPath:
    """``tinker://<run>/weights/<name>`` (a training save) or ``.../sampler_weights/<name>``."""

    run_id: str
    kind: CheckpointKind
    name: str

    @classmethod
    def parse(cls, path: str) -> TinkerPath:
        parts = path.removeprefix("tinker://").split("/")
        if not path.startswith("tinker://") or len(parts) != 3 or parts[1] not in _SEGMENTS:
            raise InvalidRequest(
                f"{path!r} is not a tinker path: use the path a save returned, "
                "tinker://<run>/weights/<name> or tinker://<run>/sampler_weights/<name>"
            )
        return cls(run_id=parts[0], kind=_SEGMENTS[parts[1]], name=parts[2])

    @classmethod
    def of(cls, run_id: str, kind: CheckpointKind, name: str) -> str:
        segment = next(key for key, value in _SEGMENTS.items() if value == kind)
        return f"tinker://{run_id}/{segment}/{name}"


def check_name(name: str) -> str:
    if not _NAME_RE.match(name):
        raise InvalidRequest(
            f"checkpoint name {name!r} is not valid: use 1-128 letters, digits, '.', '_' or '-'"
        )
    return name


def resolve_path(session: Session, *, tenant_id: str, path: str) -> tuple[TinkerRun, Checkpoint]:
    """The run and the (live) checkpoint a tinker path names, in the tenant's runs only."""
    parsed = TinkerPath.parse(path)
    run = session.scalar(
        select(TinkerRun).where(TinkerRun.id == parsed.run_id, TinkerRun.tenant_id == tenant_id)
    )
    named = (
        session.scalar(
            select(TinkerCheckpoint).where(
                TinkerCheckpoint.run_id == parsed.run_id,
                TinkerCheckpoint.kind == parsed.kind,
                TinkerCheckpoint.name == parsed.name,
            )
        )
        if run is not None
        else None
    )
    if run is None or named is None:
        raise NotFound(f"checkpoint {path} not found: list yours with RestClient.list_checkpoints")
    checkpoint = session.scalar(
        select(Checkpoint).where(
            Checkpoint.model_id == run.model_id,
            Checkpoint.step == named.step,
            Checkpoint.deleted_at.is_(None),
        )
    )
    if checkpoint is None:
        raise NotFound(f"checkpoint {path} was deleted")
    return run, checkpoint


# --- creating runs ------------------------------------------------------------------------------


def lora_model_config(*, rank: int, train_attn: bool, train_mlp: bool) -> ModelConfig:
    modules = [*(ATTENTION_MODULES if train_attn else ()), *(MLP_MODULES if train_mlp else ())]
    if not modules:
        raise InvalidRequest(
            "train_attn and train_mlp are both off: skytrain trains LoRA on attention and MLP "
            "layers (not on the unembedding alone); turn one of them on"
        )
    try:
        return ModelConfig(
            lora_rank=rank,
            lora_alpha=LORA_ALPHA,
            lora_target_modules=modules,
            max_seq_length=MAX_SEQ_LENGTH,
        )
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc, root="lora_config")) from None


def run_id_for(session_id: str, model_seq_id: int) -> str:
    return f"{session_id}:train:{model_seq_id}"


def create_run(
    session: Session,
    *,
    tenant: Tenant,
    tinker_session: TinkerSession,
    model_seq_id: int,
    base_model: str,
    model_config: ModelConfig,
    lora_config: dict[str, Any],
    user_metadata: dict[str, Any],
    creation: dict[str, Any],
    max_attempts: int,
) -> TinkerRequest:
    """The run's model (with its step 0), its job, the run and its creation (operation 0), in
    one transaction; the creation's future. Sending the same creation again returns it."""
    if model_seq_id < 0:
        raise InvalidRequest(f"model_seq_id must be 0 or more, not {model_seq_id}")
    run_id = run_id_for(tinker_session.id, model_seq_id)
    existing = session.get(TinkerRun, run_id)
    if existing is not None:
        return _operation(session, run=existing, seq_id=0)
    model = Model(
        tenant_id=tenant.id,
        entity=tenant.name,
        project=PROJECT,
        name=run_id.replace(":", "-"),
        base_model=base_model,
        config=model_config.model_dump(mode="json"),
        last_active_at=utcnow(),
    )
    session.add(model)
    session.flush()
    session.add(Checkpoint(model_id=model.id, step=0, uri=None, metrics={}))
    job = job_rows.add_job(
        session,
        job_id=new_id(),
        model_id=model.id,
        kind=JOB_KIND,  # type: ignore[arg-type]
        config={"run_id": run_id},
        input_uri="",
        num_groups=0,
        num_trajectories=0,
        max_attempts=max_attempts,
    )
    run = TinkerRun(
        id=run_id,
        tenant_id=tenant.id,
        session_id=tinker_session.id,
        model_id=model.id,
        job_id=job.id,
        lora_config=lora_config,
        user_metadata=user_metadata,
    )
    session.add(run)
    session.flush()  # rows without relationships: the unit of work does not order them
    operation = TinkerRequest(
        tenant_id=tenant.id, run_id=run_id, seq_id=0, kind=creation["kind"], params=creation
    )
    session.add(operation)
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return _operation(session, run=session.get_one(TinkerRun, run_id), seq_id=0)
    return operation


def _operation(session: Session, *, run: TinkerRun, seq_id: int) -> TinkerRequest:
    return session.scalars(
        select(TinkerRequest).where(TinkerRequest.run_id == run.id, TinkerRequest.seq_id == seq_id)
    ).one()


def run_job(session: Session, *, run: TinkerRun) -> TrainingJob:
    return session.get_one(TrainingJob, run.job_id)


def check_open(session: Session, *, run: TinkerRun) -> None:
    job = run_job(session, run=run)
    if job.status in TERMINAL_JOB_STATUSES:
        raise InvalidRequest(
            f"training run {run.id} has ended ({_ended(job)}): create a new training client, "
            "from a saved state if you need one (create_training_client_from_state)"
        )


def _ended(job: TrainingJob) -> str:
    if job.status == "failed":
        return f"it failed: {job.error}"
    if job.status == "cancelled":
        return "it was cancelled"
    return "its session finished"


def submit(
    session: Session,
    *,
    store: ObjectStore,
    run: TinkerRun,
    seq_id: int | None,
    kind: str,
    params: dict[str, Any],
    body: bytes | None = None,
    refused: str | None = None,
) -> TinkerRequest:
    """Queue one operation of the run; the same ``seq_id`` again returns the same future
    (the SDK retries a submission whose answer it did not get).

    ``refused``: why the operation's content is not valid. It is recorded as failed (nothing
    of it stored), so its future says why and the operations after it still run: the SDK has
    already numbered them, and a gap would hold them forever.
    """
    if seq_id is None or seq_id < 1:
        raise InvalidRequest(f"seq_id must be 1 or more, not {seq_id}: send it with the tinker SDK")
    existing = session.scalar(
        select(TinkerRequest).where(TinkerRequest.run_id == run.id, TinkerRequest.seq_id == seq_id)
    )
    if existing is not None:
        if existing.kind != kind:
            raise InvalidRequest(
                f"operation {seq_id} of run {run.id} is a {existing.kind}, not a {kind}: "
                "sequence ids are the SDK's; do not reuse them"
            )
        return existing
    check_open(session, run=run)
    operation = TinkerRequest(
        tenant_id=run.tenant_id, run_id=run.id, seq_id=seq_id, kind=kind, params=params
    )
    if refused is not None:
        operation.params = {**params, "refused": True}
        operation.status = "failed"
        operation.error = refused
        operation.error_category = "user"
        operation.finished_at = utcnow()
    elif body is not None:
        key = input_key(run, seq_id)
        store.put_bytes(key, body)
        operation.input_uri = store.uri(key)
    session.add(operation)
    run.last_request_at = utcnow()
    try:
        session.commit()
    except IntegrityError:
        session.rollback()
        return _operation(session, run=run, seq_id=seq_id)
    return operation


# --- what a worker runs -------------------------------------------------------------------------


def lease_run(session: Session, *, worker: Worker, lease_s: float) -> dict[str, Any] | None:
    """A queued run of a model placed on the worker, with the plan to rebuild its state."""
    job = queue.lease_job(session, worker=worker, lease_s=lease_s, kinds=(JOB_KIND,))
    if job is None:
        return None
    run = session.scalars(select(TinkerRun).where(TinkerRun.job_id == job.id)).one()
    model = session.get_one(Model, run.model_id)
    return {
        "job_id": job.id,
        "attempt": job.attempts,
        "run_id": run.id,
        "model_id": model.id,
        "base_model": model.base_model,
        "model_config": ModelConfig.model_validate(model.config).model_dump(),
        # The newest step number the model ever had (deleted ones too): its saves go above it.
        "latest_step": registry.next_step(session, model_id=model.id) - 1,
        "plan": plan(session, run=run),
    }


def plan(session: Session, *, run: TinkerRun) -> dict[str, Any]:
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
        return {"restore": None, "replay": [], "next_seq": len(finished)}
    restore_at = 0
    restore: dict[str, Any] = _restore_from(finished[0])
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
        op.seq_id
        for op in finished[restore_at + 1 :]
        if op.kind in STATE_CHANGES and not op.params.get("refused")
    ]
    return {"restore": restore, "replay": replay, "next_seq": len(finished)}


def _restore_from(creation: TinkerRequest) -> dict[str, Any]:
    params = creation.params
    return {
        "seed": params.get("seed"),
        "checkpoint": params.get("source"),
        "optimizer": bool(params.get("optimizer")),
    }


def _restore_point(
    session: Session, *, run: TinkerRun, operation: TinkerRequest
) -> dict[str, Any] | None:
    if operation.kind in CREATIONS or operation.kind == "load_weights":
        return _restore_from(operation)
    if operation.kind not in SAVES or operation.params.get("grads_pending", True):
        return None
    step = operation.params.get("committed_step")
    live = session.scalar(
        select(Checkpoint.id).where(
            Checkpoint.model_id == run.model_id,
            Checkpoint.step == step,
            Checkpoint.deleted_at.is_(None),
        )
    )
    if live is None:
        return None
    return {"seed": None, "checkpoint": {"model_id": run.model_id, "step": step}, "optimizer": True}


def leased_run(session: Session, *, worker: Worker, job_id: str, attempt: int) -> TinkerRun:
    """The run whose job ``worker`` holds as ``attempt`` (``LeaseLost`` otherwise)."""
    job = queue.leased_job(session, worker=worker, job_id=job_id, attempt=attempt)
    return session.scalars(select(TinkerRun).where(TinkerRun.job_id == job.id)).one()


def operation_for_worker(operation: TinkerRequest) -> dict[str, Any]:
    return {
        "seq_id": operation.seq_id,
        "request_id": operation.id,
        "kind": operation.kind,
        "params": operation.params,
        "has_input": operation.input_uri is not None,
        # Refused on arrival: the worker only moves past it.
        "finished": operation.status in FINISHED,
    }


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
        operation.status = "running"
    session.commit()
    return operation


def worker_operation(
    session: Session, *, worker: Worker, job_id: str, attempt: int, seq_id: int
) -> tuple[TinkerRun, TinkerRequest]:
    run = leased_run(session, worker=worker, job_id=job_id, attempt=attempt)
    operation = session.scalar(
        select(TinkerRequest).where(TinkerRequest.run_id == run.id, TinkerRequest.seq_id == seq_id)
    )
    if operation is None:
        raise NotFound(f"run {run.id} has no operation {seq_id}")
    return run, operation


def output_key(run: TinkerRun, seq_id: int) -> str:
    return keys.tinker_op_key(
        tenant_id=run.tenant_id, model_id=run.model_id, seq_id=seq_id, name=OUTPUT_OBJECT
    )


def input_key(run: TinkerRun, seq_id: int) -> str:
    return keys.tinker_op_key(
        tenant_id=run.tenant_id, model_id=run.model_id, seq_id=seq_id, name=INPUT_OBJECT
    )


def readable_checkpoint(
    session: Session, *, run: TinkerRun, model_id: str, step: int
) -> Checkpoint:
    """A checkpoint the run may load: its own model's, or one its operations named."""
    allowed = model_id == run.model_id or any(
        (op.params.get("source") or {}).get("model_id") == model_id
        and (op.params.get("source") or {}).get("step") == step
        for op in session.scalars(
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


def _finish(operation: TinkerRequest, *, result: dict[str, Any] | None = None) -> None:
    operation.status = "succeeded"
    operation.result = result or {}
    operation.finished_at = utcnow()


def complete(
    session: Session,
    *,
    store: ObjectStore,
    worker: Worker,
    job_id: str,
    attempt: int,
    seq_id: int,
    result: dict[str, Any],
    has_output: bool,
) -> str:
    """Record an operation's result (an output object already uploaded, if ``has_output``);
    the future's id."""
    run, operation = worker_operation(
        session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    if operation.status in FINISHED:
        session.rollback()
        return operation.id
    if has_output:
        key = output_key(run, seq_id)
        if not store.exists(key):
            raise InvalidRequest(f"operation {seq_id}'s output was not uploaded")
        operation.result_uri = store.uri(key)
    _finish(operation, result=_public_result(run, operation, result))
    session.commit()
    return operation.id


def _public_result(
    run: TinkerRun, operation: TinkerRequest, reported: dict[str, Any]
) -> dict[str, Any]:
    """What the future answers, in the SDK's response shape for the operation."""
    if operation.kind == "create_model":
        return {"model_id": run.id, "type": "create_model"}
    if operation.kind in ("load_create", "load_weights"):
        return {"model_id": run.id, "path": operation.params.get("path"), "type": "load_weights"}
    if operation.kind == "optim_step":
        return {"metrics": reported.get("metrics") or {}}
    return {}


def fail(
    session: Session,
    *,
    worker: Worker,
    job_id: str,
    attempt: int,
    seq_id: int,
    error: str,
    category: Literal["user", "server"],
) -> str:
    """An operation the worker could not run (its inputs, or the trainer's refusal); the
    state it leaves is the one before it, so later operations run on. The future's id."""
    _, operation = worker_operation(
        session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    if operation.status not in FINISHED:
        operation.status = "failed"
        operation.error = error
        operation.error_category = category
        operation.finished_at = utcnow()
    session.commit()
    return operation.id


def commit_save(
    session: Session,
    *,
    store: ObjectStore,
    worker: Worker,
    job_id: str,
    attempt: int,
    seq_id: int,
    files: list[str],
    step: int,
    reuse_step: int | None,
    grads_pending: bool,
    optim_steps: int,
    served: bool,
) -> str:
    """Commit a save: the staged files as the model's next step (or ``reuse_step``, when the
    weights did not change since that save), its name, and the future's answer (its id)."""
    run, operation = worker_operation(
        session, worker=worker, job_id=job_id, attempt=attempt, seq_id=seq_id
    )
    if operation.status in FINISHED:
        session.rollback()
        return operation.id
    job = session.get_one(TrainingJob, job_id)
    model = session.get_one(Model, run.model_id)
    params = dict(operation.params)
    name = params.get("name")
    kind: CheckpointKind = "training" if operation.kind == "save_weights" else "sampler"
    existing = None
    if name is not None:
        existing = session.scalar(
            select(TinkerCheckpoint).where(
                TinkerCheckpoint.run_id == run.id,
                TinkerCheckpoint.kind == kind,
                TinkerCheckpoint.name == name,
            )
        )
        if existing is not None and not params.get("overwrite"):
            operation.status = "failed"
            operation.error = (
                f"run {run.id} already has a checkpoint named {name!r}: choose another name, "
                "or pass overwrite=True"
            )
            operation.error_category = "user"
            operation.finished_at = utcnow()
            session.commit()
            return operation.id
    if reuse_step is not None:
        step = reuse_step
        if (
            session.scalar(
                select(Checkpoint.id).where(
                    Checkpoint.model_id == model.id, Checkpoint.step == step
                )
            )
            is None
        ):
            raise InvalidRequest(f"model {model.id} has no step {step} to reuse")
    else:
        if not files:
            raise InvalidRequest("a save needs its checkpoint files")
        expected = registry.next_step(session, model_id=model.id)
        if step != expected:
            raise InvalidRequest(f"run {run.id} saves step {expected} next, not step {step}")
        total = 0
        for file_name in files:
            source = queue.staged_file_key(
                job, tenant_id=model.tenant_id, attempt=attempt, name=file_name
            )
            target = keys.checkpoint_key(
                tenant_id=model.tenant_id, model_id=model.id, step=step, file=file_name
            )
            total += store.copy(source, target)
        prefix = keys.checkpoint_prefix(tenant_id=model.tenant_id, model_id=model.id, step=step)
        session.add(
            Checkpoint(
                model_id=model.id,
                step=step,
                uri=store.uri(prefix.rstrip("/")),
                metrics={"tinker/optim_steps": float(optim_steps)},
                size_bytes=total,
            )
        )
    if served:
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
                    user_metadata=params.get("user_metadata") or {},
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
    params.update(committed_step=step, grads_pending=grads_pending)
    operation.params = params
    model.last_active_at = utcnow()
    _finish(operation, result=result)
    session.commit()
    if reuse_step is None:
        store.delete_prefix(
            keys.model_prefix(tenant_id=model.tenant_id, model_id=model.id)
            + f"jobs/{job.id}/attempts/"
        )
    return operation.id


# --- ending runs --------------------------------------------------------------------------------


def finish_session(session: Session, *, row: TinkerSession, status: str) -> None:
    """End the session and its runs (first finish wins)."""
    if row.finished_at is None:
        row.finished_at = utcnow()
        row.finish_status = status
    for run in session.scalars(select(TinkerRun).where(TinkerRun.session_id == row.id)):
        job = session.get_one(TrainingJob, run.job_id)
        if job.status not in TERMINAL_JOB_STATUSES:
            job.status = "succeeded"
            job.finished_at = utcnow()
            job.lease_expires_at = None
    session.commit()


def expire_sessions(session: Session, *, timeout_s: float) -> int:
    """Finish the sessions whose SDK stopped heartbeating; their runs free their workers."""
    cutoff = utcnow() - timedelta(seconds=timeout_s)
    stale = list(
        session.scalars(
            select(TinkerSession).where(
                TinkerSession.finished_at.is_(None), TinkerSession.last_heartbeat_at < cutoff
            )
        )
    )
    for row in stale:
        finish_session(session, row=row, status="expired")
    return len(stale)


# --- futures ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Pending:
    """Not finished: whether it is being worked on, or waits for capacity (and why)."""

    queue_state: Literal["active", "paused_capacity"]
    reason: str | None = None


@dataclass(frozen=True)
class Failed:
    error: str
    category: Literal["user", "server", "unknown"]


def state(
    session: Session, *, operation: TinkerRequest, sample_timeout_s: float
) -> Pending | Failed | None:
    """A future that is not done yet, or failed; None when it succeeded."""
    if operation.status == "succeeded":
        return None
    if operation.status == "failed":
        category = operation.error_category or "unknown"
        return Failed(error=operation.error or "failed", category=category)  # type: ignore[arg-type]
    if operation.run_id is None:
        if operation.created_at < utcnow() - timedelta(seconds=sample_timeout_s):
            operation.status = "failed"
            operation.error = (
                f"sampling did not finish within {sample_timeout_s:.0f}s "
                "(SKYTRAIN_TINKER_SAMPLE_TIMEOUT_S): retry, with fewer tokens if it recurs"
            )
            operation.error_category = "server"
            operation.finished_at = utcnow()
            session.commit()
            return state(session, operation=operation, sample_timeout_s=sample_timeout_s)
        return Pending("active")
    run = session.get_one(TinkerRun, operation.run_id)
    job = run_job(session, run=run)
    if job.status in TERMINAL_JOB_STATUSES:
        return Failed(
            error=f"training run {run.id} ended before this operation ran ({_ended(job)})",
            category="server" if job.status == "failed" else "user",
        )
    if job.status == "queued":
        serving = serving_status(session, model=session.get_one(Model, run.model_id), step=0)
        if serving.state == "failed":
            return Failed(
                error=f"no worker can hold training run {run.id}: {serving.message}",
                category="server",
            )
        reason = (
            "waiting for a worker to hold the model"
            if job.attempts == 0
            else f"the model's worker was lost; rebuilding its state (attempt {job.attempts + 1})"
        )
        return Pending("paused_capacity", reason)
    return Pending("active")

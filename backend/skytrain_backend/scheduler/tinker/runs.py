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
- A run holds its worker only while it has an operation queued or running: between two
  operations its state can be rebuilt, so a run with none gives its slot up like an idle model
  (``hand_back_idle_run``: to fair share, or after the idle timeout), its job queued again
  as a preemption, not a failed attempt; its next operation places it again.
- A run ends with its session (``finish``, or heartbeats stopping): its job is finished, its
  worker lets the trainer go, and operations still queued fail with that reason.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from datetime import timedelta

from pydantic import TypeAdapter, ValidationError
from sqlalchemy import func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import registry, tenants
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    TinkerSession,
    TrainingJob,
    new_id,
    utcnow,
)
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.db.tinker_rows import JOB_KIND
from skytrain_backend.errors import InvalidRequest, NotFound, QuotaExceeded, RateLimited
from skytrain_backend.json_types import JSONObject
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES, ModelConfig, format_validation_error
from skytrain_backend.protocol.tinker_api import LoraConfig
from skytrain_backend.protocol.tinker_ops import (
    CheckpointKind,
    CreationOperation,
    SaveOperation,
    TinkerOperation,
)
from skytrain_backend.storage import keys
from skytrain_backend.storage.base import ObjectStore

logger = logging.getLogger(__name__)

PROJECT = "tinker"
ATTENTION_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj")
MLP_MODULES = ("gate_proj", "up_proj", "down_proj")
# Tinker's adapters scale by alpha / rank with alpha fixed, whatever the rank.
LORA_ALPHA = 32
MAX_SEQ_LENGTH = 32768

FINISHED = frozenset({"succeeded", "failed"})
# When an operation refused for a full queue is worth sending again.
QUEUE_FULL_RETRY_S = 5.0
INPUT_OBJECT = "input.pb"
OUTPUT_OBJECT = "output.pb"

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


def named_checkpoint(
    session: Session, *, run: TinkerRun, save: SaveOperation
) -> TinkerCheckpoint | None:
    """The checkpoint of ``run`` the save's name already names (None: none, or no name)."""
    if save.params.name is None:
        return None
    return session.scalar(
        select(TinkerCheckpoint).where(
            TinkerCheckpoint.run_id == run.id,
            TinkerCheckpoint.kind == save.checkpoint_kind,
            TinkerCheckpoint.name == save.params.name,
        )
    )


def name_refusal(session: Session, *, run: TinkerRun, save: SaveOperation) -> str | None:
    """Why the save's name cannot name a new checkpoint of ``run``: it names one already and
    the save does not overwrite it (None: it can)."""
    if named_checkpoint(session, run=run, save=save) is None or save.params.overwrite:
        return None
    return (
        f"run {run.id} already has a checkpoint named {save.params.name!r}: choose another "
        "name, or pass overwrite=True"
    )


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


@dataclass(frozen=True)
class NewRun:
    """A training run as the SDK asks for it: model ``model_seq_id`` of its session
    ``session_id``, a LoRA adapter of ``base_model`` (``model_config``, the SDK's ``lora``),
    whose operation 0 is ``creation`` (a fresh adapter, or one loaded from a checkpoint)."""

    session_id: str
    model_seq_id: int
    base_model: str
    model_config: ModelConfig
    lora: LoraConfig
    user_metadata: JSONObject | None
    creation: CreationOperation


def create_run(
    session: Session,
    new: NewRun,
    *,
    tenant: Tenant,
    tinker_session: TinkerSession,
    max_attempts: int,
    max_models: int,
) -> TinkerRequest:
    """The run's model (with its step 0), its job, the run and its creation (operation 0), in
    one transaction; the creation's future. Sending the same creation again returns it; a
    new run is a new model, refused (``QuotaExceeded``) past the tenant's ``max_models``."""
    model_seq_id, creation = new.model_seq_id, new.creation
    if model_seq_id < 0:
        raise InvalidRequest(f"model_seq_id must be 0 or more, not {model_seq_id}")
    run_id = run_id_for(tinker_session.id, model_seq_id)
    existing = session.get(TinkerRun, run_id)
    if existing is not None:
        return _operation(session, run=existing, seq_id=0)
    registry.check_model_quota(session, tenant_id=tenant.id, max_models=max_models)
    model = Model(
        tenant_id=tenant.id,
        entity=tenant.name,
        project=PROJECT,
        name=run_id.replace(":", "-"),
        base_model=new.base_model,
        config=new.model_config.model_dump(mode="json"),
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
        lora_config=new.lora.model_dump(mode="json"),
        user_metadata=new.user_metadata or {},
    )
    session.add(run)
    session.flush()  # rows without relationships: the unit of work does not order them
    operation = TinkerRequest(
        tenant_id=tenant.id, run_id=run_id, seq_id=0, kind=creation.kind, params=_params(creation)
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
            f"training run {run.id} has ended ({ended_reason(job)}): create a new training client, "
            "from a saved state if you need one (create_training_client_from_state)"
        )


def ended_reason(job: TrainingJob) -> str:
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
    operation: TinkerOperation,
    limits: TenantLimits,
    body: bytes | None = None,
    refused: str | None = None,
) -> TinkerRequest:
    """Queue ``operation`` as operation ``seq_id`` of the run; the same ``seq_id`` again returns the same future
    (the SDK retries a submission whose answer it did not get).

    The run holds at most ``limits.max_queued_operations`` operations not done (one more is a
    429: the SDK sends it again once the worker has done some), and ``body`` counts in the
    tenant's stored bytes (past ``max_storage_bytes`` the operation is recorded failed, its
    future saying why, like an invalid one); both counted under the tenant's lock, after the
    body is in the store (the lock is never held across a store call), which is deleted again
    when refused.

    ``refused``: why the operation's content is not valid. It is recorded as failed (nothing
    of it stored), so its future says why and the operations after it still run: the SDK has
    already numbered them, and a gap would hold them forever.
    """
    if seq_id is None or seq_id < 1:
        raise InvalidRequest(f"seq_id must be 1 or more, not {seq_id}: send it with the tinker SDK")
    kind, params = operation.kind, _params(operation)
    existing = _find_operation(session, run, seq_id)
    if existing is not None:
        if existing.kind != kind:
            raise InvalidRequest(
                f"operation {seq_id} of run {run.id} is a {existing.kind}, not a {kind}: "
                "sequence ids are the SDK's; do not reuse them"
            )
        return existing
    check_open(session, run=run)
    row = TinkerRequest(
        tenant_id=run.tenant_id, run_id=run.id, seq_id=seq_id, kind=kind, params=params
    )
    if refused is not None:
        row.params = {**params, REFUSED: True}
        fail_operation(row, refused, category="user")
    elif body is not None:
        # The body (up to the request limit) goes to the store with no transaction open and
        # no connection held; the run is checked again after. An object whose row never
        # comes is the garbage sweep's, and the same seq_id sent again writes the same key.
        key = input_key(run, seq_id)
        session.rollback()
        store.put_bytes(key, body)
        check_open(session, run=run)
        row.input_uri = store.uri(key)
        row.input_bytes = len(body)
    try:
        if refused is None:
            _reserve(session, run=run, limits=limits, size=row.input_bytes or 0)
        session.add(row)
        run.last_request_at = utcnow()
        session.commit()
    except IntegrityError:
        session.rollback()
        return _operation(session, run=run, seq_id=seq_id)
    except (QuotaExceeded, RateLimited) as exc:
        # Refused: its payload goes, unless the same operation sent again (the SDK retries)
        # was queued meanwhile, with its payload at the same key.
        if row.input_uri is not None and _find_operation(session, run, seq_id) is None:
            store.delete(input_key(run, seq_id))
        if isinstance(exc, RateLimited):
            raise  # a full queue: the SDK sends it again
        # Over the storage quota: the operation fails, and the run's later ones still run.
        return submit(
            session,
            store=store,
            run=run,
            seq_id=seq_id,
            operation=operation,
            limits=limits,
            refused=exc.message,
        )
    return row


# The mark of an operation refused on arrival: it never reached a worker.
REFUSED = "refused"
_OPERATION: TypeAdapter[TinkerOperation] = TypeAdapter(TinkerOperation)


def _params(operation: TinkerOperation) -> dict[str, object]:
    """What a row stores of ``operation`` (its ``kind`` is a column of its own)."""
    if operation.params is None:
        return {}
    return operation.params.model_dump(mode="json", exclude_none=True)


def fail_operation(row: TinkerRequest, error: str, *, category: str) -> None:
    """Mark an operation failed with ``error`` (``category``: whose fault, "user" or "server"),
    unless it is finished already."""
    if row.status in FINISHED:
        return
    row.status = "failed"
    row.error = error
    row.error_category = category
    row.finished_at = utcnow()


def was_refused(row: TinkerRequest) -> bool:
    return bool(row.params.get(REFUSED))


def stored_operation(row: TinkerRequest) -> TinkerOperation:
    """The operation a row holds, typed by its kind, as the SDK's request made it (a refused
    step or load has nothing a worker could read: its params are None)."""
    nothing = was_refused(row) and row.kind in ("optim_step", "load_weights")
    return _OPERATION.validate_python({"kind": row.kind, "params": None if nothing else row.params})


def _find_operation(session: Session, run: TinkerRun, seq_id: int) -> TinkerRequest | None:
    return session.scalar(
        select(TinkerRequest).where(TinkerRequest.run_id == run.id, TinkerRequest.seq_id == seq_id)
    )


def _reserve(session: Session, *, run: TinkerRun, limits: TenantLimits, size: int) -> None:
    """A place in the run's queue, and ``size`` bytes of the tenant's storage."""
    cap = limits.max_queued_operations

    def full(queued: int) -> RateLimited:
        return RateLimited(
            f"training run {run.id} has {queued} operations queued, the most your tenant's quota "
            f"allows (max_queued_operations, {cap}): wait for some to finish (retrieve their "
            "futures), or ask the operator to raise it "
            "(`skytrain tenants limits TENANT --max-queued-operations N`)",
            retry_after_s=QUEUE_FULL_RETRY_S,
            limit="max_queued_operations",
        )

    tenants.enforce_quota(
        session,
        tenant_id=run.tenant_id,
        used=select(func.count(TinkerRequest.id)).where(
            TinkerRequest.run_id == run.id, TinkerRequest.status.not_in(FINISHED)
        ),
        adding=1,
        allowed=cap,
        refusal=full,
    )
    if size:
        tenants.reserve_storage(
            session, tenant_id=run.tenant_id, limits=limits, adding=size, what="this operation"
        )


def output_key(run: TinkerRun, seq_id: int) -> str:
    return keys.tinker_op_key(
        tenant_id=run.tenant_id, model_id=run.model_id, seq_id=seq_id, name=OUTPUT_OBJECT
    )


def input_key(run: TinkerRun, seq_id: int) -> str:
    return keys.tinker_op_key(
        tenant_id=run.tenant_id, model_id=run.model_id, seq_id=seq_id, name=INPUT_OBJECT
    )


# --- a run's hold on its worker -----------------------------------------------------------------

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

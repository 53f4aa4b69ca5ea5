"""The SQL schema: one class per table (SQLAlchemy 2.0 typed ORM).

The schema changes only through Alembic revisions in ``migrations/``; a test checks that
autogenerate finds no difference between these classes and the revisions, on SQLite and on
PostgreSQL. Ids are uuid4 hex strings except the event id, an auto-incrementing integer that
doubles as the events' cursor. Timestamps are timezone-aware UTC on both databases. JSON
columns are JSONB on PostgreSQL and JSON on SQLite.
"""

from __future__ import annotations

import uuid
from datetime import UTC, datetime
from typing import Any

from sqlalchemy import (
    JSON,
    BigInteger,
    Boolean,
    DateTime,
    Dialect,
    Float,
    ForeignKey,
    Index,
    Integer,
    MetaData,
    String,
    Text,
    TypeDecorator,
    UniqueConstraint,
)
from sqlalchemy.dialects.postgresql import JSONB
from sqlalchemy.orm import DeclarativeBase, Mapped, composite, mapped_column
from typing_extensions import TypedDict

from skytrain_backend.child_processes import ProcessIdentity
from skytrain_backend.json_types import JSONObject

ID_LENGTH = 32
NAME_LENGTH = 128

JSONType = JSON().with_variant(JSONB(), "postgresql")
# SQLite makes only INTEGER PRIMARY KEY an alias of the auto-incrementing rowid.
EventIdType = BigInteger().with_variant(Integer(), "sqlite")


class UTCDateTime(TypeDecorator[datetime]):
    """A timezone-aware UTC datetime on every database.

    PostgreSQL keeps the zone (``timestamptz``); SQLite stores naive text, so values are
    converted to UTC on the way in and marked UTC on the way out.
    """

    impl = DateTime(timezone=True)
    cache_ok = True

    def process_bind_param(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        if value.tzinfo is None:
            raise ValueError(f"naive datetime {value!r}: pass a timezone-aware UTC datetime")
        return value.astimezone(UTC)

    def process_result_value(self, value: datetime | None, dialect: Dialect) -> datetime | None:
        if value is None:
            return None
        return value.replace(tzinfo=UTC) if value.tzinfo is None else value.astimezone(UTC)


def utcnow() -> datetime:
    return datetime.now(UTC)


def new_id() -> str:
    return uuid.uuid4().hex


class Base(DeclarativeBase):
    metadata = MetaData(
        naming_convention={
            "ix": "ix_%(table_name)s_%(column_0_N_name)s",
            "uq": "uq_%(table_name)s_%(column_0_N_name)s",
            "ck": "ck_%(table_name)s_%(constraint_name)s",
            "fk": "fk_%(table_name)s_%(column_0_name)s_%(referred_table_name)s",
            "pk": "pk_%(table_name)s",
        }
    )
    type_annotation_map = {
        datetime: UTCDateTime(),
        JSONObject: JSONType,
        dict[str, float]: JSONType,
        str: String(NAME_LENGTH),
    }


class CommittedFile(TypedDict):
    """A checkpoint's file as committed (``Checkpoint.files``)."""

    name: str
    size: int
    sha256: str


class ServedStep(TypedDict):
    """A checkpoint a worker's engine serves (``Worker.served``)."""

    model_id: str
    step: int


def _id_column() -> Mapped[str]:
    return mapped_column(String(ID_LENGTH), primary_key=True, default=new_id)


def _created_at() -> Mapped[datetime]:
    return mapped_column(default=utcnow)


class Tenant(Base):
    """Who owns rows and objects; every API key belongs to one."""

    __tablename__ = "tenants"

    id: Mapped[str] = _id_column()
    name: Mapped[str] = mapped_column(unique=True)
    created_at: Mapped[datetime] = _created_at()
    # The operator's limits for this tenant, {limit name: value}; absent ones are the
    # settings' defaults (``db.tenants``).
    limits: Mapped[dict[str, float]] = mapped_column(default=dict)
    # The bytes it holds, kept as a running total by every write that stores or frees them
    # (``db.tenants.reserve_storage`` / ``release_storage``): the sum over its rows that it
    # stands for (``db.tenants.counted_storage``) is recounted by ``skytrain storage check
    # --fix-usage``.
    storage_bytes: Mapped[int] = mapped_column(BigInteger, default=0)


class ApiKey(Base):
    """A bearer key, stored as the sha256 of its text; the key itself is shown once."""

    __tablename__ = "api_keys"

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    name: Mapped[str | None]
    prefix: Mapped[str] = mapped_column(String(16))
    key_hash: Mapped[str] = mapped_column(String(64), unique=True)
    created_at: Mapped[datetime] = _created_at()
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


class Model(Base):
    """A trainable model: a LoRA adapter lineage on top of a base model."""

    __tablename__ = "models"
    __table_args__ = (UniqueConstraint("tenant_id", "entity", "project", "name"),)

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    entity: Mapped[str]
    project: Mapped[str]
    name: Mapped[str]
    base_model: Mapped[str] = mapped_column(String(512))
    # The user's model config, stored as given.
    config: Mapped[JSONObject]
    run_id: Mapped[str] = mapped_column(String(ID_LENGTH), default=new_id)
    created_at: Mapped[datetime] = _created_at()
    # Placement: the worker that serves and trains this model (sticky until it goes away).
    worker_id: Mapped[str | None] = mapped_column(
        ForeignKey("workers.id", ondelete="SET NULL"), index=True
    )
    # Last registration, request or job: the scheduler keeps active models placed.
    last_active_at: Mapped[datetime | None]
    # Requests in flight per replica, averaged over the replica window, as the scheduler's
    # last pass read them (``scheduler/replicas.py``); None before a window was counted, or
    # while the model is not placed.
    demand_per_replica: Mapped[float | None] = mapped_column(Float)


class ModelReplica(Base):
    """A worker serving a model besides the one in ``Model.worker_id`` (its *home*, which
    trains it): the scheduler adds and removes these as the model's demand goes up and down
    (``scheduler/replicas.py``). A ``draining`` replica gets no new request; its row goes once
    the gateway has none in flight there."""

    __tablename__ = "model_replicas"
    __table_args__ = (UniqueConstraint("model_id", "worker_id"),)

    id: Mapped[str] = _id_column()
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    worker_id: Mapped[str] = mapped_column(ForeignKey("workers.id", ondelete="CASCADE"), index=True)
    # "serving" or "draining".
    status: Mapped[str] = mapped_column(String(16), default="serving")
    created_at: Mapped[datetime] = _created_at()


class ModelEvent(Base):
    """What the scheduler decided about a model's replicas, and why (``skytrain models
    show``); the id orders them."""

    __tablename__ = "model_events"
    __table_args__ = (Index(None, "model_id", "id"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(EventIdType, primary_key=True, autoincrement=True)
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    # scale_out, scale_in, replica_placed, replica_removed, launch, replicas_set, held
    kind: Mapped[str] = mapped_column(String(32))
    reason: Mapped[str] = mapped_column(Text)
    replicas: Mapped[int] = mapped_column(Integer)
    worker_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    created_at: Mapped[datetime] = _created_at()


class Entity(Base):
    """An entity name (the first part of ``<entity>/<project>/<name>``) and the tenant that
    used it first: only that tenant's models are created under it (``db.registry``). The
    primary key makes two tenants' first uses of one name a race only one can win."""

    __tablename__ = "entities"

    name: Mapped[str] = mapped_column(primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    created_at: Mapped[datetime] = _created_at()


class Checkpoint(Base):
    """One step of a model. Step 0 is the base model and has no files (``uri`` is null).

    Deleting a checkpoint keeps the row with ``deleted_at`` set, so a request pinned to that
    step can be told it was deleted rather than that it never existed. The row is committed
    first (``uri`` null, ``purge_pending`` set), its objects removed after: no row ever points
    at files that may be gone.
    """

    __tablename__ = "checkpoints"
    __table_args__ = (UniqueConstraint("model_id", "step"),)

    id: Mapped[str] = _id_column()
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    step: Mapped[int]
    uri: Mapped[str | None] = mapped_column(Text)
    metrics: Mapped[dict[str, float]] = mapped_column(default=dict)
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    # The files as committed: [{"name", "size", "sha256"}] (null for rows older than it, and
    # for step 0); readers check the store against it.
    files: Mapped[list[CommittedFile] | None] = mapped_column(JSONType)
    created_at: Mapped[datetime] = _created_at()
    deleted_at: Mapped[datetime | None]
    # Deleted, and its files may still be in the store: the scheduler's sweep removes them.
    purge_pending: Mapped[bool] = mapped_column(Boolean, default=False)
    # Last request pinned to this step: workers keep recently pinned steps loaded.
    last_requested_at: Mapped[datetime | None]


class TrajectoryBatch(Base):
    """Logged trajectory groups: a JSONL object plus the counts and summary metrics."""

    __tablename__ = "trajectory_batches"
    __table_args__ = (Index(None, "model_id", "split", "step"),)

    id: Mapped[str] = _id_column()
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"))
    split: Mapped[str] = mapped_column(String(64))
    step: Mapped[int]
    uri: Mapped[str] = mapped_column(Text)
    num_groups: Mapped[int]
    num_trajectories: Mapped[int]
    metrics: Mapped[dict[str, float]]
    # The batch's bytes, counted in its tenant's stored bytes (``Tenant.storage_bytes``).
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = _created_at()


class UploadedFile(Base):
    """JSONL training data uploaded for SFT jobs (``POST /v1/files``): its object is the
    tenant's ``files/<id>.jsonl``, its bytes counted in the tenant's stored bytes."""

    __tablename__ = "uploaded_files"
    __table_args__ = (Index(None, "tenant_id", "created_at", "id"),)

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"))
    num_trajectories: Mapped[int]
    size_bytes: Mapped[int] = mapped_column(BigInteger)
    # The SHA-256 of its bytes, hex (``storage check --read``); None for files uploaded before
    # it was recorded (i38v).
    sha256: Mapped[str | None] = mapped_column(String(64))
    created_at: Mapped[datetime] = _created_at()


class UploadReservation(Base):
    """Bytes of a tenant's storage quota taken by an upload in flight, before they reach the
    store (``db.tenants.StorageReservation``): counted against the quota until the upload
    commits or fails, or, when no one gives them back, until ``expires_at``."""

    __tablename__ = "upload_reservations"

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    bytes: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime]


class TrainingJob(Base):
    """One RL or SFT training request; the scheduler leases queued jobs to workers."""

    __tablename__ = "training_jobs"
    __table_args__ = (Index(None, "status", "created_at"),)

    id: Mapped[str] = _id_column()
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    kind: Mapped[str] = mapped_column(String(16))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    config: Mapped[dict[str, Any]]
    input_uri: Mapped[str] = mapped_column(Text)
    # The input batch's bytes, counted in its tenant's stored bytes.
    input_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    num_groups: Mapped[int]
    num_trajectories: Mapped[int]
    # The request id of the call that created it: the worker's lines for the job carry it.
    request_id: Mapped[str | None] = mapped_column(String(64))
    attempts: Mapped[int] = mapped_column(default=0)
    max_attempts: Mapped[int]
    # The step the current attempt trains from (the model's latest when it was leased).
    base_step: Mapped[int | None]
    worker_id: Mapped[str | None] = mapped_column(
        ForeignKey("workers.id", ondelete="SET NULL"), index=True
    )
    lease_expires_at: Mapped[datetime | None]
    # When the job was last leased: the start of the running attempt's time slice, and its
    # tenant's turn (tenants whose newest lease is oldest go first). A yield moves it to the
    # moment the job handed its worker back, so it waits behind the job it yielded to.
    leased_at: Mapped[datetime | None]
    cancel_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # The scheduler asked the running attempt to stop at its next optimizer step and hand
    # the worker back: another tenant's job waits for it (scheduler.queue.request_yields).
    yield_requested: Mapped[bool] = mapped_column(Boolean, default=False)
    # Times the job yielded: a yield is not a failed attempt, so attempts - preemptions are
    # what max_attempts bounds.
    preemptions: Mapped[int] = mapped_column(default=0)
    # The attempt whose staged files hold the state the job saved when it last yielded, and
    # the optimizer steps done in it: the next attempt resumes there (None: from the start).
    saved_attempt: Mapped[int | None]
    saved_steps: Mapped[int | None]
    result_step: Mapped[int | None]
    error: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _created_at()
    started_at: Mapped[datetime | None]
    finished_at: Mapped[datetime | None]


class TrainingJobEvent(Base):
    """What happened during a job, in order; the id is the cursor clients page with."""

    __tablename__ = "training_job_events"
    # AUTOINCREMENT on SQLite too: an id is never reused, even after the newest row is gone.
    __table_args__ = (Index(None, "job_id", "id"), {"sqlite_autoincrement": True})

    id: Mapped[int] = mapped_column(EventIdType, primary_key=True, autoincrement=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("training_jobs.id", ondelete="CASCADE"))
    type: Mapped[str] = mapped_column(String(32))
    data: Mapped[dict[str, Any]]
    created_at: Mapped[datetime] = _created_at()


class Worker(Base):
    """A machine serving and training models, started by a provider or joined by hand."""

    __tablename__ = "workers"

    id: Mapped[str] = _id_column()
    provider: Mapped[str] = mapped_column(String(32))
    cluster_name: Mapped[str | None]
    base_model: Mapped[str] = mapped_column(String(512))
    status: Mapped[str] = mapped_column(String(16))
    engine_endpoint: Mapped[str | None] = mapped_column(Text)
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    engine_secret: Mapped[str] = mapped_column(String(NAME_LENGTH))
    # The PEM certificate of the worker's front door, which the gateway pins. Without one the
    # gateway reaches only an engine on its own host over loopback HTTP (the gateway's tests
    # stand a bare engine in for a worker that way) and refuses anything else.
    engine_certificate: Mapped[str | None] = mapped_column(Text)
    capacity: Mapped[dict[str, Any]] = mapped_column(default=dict)
    hardware: Mapped[dict[str, Any]] = mapped_column(default=dict)
    status_message: Mapped[str | None] = mapped_column(Text)
    last_heartbeat_at: Mapped[datetime | None]
    created_at: Mapped[datetime] = _created_at()
    stopped_at: Mapped[datetime | None]
    # The base model's name in the engine, and the checkpoints it serves: [{model_id, step}].
    served_model_name: Mapped[str | None] = mapped_column(String(512))
    served: Mapped[list[ServedStep]] = mapped_column(JSONType, default=list)
    # Last time the worker had work: a model placed, a request routed, a job.
    last_active_at: Mapped[datetime | None]
    # A worker that failed to start: how many launches for its base model failed in a row,
    # this one included (0 once an operator asked for a retry: `skytrain workers retry`), and
    # when the next may go (None: not before an operator's retry, the limit being reached).
    launch_failures: Mapped[int | None]
    relaunch_after: Mapped[datetime | None]


class WorkerToken(Base):
    """A join token for workers started by hand (``sky launch sky/worker.yaml``).

    Stored as a hash; scoped to one base model when ``base_model`` is set; revocable. A worker
    that registers with it gets its own worker token for every later call.
    """

    __tablename__ = "worker_tokens"

    id: Mapped[str] = _id_column()
    name: Mapped[str | None]
    prefix: Mapped[str] = mapped_column(String(16))
    token_hash: Mapped[str] = mapped_column(String(64), unique=True)
    base_model: Mapped[str | None] = mapped_column(String(512))
    created_at: Mapped[datetime] = _created_at()
    last_used_at: Mapped[datetime | None]
    revoked_at: Mapped[datetime | None]


# --- the Tinker protocol ------------------------------------------------------------------------


class TinkerSession(Base):
    """A Tinker SDK session (one ``ServiceClient``): it heartbeats while its script runs."""

    __tablename__ = "tinker_sessions"

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    sdk_version: Mapped[str] = mapped_column(String(64))
    tags: Mapped[list[str]] = mapped_column(JSONType, default=list)
    user_metadata: Mapped[JSONObject] = mapped_column(default=dict)
    # Its user_metadata's bytes (as JSON), counted in its tenant's stored bytes.
    size_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    created_at: Mapped[datetime] = _created_at()
    last_heartbeat_at: Mapped[datetime] = mapped_column(default=utcnow)
    finished_at: Mapped[datetime | None]
    finish_status: Mapped[str | None] = mapped_column(String(32))


class TinkerRun(Base):
    """A Tinker training client's model (``<session>:train:<n>``): a skytrain model trained
    by its ordered operations, leased to a worker through a ``tinker`` training job."""

    __tablename__ = "tinker_runs"

    id: Mapped[str] = mapped_column(String(NAME_LENGTH), primary_key=True)
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    session_id: Mapped[str] = mapped_column(
        ForeignKey("tinker_sessions.id", ondelete="CASCADE"), index=True
    )
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), unique=True)
    job_id: Mapped[str] = mapped_column(ForeignKey("training_jobs.id", ondelete="CASCADE"))
    lora_config: Mapped[dict[str, Any]]
    user_metadata: Mapped[JSONObject] = mapped_column(default=dict)
    created_at: Mapped[datetime] = _created_at()
    last_request_at: Mapped[datetime] = mapped_column(default=utcnow)


class TinkerSampler(Base):
    """A sampling session: a checkpoint (model and step) or a base model to sample from."""

    __tablename__ = "tinker_samplers"

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    base_model: Mapped[str] = mapped_column(String(512))
    model_id: Mapped[str] = mapped_column(ForeignKey("models.id", ondelete="CASCADE"), index=True)
    step: Mapped[int]
    model_path: Mapped[str | None] = mapped_column(Text)
    created_at: Mapped[datetime] = _created_at()


class TinkerRequest(Base):
    """A future: one operation of a run (in ``seq_id`` order) or one sampling request.

    Small inputs and results are JSON here; tensors (a forward-backward's batch and output)
    live in the object store under the run's prefix.
    """

    __tablename__ = "tinker_requests"
    __table_args__ = (UniqueConstraint("run_id", "seq_id"),)

    id: Mapped[str] = _id_column()
    tenant_id: Mapped[str] = mapped_column(ForeignKey("tenants.id", ondelete="CASCADE"), index=True)
    run_id: Mapped[str | None] = mapped_column(ForeignKey("tinker_runs.id", ondelete="CASCADE"))
    seq_id: Mapped[int | None]
    sampler_id: Mapped[str | None] = mapped_column(
        ForeignKey("tinker_samplers.id", ondelete="CASCADE"), index=True
    )
    kind: Mapped[str] = mapped_column(String(32))
    status: Mapped[str] = mapped_column(String(16), default="queued")
    params: Mapped[dict[str, Any]] = mapped_column(default=dict)
    input_uri: Mapped[str | None] = mapped_column(Text)
    # The input object's bytes (a forward-backward's batch), counted in its tenant's stored bytes.
    input_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    result: Mapped[dict[str, Any] | None] = mapped_column(JSONType)
    result_uri: Mapped[str | None] = mapped_column(Text)
    # The output object's bytes (a forward-backward's result), counted in its tenant's stored
    # bytes once the worker reports it (0 for rows older than migration i38s).
    output_bytes: Mapped[int] = mapped_column(BigInteger, default=0)
    error: Mapped[str | None] = mapped_column(Text)
    error_category: Mapped[str | None] = mapped_column(String(16))
    created_at: Mapped[datetime] = _created_at()
    finished_at: Mapped[datetime | None]


class TinkerCheckpoint(Base):
    """A named save of a run, ``tinker://<run>/weights/<name>`` (kind ``training``) or
    ``.../sampler_weights/<name>`` (kind ``sampler``): a name for one of its model's steps."""

    __tablename__ = "tinker_checkpoints"
    __table_args__ = (UniqueConstraint("run_id", "kind", "name"),)

    id: Mapped[str] = _id_column()
    run_id: Mapped[str] = mapped_column(ForeignKey("tinker_runs.id", ondelete="CASCADE"))
    kind: Mapped[str] = mapped_column(String(16))
    name: Mapped[str] = mapped_column(String(NAME_LENGTH))
    step: Mapped[int]
    user_metadata: Mapped[JSONObject] = mapped_column(default=dict)
    created_at: Mapped[datetime] = _created_at()


class ManagedProcess(Base):
    """A process a control plane started on its host (a local worker), so that the processes
    no live control plane owns any more can be found and stopped.

    A process is named by its host, pid and start time (a pid alone may have been reused);
    its owner, the control plane that started it, the same way.
    """

    __tablename__ = "processes"

    id: Mapped[str] = _id_column()
    kind: Mapped[str] = mapped_column(String(32))
    worker_id: Mapped[str | None] = mapped_column(String(ID_LENGTH))
    host: Mapped[str] = mapped_column(index=True)
    pid: Mapped[int]
    start_time: Mapped[float] = mapped_column(Float)
    owner_pid: Mapped[int]
    owner_start_time: Mapped[float] = mapped_column(Float)
    created_at: Mapped[datetime] = _created_at()
    # The process and its owner as the pairs of columns above.
    process: Mapped[ProcessIdentity] = composite("pid", "start_time")
    owner: Mapped[ProcessIdentity] = composite("owner_pid", "owner_start_time")


class TenantLoad(Base):
    """A tenant's requests in flight through one control-plane process (inference requests
    counted by its gateway, REST requests by its routes: one row each), so that every process
    on a PostgreSQL database counts the tenant's limits across all of them
    (``db.tenant_loads``). A row whose ``expires_at`` has passed belongs to a process that
    stopped renewing it (it died) and counts for nothing."""

    __tablename__ = "tenant_loads"

    tenant_id: Mapped[str] = mapped_column(
        ForeignKey("tenants.id", ondelete="CASCADE"), primary_key=True
    )
    # The counter: a random id per gateway and per process's REST routes, new at each start.
    holder: Mapped[str] = mapped_column(String(ID_LENGTH), primary_key=True)
    requests: Mapped[int] = mapped_column(BigInteger)
    sequences: Mapped[int] = mapped_column(BigInteger)
    tokens: Mapped[int] = mapped_column(BigInteger)
    rest_requests: Mapped[int] = mapped_column(BigInteger)
    expires_at: Mapped[datetime]

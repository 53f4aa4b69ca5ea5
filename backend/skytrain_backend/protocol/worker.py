"""The job protocol between workers and the control plane (``/v1/worker/...``)."""

from __future__ import annotations

from typing import Annotated, Any, Literal, NotRequired

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
)
from typing_extensions import TypedDict

from skytrain_backend.protocol.configs import ModelConfig, RLTrainConfig, SFTTrainConfig
from skytrain_backend.ranges import (
    INT32_MAX,
)

EventType = Literal[
    "training_started",
    "gradient_step",
    "job_timeline",
    "training_preempted",
    "training_resumed",
    "training_ended",
    "training_failed",
]
# "tinker": a Tinker training run's lease on its model (see scheduler.tinker.runs).
JobKind = Literal["rl", "sft", "tinker"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_JOB_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


# --- the worker protocol (``/v1/worker/...``) ---------------------------------------------------
#
# What workers and the control plane say to each other: the routes declare these as their
# bodies and ``response_model``, and the worker's client validates every answer with them, so a
# worker and a control plane of different versions fail loudly at the first call.

WorkerStatus = Literal["starting", "ready", "training", "sleeping", "draining"]
# Events a worker reports during a job; the control plane writes the end events itself.
WorkerEventType = Literal["training_started", "training_resumed", "gradient_step", "job_timeline"]
# The largest PEM certificate a worker may register (a self-signed EC certificate is ~700 B).
MAX_CERTIFICATE_CHARS = 16_384
# The bounds of the secret a worker's front door requires (SKYTRAIN_ENGINE_SECRET).
ENGINE_SECRET_CHARS = (16, 128)


class WorkerCapacity(BaseModel):
    max_models: int = Field(ge=1, le=10_000)
    # The largest LoRA rank the worker's engine loads (vLLM's --max-lora-rank); None: any.
    max_lora_rank: int | None = Field(default=None, ge=1)


class WorkerRegistration(BaseModel):
    """``POST /register``: who the worker is and where its front door is."""

    base_model: str = Field(min_length=1, max_length=512)
    served_model_name: str = Field(min_length=1, max_length=512)
    engine_secret: str = Field(min_length=ENGINE_SECRET_CHARS[0], max_length=ENGINE_SECRET_CHARS[1])
    # The worker's front door: HTTPS on this port, with this self-signed certificate (PEM).
    port: int = Field(ge=1, le=65535)
    certificate: str = Field(min_length=1, max_length=MAX_CERTIFICATE_CHARS)
    # The front door's URL as the control plane reaches it; None: the registration's address.
    advertise_url: str | None = Field(default=None, max_length=2048)
    capacity: WorkerCapacity
    hardware: dict[str, Any] = Field(default_factory=dict)
    version: str = Field(default="", max_length=64)


class WorkerRegistered(BaseModel):
    worker_id: str
    heartbeat_interval_s: float
    lease_s: float
    # The worker's own token, when it joined with a join token (``swj-``).
    worker_token: str | None = None
    # The address the control plane reaches the worker at, and whether it did just now.
    endpoint: str
    reachable: bool
    message: str | None = None


class ServedCheckpoint(BaseModel):
    model_id: str = Field(max_length=64)
    step: int = Field(ge=0)


class WorkerStats(BaseModel):
    """What a worker measures of itself for the operator's metrics (None: not known here)."""

    running_requests: int | None = Field(default=None, ge=0, le=1_000_000)
    kv_cache_usage: float | None = Field(default=None, ge=0, le=1)
    gpu_memory_used_bytes: int | None = Field(default=None, ge=0, le=2**50)
    gpu_memory_total_bytes: int | None = Field(default=None, ge=0, le=2**50)


class Heartbeat(BaseModel):
    status: WorkerStatus
    served: list[ServedCheckpoint] = Field(default_factory=list, max_length=10_000)
    job_id: str | None = Field(default=None, max_length=64)
    # Older workers send none.
    stats: WorkerStats | None = None


class PlacedModel(BaseModel):
    """A model placed on the worker: the steps to serve and its adapter's shape."""

    model_id: str
    latest_step: int
    steps: list[int]
    model_config_: ModelConfig = Field(alias="model_config")

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class HeartbeatAnswer(BaseModel):
    models: list[PlacedModel]
    cancel_job_ids: list[str]
    drain: bool


class _LeasedJobBase(BaseModel):
    """What a worker needs to run the job it leased, whatever its kind."""

    id: str
    model_id: str
    base_model: str
    model_config_: ModelConfig = Field(alias="model_config")
    base_step: int = Field(ge=0)
    # The step the job commits: base_step + 1, or higher when newer steps were deleted (a
    # deleted step's number is never given again).
    step: int = Field(ge=1)
    attempt: int = Field(ge=1)
    # The optimizer steps done in the state the job saved when it last yielded its worker:
    # the worker resumes from that state (GET /jobs/{id}/saved-state); 0: from the start.
    steps_done: int = Field(default=0, ge=0)
    # The request id of the call that created the job: the worker's lines for it carry it.
    request_id: str | None = None

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class LeasedRLJob(_LeasedJobBase):
    """A GRPO job: its groups are the job's input, trained with ``config``."""

    kind: Literal["rl"]
    config: RLTrainConfig = Field(default_factory=RLTrainConfig)


class LeasedSFTJob(_LeasedJobBase):
    """A supervised fine-tuning job: its trajectories are the job's input."""

    kind: Literal["sft"]
    config: SFTTrainConfig = Field(default_factory=SFTTrainConfig)


# The job a worker leases, its config typed by ``kind`` and validated once on each side. On the
# wire it is what it was as a dict (``{"kind": "rl", "config": {...}}``): a worker and a control
# plane of either version read each other's leases.
LeasedJob = Annotated[LeasedRLJob | LeasedSFTJob, Field(discriminator="kind")]


class JobLease(BaseModel):
    job: LeasedJob


class JobAttempt(BaseModel):
    """The attempt of the job the worker holds; a stale attempt is answered 409."""

    attempt: int = Field(ge=1)


class LeaseRenewed(BaseModel):
    """What the control plane asks of the running attempt."""

    cancel_requested: bool
    # Another tenant's job waits for this worker and this one has had its time slice: stop
    # after the step in progress, save the state and hand the job back (POST .../preempt).
    yield_requested: bool = False


class JobEventRecorded(LeaseRenewed):
    """The answer to each event a worker reports: after every optimizer step, so a yield is
    learned at the next step boundary."""


class JobEventReport(JobAttempt):
    type: WorkerEventType
    data: dict[str, Any] = Field(default_factory=dict)


TrainerEventName = Literal[
    "loaded", "gradient_step", "saved", "saved_progress", "released", "offloaded", "reloaded"
]


class TrainerEventData(TypedDict, total=False):
    """What a trainer's timeline entry says besides its name and time."""

    device: str  # loaded, in one process
    processes: int  # loaded, sharded
    step: int  # loaded, saved
    loss: float | None  # gradient_step
    steps_done: int  # saved_progress


class TrainerEvent(TrainerEventData):
    """One entry of a trainer's timeline (``trainer.events``), sent in ``job_timeline``."""

    event: TrainerEventName
    at: float  # unix time


class ListedFile(TypedDict):
    """A file as the control plane lists it to a worker (a checkpoint's, a saved state's),
    with its SHA-256 where it was committed with one."""

    name: str
    size: int
    sha256: NotRequired[str]


class FileListing(TypedDict):
    data: list[ListedFile]


class CheckpointFile(BaseModel):
    name: str = Field(min_length=1, max_length=255)
    size: int = Field(ge=0)


class StagedFile(CheckpointFile):
    """A file the worker staged, as it has it on its disk: the control plane reads the staged
    object back and commits nothing unless both match."""

    sha256: str = Field(pattern=r"^[0-9a-f]{64}$", description="lowercase hex SHA-256")


class JobCompletion(JobAttempt):
    step: int = Field(ge=1)
    metrics: dict[str, float] = Field(default_factory=dict)
    files: list[StagedFile] = Field(min_length=1, max_length=64)


class JobCompleted(BaseModel):
    step: int
    checkpoint_id: str


class JobFailure(JobAttempt):
    error_message: str = Field(max_length=16_384)
    # False for what a retry cannot fix: a bad config, an adapter the engine refuses, a job
    # that ran out of memory (it would again, at the same size).
    retryable: bool = False
    cancelled: bool = False


class JobFailed(BaseModel):
    status: JobStatus


class JobPreemption(JobAttempt):
    """A job handed back at a step boundary, its state saved in the attempt's staged files
    (``PUT /jobs/{id}/files/{name}``): the next attempt resumes from it."""

    steps_done: int = Field(ge=1, le=INT32_MAX)
    files: list[CheckpointFile] = Field(min_length=1, max_length=64)


class JobPreempted(BaseModel):
    status: JobStatus

"""Request and response bodies of the REST API, named by role: ``XCreate`` (request),
``XPublic`` (one resource), ``XsPublic`` (a page ``{data, has_more}``).

Requests ignore fields they do not know (ART's client sends a few extra ones). Numbers and
text carry their ranges (``ranges``), so the OpenAPI document states them. The bodies that
hold trajectories are read by ``api.ingest`` a group at a time: these classes describe them
and validate their other fields.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Annotated, Any, Literal, TypeVar

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    Strict,
    StrictBool,
    StringConstraints,
    computed_field,
)

from skytrain_backend.json_types import JSONObject
from skytrain_backend.protocol import (
    MAX_REPLICAS,
    JobKind,
    JobStatus,
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
)
from skytrain_backend.ranges import (
    ID_MAX_LENGTH,
    ID_PATTERN,
    INT32_MAX,
    MAX_PENALTY,
    MAX_TEMPERATURE,
    MIN_PENALTY,
    NO_NUL_PATTERN,
    SPLIT_PATTERN,
    SafeName,
    Seed,
    Step,
    StrictInt,
)
from skytrain_backend.scheduler.replicas import ReplicaStatus
from skytrain_backend.scheduler.serving import ServingState

Split = Annotated[str, StringConstraints(min_length=1, max_length=64, pattern=SPLIT_PATTERN)]
Id = Annotated[str, StringConstraints(min_length=1, max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
# Most steps one delete names.
MAX_STEPS_PER_DELETE = 10_000


class _Public(BaseModel):
    model_config = ConfigDict(from_attributes=True)


PageT = TypeVar("PageT", bound=BaseModel)


def page_public(schema: type[PageT], found: tuple[Sequence[Any], bool]) -> PageT:
    """A query's page ``(rows, has_more)`` as its ``XsPublic``, each row read as its
    ``XPublic`` from the row's attributes."""
    rows, has_more = found
    return schema.model_validate({"data": rows, "has_more": has_more}, from_attributes=True)


class HealthPublic(BaseModel):
    status: str
    version: str
    scheduler: Literal["leader", "follower"] = Field(
        description="Whether this process runs the scheduler (one per database) or follows."
    )


# --- models -----------------------------------------------------------------------------------


class ModelCreate(BaseModel):
    entity: SafeName | None = Field(
        default=None,
        description="Default: your tenant's name. An entity belongs to the tenant that used it "
        "first (a tenant's own name is always its own): another tenant's is refused (409).",
    )
    project: SafeName
    name: SafeName
    base_model: str = Field(
        min_length=1,
        max_length=512,
        pattern=NO_NUL_PATTERN,
        description="A Hugging Face model id ('Qwen/Qwen2.5-0.5B-Instruct'), or the path of a "
        "model directory inside one the operator allows (SKYTRAIN_BASE_MODEL_DIRS).",
    )
    config: ModelConfig | None = None
    return_existing: StrictBool = Field(
        default=False, description="Return the model if it exists instead of answering 409."
    )


class ModelPublic(_Public):
    """A model. ``object``, ``created`` and ``owned_by`` make ``GET /v1/models`` also an OpenAI
    model list, whose ids the inference gateway accepts as ``model``."""

    id: str
    entity: str
    project: str
    name: str
    base_model: str
    config: JSONObject
    inference_name: str = Field(description="What to pass as `model` to /v1/chat/completions.")
    latest_step: int
    run_id: str
    created_at: datetime
    last_active_at: datetime | None = Field(
        description="Last registration, inference request or job (written at most every 30 s)."
    )
    serving: ServingPublic | None = Field(
        default=None, description="Where the model is served (on GET and create)."
    )
    replicas: list[ReplicaPublic] | None = Field(
        default=None, description="The workers serving it (on GET and create)."
    )
    demand: DemandPublic | None = Field(
        default=None,
        description="Its requests in flight, as the replica policy reads them (on GET).",
    )

    @computed_field  # type: ignore[prop-decorator]
    @property
    def object(self) -> Literal["model"]:
        return "model"

    @computed_field  # type: ignore[prop-decorator]
    @property
    def created(self) -> int:
        """``created_at`` in Unix seconds, as OpenAI clients read it."""
        return int(self.created_at.timestamp())

    @computed_field  # type: ignore[prop-decorator]
    @property
    def owned_by(self) -> str:
        return self.entity


class ServingPublic(BaseModel):
    """Whether the model's endpoint answers now, and in words what is happening if not."""

    state: ServingState
    ready: bool
    message: str
    worker_id: str | None = None
    step: int | None = None


class ReplicaPublic(BaseModel):
    """A worker serving the model: its ``home`` (which trains it) or a ``replica``."""

    worker_id: str
    role: Literal["home", "replica"]
    status: ReplicaStatus  # what each means: scheduler.replicas.ReplicaStatus
    in_flight: int = Field(
        default=0, description="The model's requests in flight on this worker now."
    )


class DemandPublic(_Public):
    """The model's demand as the control plane's gateway counts it: what the scheduler adds
    and removes replicas by (``scheduler.replicas``)."""

    in_flight: int = Field(description="Requests in flight now, on all its workers.")
    average_in_flight: float | None = Field(
        description="Requests in flight averaged over window_s (null until the control plane "
        "has run that long)."
    )
    per_replica: float | None = Field(
        description="average_in_flight per serving worker: the scheduler adds a replica above "
        "SKYTRAIN_REPLICA_SCALE_OUT_IN_FLIGHT, and drains one when one fewer would stay below "
        "SKYTRAIN_REPLICA_SCALE_IN_IN_FLIGHT."
    )
    replicas: int = Field(description="Workers serving it: its home and replicas not draining.")
    window_s: float


class ModelReplicasUpdate(BaseModel):
    """How many workers may serve the model (``PATCH /v1/models/{id}``); a field left out
    keeps its value."""

    model_config = ConfigDict(extra="forbid")

    min_replicas: StrictInt | None = Field(default=None, ge=1, le=MAX_REPLICAS)
    max_replicas: StrictInt | None = Field(default=None, ge=1, le=MAX_REPLICAS)


class ModelEventPublic(BaseModel):
    """A decision of the scheduler about the model's replicas, and why."""

    id: int
    kind: str
    reason: str
    replicas: int
    worker_id: str | None
    created_at: datetime


class ModelEventsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelEventPublic]
    has_more: bool = False


class ModelsPublic(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelPublic]
    has_more: bool


# --- checkpoints ------------------------------------------------------------------------------


class CheckpointPublic(_Public):
    id: str
    step: int
    metrics: dict[str, float]
    created_at: datetime
    deleted_at: datetime | None = Field(
        default=None, description="When its files were deleted (listed with include_deleted)."
    )


class CheckpointsPublic(BaseModel):
    data: list[CheckpointPublic]
    has_more: bool


class CheckpointsDelete(BaseModel):
    steps: list[Step] = Field(max_length=MAX_STEPS_PER_DELETE)


class CheckpointsDeleted(BaseModel):
    deleted_count: int
    not_found_steps: list[int]


class CheckpointFilePublic(BaseModel):
    name: str
    size: int


class CheckpointFilesPublic(BaseModel):
    data: list[CheckpointFilePublic]


# --- trajectory logs and metrics --------------------------------------------------------------


class LogCreate(BaseModel):
    trajectory_groups: list[TrajectoryGroup]
    split: Split = "val"
    step: Step | None = Field(default=None, description="Default: the model's latest step.")


class TrajectoryBatchPublic(_Public):
    id: str
    model_id: str
    split: str
    step: int
    num_groups: int
    num_trajectories: int
    metrics: dict[str, float]
    created_at: datetime


class TrajectoryBatchesPublic(BaseModel):
    data: list[TrajectoryBatchPublic]
    has_more: bool


class TrajectoryBatchDetail(TrajectoryBatchPublic):
    trajectory_groups: list[dict[str, Any]]


class MetricsPointPublic(BaseModel):
    step: int
    split: str
    metrics: dict[str, float]


class MetricsPublic(BaseModel):
    data: list[MetricsPointPublic]


# --- training jobs ----------------------------------------------------------------------------


class TrainingJobCreate(BaseModel):
    model_id: Id
    trajectory_groups: list[TrajectoryGroup]
    config: RLTrainConfig | None = None
    experimental_config: JSONObject | None = Field(
        default=None, description="ART's experimental_config; mutually exclusive with config."
    )


class SFTTrainingJobCreate(BaseModel):
    model_id: Id
    trajectories: list[Trajectory] | None = None
    training_data_url: str | None = Field(
        default=None, max_length=1024, description="skytrain-file://<id> from POST /v1/files."
    )
    config: SFTTrainConfig | None = None


class TrainingJobPublic(_Public):
    id: str
    model_id: str
    kind: JobKind
    status: JobStatus
    config: dict[str, Any]
    num_groups: int
    num_trajectories: int
    attempts: int = Field(description="Times it was leased to a worker, yields included.")
    preemptions: int = Field(
        description="Times it yielded its worker to another tenant's job at a step boundary "
        "(then resumed where it stopped): not failures."
    )
    step: int | None = Field(validation_alias="result_step", description="The step it produced.")
    error: str | None
    created_at: datetime
    started_at: datetime | None
    finished_at: datetime | None
    waiting: str | None = Field(
        default=None,
        description="Why a queued job has not started yet, in words (given by "
        "GET /v1/training-jobs/{id}; null once it runs, and in lists).",
    )
    too_long: LongSequencesPublic | None = Field(
        default=None,
        description="In the creation's answer: the sequences whose token count is known "
        "(sampled through skytrain: prompt_token_ids and token ids) that are longer than the "
        "job's row, which the trainer cuts to it (under ART's rules, leaves out); the job's "
        "training_started event says how many tokens were cut.",
    )


class LongSequencesPublic(BaseModel):
    """Sequences of a job longer than its row, as counted at submission."""

    sequences: int = Field(
        description="How many sequences (a trajectory, or one of its "
        "additional histories) are longer than the row."
    )
    longest_tokens: int = Field(description="The longest one's tokens.")
    row_tokens: int = Field(
        description="The job's row: packed_sequence_length, else the model's max_seq_length."
    )


class TrainingJobsPublic(BaseModel):
    data: list[TrainingJobPublic]
    has_more: bool


class TrainingJobEventPublic(_Public):
    # Event ids are integers in SQL; clients (ART's among them) treat cursors as strings.
    model_config = ConfigDict(from_attributes=True, coerce_numbers_to_str=True)

    id: str
    type: str
    data: dict[str, Any]
    created_at: datetime


class TrainingJobEventsPublic(BaseModel):
    data: list[TrainingJobEventPublic]
    has_more: bool


# --- files ------------------------------------------------------------------------------------


class FilePublic(BaseModel):
    id: str
    uri: str
    bytes: int
    num_trajectories: int
    created_at: datetime


class FilesPublic(BaseModel):
    data: list[FilePublic]
    has_more: bool


# --- inference --------------------------------------------------------------------------------

MAX_CHOICES = 128
MAX_TOP_LOGPROBS = 20
TokenId = Annotated[StrictInt, Field(ge=0, le=INT32_MAX)]
MaxTokens = Annotated[StrictInt, Field(ge=1, le=INT32_MAX)]
Penalty = Annotated[float, Strict(), Field(ge=MIN_PENALTY, le=MAX_PENALTY)]


class _InferenceCreate(BaseModel):
    """The OpenAI options the gateway checks before a request reaches a worker; every other
    field is passed on as sent (the engine refuses what it does not support). Integers and
    booleans are strict (``true`` is not 1), floats in OpenAI's ranges."""

    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str = Field(
        min_length=1,
        max_length=1024,
        pattern=NO_NUL_PATTERN,
        description="'<entity>/<project>/<name>' (latest step) or '...:step<N>', also as "
        "'wandb-artifact:///...', or a model id (with an optional ':step<N>').",
    )
    stream: StrictBool | None = None
    n: Annotated[StrictInt, Field(ge=1, le=MAX_CHOICES)] | None = None
    max_tokens: MaxTokens | None = Field(
        default=None,
        description="Default: SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS (2048); at most what the "
        "model's context leaves after the prompt (the engine refuses more).",
    )
    temperature: Annotated[float, Strict(), Field(ge=0, le=MAX_TEMPERATURE)] | None = None
    top_p: Annotated[float, Strict(), Field(gt=0, le=1)] | None = None
    top_k: Annotated[StrictInt, Field(ge=-1, le=INT32_MAX)] | None = None
    min_p: Annotated[float, Strict(), Field(ge=0, le=1)] | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: Annotated[float, Strict(), Field(gt=0, le=MAX_PENALTY)] | None = None
    seed: Seed | None = None
    stop_token_ids: list[TokenId] | None = None
    ignore_eos: StrictBool | None = None
    skip_special_tokens: StrictBool | None = None
    include_stop_str_in_output: StrictBool | None = None


class ChatCompletionCreate(_InferenceCreate):
    messages: list[dict[str, Any]]
    max_completion_tokens: MaxTokens | None = None
    logprobs: StrictBool | None = None
    top_logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | None = None
    parallel_tool_calls: StrictBool | None = None


class CompletionCreate(_InferenceCreate):
    prompt: str | list[str] | list[TokenId] | list[list[TokenId]]
    # ``true`` asks for the sampled tokens' logprobs as 0 does (``admission``), as before.
    logprobs: Annotated[StrictInt, Field(ge=0, le=MAX_TOP_LOGPROBS)] | StrictBool | None = None
    echo: StrictBool | None = None

"""The JSON the SDK sends to and reads from the server's ``/v1`` API, as TypedDicts.

The server's pydantic schemas (``skytrain_backend.api.schemas``) are the source; these name
the fields the SDK reads, so a misspelt key fails the type check, not a training run.
``_JSONObject`` is for what is the user's own (a trajectory's or a group's metadata).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

_JSONObject = dict[str, Any]
"""A JSON object of arbitrary shape: the user's own data, passed on as given."""

_QueryParams = dict[str, str | int | float]


class _ServingAnswer(TypedDict):
    state: str
    ready: bool
    message: str
    worker_id: NotRequired[str | None]
    step: NotRequired[int | None]


class _ReplicaAnswer(TypedDict):
    worker_id: str
    role: Literal["home", "replica"]
    status: Literal["serving", "sleeping", "starting", "unreachable", "draining"]
    in_flight: NotRequired[int]


class _DemandAnswer(TypedDict):
    in_flight: int
    average_in_flight: float | None
    per_replica: float | None
    replicas: int
    window_s: float


class _ModelAnswer(TypedDict):
    id: str
    entity: str
    project: str
    name: str
    base_model: str
    inference_name: str
    latest_step: int
    run_id: str
    created_at: str
    serving: NotRequired[_ServingAnswer | None]
    replicas: NotRequired[list[_ReplicaAnswer] | None]
    demand: NotRequired[_DemandAnswer | None]


class _ModelCreateBody(TypedDict):
    project: str
    name: str
    base_model: str
    return_existing: bool
    entity: NotRequired[str]
    config: NotRequired[dict[str, Any]]  # a ModelConfig, dumped


class _LongSequences(TypedDict):
    sequences: int
    longest_tokens: int
    row_tokens: int


class _JobAnswer(TypedDict):
    id: str
    model_id: str
    kind: str
    status: str
    step: int | None
    error: str | None
    waiting: NotRequired[str | None]
    too_long: NotRequired[_LongSequences | None]


class _JobEvent(TypedDict):
    id: str
    type: str
    # What the event says: its keys differ by ``type`` (the trainer's metrics, a reason).
    data: dict[str, Any]


class _JobEventsPage(TypedDict):
    data: list[_JobEvent]
    has_more: bool


# The pydantic models the SDK sends (trajectories, groups, configs) go as their JSON dumps.


class _TrainBody(TypedDict):
    model_id: str
    trajectory_groups: list[dict[str, Any]]
    config: NotRequired[dict[str, Any]]


class _SFTTrainBody(TypedDict):
    model_id: str
    trajectories: list[dict[str, Any]]
    config: NotRequired[dict[str, Any]]


class _LogBody(TypedDict):
    trajectory_groups: list[dict[str, Any]]
    split: str
    step: NotRequired[int]


class _CheckpointAnswer(TypedDict):
    id: str
    step: int
    metrics: dict[str, float]
    created_at: NotRequired[str | None]


class _CheckpointsDeleted(TypedDict):
    deleted_count: int
    not_found_steps: list[int]


class _FileAnswer(TypedDict):
    name: str
    size: int

"""The JSON the SDK sends to and reads from the server's ``/v1`` API, as TypedDicts.

The server's pydantic schemas (``skytrain_backend.api.schemas``) are the source; these name
the fields the SDK reads, so a misspelt key fails the type check, not a training run.
``JSONObject`` is for what is the user's own (a trajectory's or a group's metadata).
"""

from __future__ import annotations

from typing import Any, Literal, NotRequired, TypedDict

JSONObject = dict[str, Any]
"""A JSON object of arbitrary shape: the user's own data, passed on as given."""

QueryParams = dict[str, str | int | float]


class ServingAnswer(TypedDict):
    state: str
    ready: bool
    message: str
    worker_id: NotRequired[str | None]
    step: NotRequired[int | None]


class ReplicaAnswer(TypedDict):
    worker_id: str
    role: Literal["home", "replica"]
    status: Literal["serving", "draining"]


class ModelAnswer(TypedDict):
    id: str
    entity: str
    project: str
    name: str
    base_model: str
    inference_name: str
    latest_step: int
    run_id: str
    created_at: str
    serving: NotRequired[ServingAnswer | None]
    replicas: NotRequired[list[ReplicaAnswer] | None]


class ModelCreateBody(TypedDict):
    project: str
    name: str
    base_model: str
    return_existing: bool
    entity: NotRequired[str]
    config: NotRequired[dict[str, Any]]  # a ModelConfig, dumped


class LongSequences(TypedDict):
    sequences: int
    longest_tokens: int
    row_tokens: int


class JobAnswer(TypedDict):
    id: str
    model_id: str
    kind: str
    status: str
    step: int | None
    error: str | None
    waiting: NotRequired[str | None]
    too_long: NotRequired[LongSequences | None]


class JobEvent(TypedDict):
    id: str
    type: str
    # What the event says: its keys differ by ``type`` (the trainer's metrics, a reason).
    data: dict[str, Any]


class JobEventsPage(TypedDict):
    data: list[JobEvent]
    has_more: bool


# The pydantic models the SDK sends (trajectories, groups, configs) go as their JSON dumps.


class TrainBody(TypedDict):
    model_id: str
    trajectory_groups: list[dict[str, Any]]
    config: NotRequired[dict[str, Any]]


class SFTTrainBody(TypedDict):
    model_id: str
    trajectories: list[dict[str, Any]]
    config: NotRequired[dict[str, Any]]


class LogBody(TypedDict):
    trajectory_groups: list[dict[str, Any]]
    split: str
    step: NotRequired[int]


class CheckpointAnswer(TypedDict):
    id: str
    step: int
    metrics: dict[str, float]
    created_at: NotRequired[str | None]


class CheckpointsDeleted(TypedDict):
    deleted_count: int
    not_found_steps: list[int]


class FileAnswer(TypedDict):
    name: str
    size: int

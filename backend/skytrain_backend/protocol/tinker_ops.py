"""The Tinker worker protocol (``/v1/worker/tinker/...``): what a worker's Tinker executor and
the control plane say to each other, typed like the job protocol (``protocol/worker.py``).

An operation is one ``TinkerOperation``: a union discriminated by ``kind``, its ``params``
typed per kind. The control plane's routes build one from the SDK's request and queue it
(``scheduler/tinker/runs.submit``); a worker leases a run (``TinkerLease``: the run, and the
plan to rebuild its state), then asks for its operations one by one and gets the same
operation back (``LeasedOperation``: the operation and where it stands in the run). The worker answers each with ``OperationCompletion``, ``OperationFailure`` or (for
saves) ``SaveCommit``. The routes declare these as bodies and ``response_model``, and
``worker/client.py`` validates every answer with them: a worker and a control plane of
different versions fail at the first call, saying so.

Parameters the worker does not read (a save's name, a batch's token count) travel all the
same: one type on both sides. Params ignore keys they do not know (rows stored by older
versions), answers are strict where they matter.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

from skytrain_backend.protocol.configs import ModelConfig
from skytrain_backend.protocol.tinker_api import AdamParams
from skytrain_backend.protocol.worker import StagedFile

# The longest a worker's wait for the next operation is held.
MAX_NEXT_WAIT_S = 20.0

OperationKind = Literal[
    "create_model",
    "load_create",
    "forward",
    "forward_backward",
    "optim_step",
    "save_weights",
    "save_weights_for_sampler",
    "load_weights",
]
CREATIONS: frozenset[str] = frozenset({"create_model", "load_create"})
SAVES: frozenset[str] = frozenset({"save_weights", "save_weights_for_sampler"})
# What changes a run's state and is replayed when it is rebuilt.
STATE_CHANGES: frozenset[str] = frozenset({"forward_backward", "optim_step"})


class _Params(BaseModel):
    """An operation's stored parameters: what the worker reads is typed, the rest ignored."""

    model_config = ConfigDict(extra="ignore")


class CheckpointSource(BaseModel):
    """A committed checkpoint a run may read: a model's step."""

    model_id: str = Field(min_length=1)
    step: int = Field(ge=0)


class RestorePoint(BaseModel):
    """Where a run's state starts: a fresh adapter from ``seed``, or a checkpoint's adapter
    (with its Adam state when ``optimizer``)."""

    seed: int | None = None
    checkpoint: CheckpointSource | None = None
    optimizer: bool = False


class RebuildPlan(BaseModel):
    """How a worker rebuilds a run: from ``restore`` (None: its creation failed), rerunning
    the finished operations ``replay``; ``next_seq`` is the first operation still to run."""

    restore: RestorePoint | None
    replay: list[int] = Field(default_factory=list)
    next_seq: int = Field(ge=0)


class LeasedRun(BaseModel):
    """A leased Tinker run: its job (and attempt), model, and the plan to rebuild it."""

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)

    job_id: str
    attempt: int = Field(ge=1)
    run_id: str
    model_id: str
    base_model: str
    model_config_: ModelConfig = Field(alias="model_config")
    # The newest step number the model ever had (deleted ones too): its saves go above it.
    latest_step: int = Field(default=0, ge=0)
    plan: RebuildPlan


class TinkerLease(BaseModel):
    run: LeasedRun


# --- operations, typed per kind -----------------------------------------------------------------


class CreationParams(_Params):
    """``create_model`` (a seeded fresh adapter) or ``load_create`` (from a checkpoint)."""

    seed: int | None = None
    source: CheckpointSource | None = None
    optimizer: bool = False
    path: str | None = None

    def restore(self) -> RestorePoint:
        return RestorePoint(seed=self.seed, checkpoint=self.source, optimizer=self.optimizer)


class OptimParams(_Params):
    """One AdamW step's hyperparameters, checked when the SDK sent them."""

    adam: AdamParams


class BatchParams(_Params):
    """A forward or forward-backward: its batch is the operation's input object (its size
    here, for the futures' reports)."""

    loss_fn: str | None = None
    num_datums: int | None = Field(default=None, ge=0)
    num_tokens: int | None = Field(default=None, ge=0)


# A run's two kinds of named checkpoint: full training state, or weights for sampling.
CheckpointKind = Literal["training", "sampler"]


class SaveParams(_Params):
    """A save's name (None: a sampler save the SDK did not name), and what the control plane
    records once its checkpoint is committed."""

    name: str | None = None
    overwrite: bool = False
    user_metadata: dict[str, str] | None = None
    # Set when the save is committed: the step it made, and whether gradients were pending
    # (a save with none is a restore point).
    committed_step: int | None = Field(default=None, ge=1)
    grads_pending: bool | None = None


class LoadParams(_Params):
    """A checkpoint loaded into a live run: ``path`` as the SDK named it."""

    source: CheckpointSource
    optimizer: bool = False
    path: str | None = None


class CreationOperation(BaseModel):
    kind: Literal["create_model", "load_create"]
    params: CreationParams


class BatchOperation(BaseModel):
    kind: Literal["forward", "forward_backward"]
    params: BatchParams


class OptimOperation(BaseModel):
    kind: Literal["optim_step"]
    params: OptimParams | None = None


class SaveOperation(BaseModel):
    kind: Literal["save_weights", "save_weights_for_sampler"]
    params: SaveParams

    @property
    def checkpoint_kind(self) -> CheckpointKind:
        """The checkpoints its name is among (``tinker://<run>/weights/`` or
        ``.../sampler_weights/``)."""
        return "training" if self.kind == "save_weights" else "sampler"


class LoadOperation(BaseModel):
    kind: Literal["load_weights"]
    params: LoadParams | None = None


TinkerOperation = Annotated[
    CreationOperation | BatchOperation | OptimOperation | SaveOperation | LoadOperation,
    Field(discriminator="kind"),
]


class LeasedOperation(BaseModel):
    """An operation as a worker gets it: where it stands in its run, and whether it has an
    input object (a forward-backward's batch)."""

    seq_id: int = Field(ge=0)
    request_id: str
    has_input: bool = False
    # Refused on arrival (or finished before): the worker only moves past it.
    finished: bool = False
    operation: TinkerOperation


# --- what the worker sends ----------------------------------------------------------------------


class NextOperationRequest(BaseModel):
    attempt: int = Field(ge=1)
    seq_id: int = Field(ge=0)
    wait_s: float = Field(default=10.0, ge=0, le=MAX_NEXT_WAIT_S)


class OperationResult(BaseModel):
    """What an operation that computes returns beside its output object (an optimizer
    step's metrics)."""

    model_config = ConfigDict(extra="forbid")

    metrics: dict[str, float] | None = None


class OperationCompletion(BaseModel):
    attempt: int = Field(ge=1)
    result: OperationResult = Field(default_factory=OperationResult)
    # Whether the output object (a ForwardBackwardOutput) was uploaded first.
    has_output: bool = False


class OperationFailure(BaseModel):
    attempt: int = Field(ge=1)
    error: str = Field(min_length=1)
    category: Literal["user", "server"] = "user"


class SaveCommit(BaseModel):
    """A save's checkpoint: the files staged for ``step`` (or ``reuse_step``, when the
    weights did not change since that save), and the state it holds."""

    attempt: int = Field(ge=1)
    # Each file's size and SHA-256 as the worker has it: nothing is committed unless the
    # staged objects match.
    files: list[StagedFile] = Field(default_factory=list, max_length=64)
    step: int = Field(ge=1)
    reuse_step: int | None = Field(default=None, ge=1)
    grads_pending: bool
    optim_steps: int = Field(ge=0)
    served: bool = False


class CheckpointFileInfo(BaseModel):
    name: str = Field(min_length=1)
    size: int = Field(ge=0)


class CheckpointFileList(BaseModel):
    data: list[CheckpointFileInfo]

"""Request and response shapes of the Tinker protocol (``/api/v1``), as the official ``tinker``
SDK sends and reads them (its ``tinker.types``; only the fields skytrain uses are declared).

Requests ignore fields they do not know, so newer SDKs keep working; known options that
skytrain does not implement are refused by the routes with a message saying so. Responses are
what the SDK validates: the field names and types are its own.
"""

from __future__ import annotations

import math
from datetime import datetime
from typing import Annotated, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Field, StringConstraints, field_validator

from skytrain_backend.ranges import INT32_MAX, NO_NUL_PATTERN, JsonObject, Seed

MAX_SAMPLES = 128
# Ids skytrain issued (sessions, runs, samplers, futures): no NUL, bounded.
TinkerId = Annotated[str, StringConstraints(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]
# Base model names and tinker:// paths.
TinkerName = Annotated[
    str, StringConstraints(min_length=1, max_length=1024, pattern=NO_NUL_PATTERN)
]
ShortText = Annotated[str, StringConstraints(max_length=1024, pattern=NO_NUL_PATTERN)]
# Sequence numbers the SDK counts per session/run: 32-bit, as the columns they reach.
SeqId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Request(BaseModel):
    model_config = ConfigDict(extra="ignore", protected_namespaces=())


# --- sessions and configuration -----------------------------------------------------------------


class ClientConfigResponse(BaseModel):
    """Feature flags for the SDK: plain API keys (no JWT exchange), httpx transport, protobuf
    forward-backward bodies without compression, one future polled at a time."""

    pjwt_auth_enabled: bool = False
    credential_default_source: str = "api_key"
    parallel_fwdbwd_chunks: bool = True
    proto_compress_fwdbwd: bool = False
    use_pyqwest_transport: bool = False
    sample_use_retrieve_futures: bool = False
    custom_loss_server_side: bool = False
    sample_join_sampling_session: bool = False


class DynamicConfigResponse(BaseModel):
    refresh_interval_sec: int = 300
    sample_cancel_enabled: bool = False


class CreateSessionRequest(_Request):
    tags: list[ShortText] = Field(default_factory=list, max_length=100)
    user_metadata: JsonObject | None = None
    sdk_version: str = Field(default="", max_length=64, pattern=NO_NUL_PATTERN)


class CreateSessionResponse(BaseModel):
    type: Literal["create_session"] = "create_session"
    session_id: str
    info_message: str | None = None


class SessionHeartbeatRequest(_Request):
    session_id: TinkerId


class FinishSessionRequest(_Request):
    reason: JsonObject = Field(default_factory=dict)
    detail: ShortText | None = None


class SupportedModel(BaseModel):
    model_name: str
    trainable: bool = True
    sampleable: bool = True


class ServerCapabilities(BaseModel):
    supported_models: list[SupportedModel]


# --- training -----------------------------------------------------------------------------------


class LoraConfig(_Request):
    rank: int = Field(ge=1, le=256)
    seed: Seed | None = None
    train_unembed: bool = True
    train_mlp: bool = True
    train_attn: bool = True


class OptimizerConfig(_Request):
    model_config = ConfigDict(extra="allow")

    type: str = Field(default="adamw", max_length=64, pattern=NO_NUL_PATTERN)


class CreateModelRequest(_Request):
    session_id: TinkerId
    model_seq_id: SeqId
    base_model: str = Field(min_length=1, max_length=512, pattern=NO_NUL_PATTERN)
    user_metadata: JsonObject | None = None
    lora_config: LoraConfig | None = None
    optimizer_config: OptimizerConfig = Field(default_factory=OptimizerConfig)


class UntypedAPIFuture(BaseModel):
    request_id: str
    model_id: str | None = None
    sample_sequence_ids: list[str] | None = None


class GetInfoRequest(_Request):
    model_id: TinkerId


class ModelData(BaseModel):
    arch: str | None = None
    model_name: str
    tokenizer_id: str


class GetInfoResponse(BaseModel):
    type: Literal["get_info"] = "get_info"
    model_data: ModelData
    model_id: str
    optimizer_config: dict[str, str] = Field(default_factory=lambda: {"type": "adamw"})
    is_lora: bool = True
    lora_rank: int
    model_name: str


class AdamParams(_Request):
    """One AdamW step's hyperparameters as the SDK sends them (no clipping at 0): checked on
    arrival, carried by the ``optim_step`` operation, applied by ``trainer.primitives``."""

    model_config = ConfigDict(extra="forbid")

    learning_rate: float = Field(default=1e-4, ge=0, allow_inf_nan=False)
    beta1: float = Field(default=0.9, ge=0, lt=1)
    beta2: float = Field(default=0.95, ge=0, lt=1)
    eps: float = Field(default=1e-12, gt=0, allow_inf_nan=False)
    weight_decay: float = Field(default=0.0, ge=0, allow_inf_nan=False)
    grad_clip_norm: float = Field(default=0.0, ge=0, allow_inf_nan=False)


class OptimStepRequest(_Request):
    # Checked by the route: an invalid one fails its future (the SDK numbered it already).
    adam_params: JsonObject | None = None
    optimizer_params: JsonObject | None = None
    model_id: TinkerId
    seq_id: SeqId | None = None


class SaveWeightsRequest(_Request):
    model_id: TinkerId
    path: TinkerName | None = None
    seq_id: SeqId | None = None
    ttl_seconds: int | None = Field(default=None, ge=0, le=INT32_MAX)
    overwrite: bool = False
    user_metadata: dict[ShortText, ShortText] | None = Field(default=None, max_length=100)


class SaveWeightsForSamplerRequest(_Request):
    model_id: TinkerId
    path: TinkerName | None = None
    sampling_session_seq_id: SeqId | None = None
    kind: str = Field(default="snapshot", max_length=64, pattern=NO_NUL_PATTERN)
    seq_id: SeqId | None = None
    ttl_seconds: int | None = Field(default=None, ge=0, le=INT32_MAX)
    user_metadata: dict[ShortText, ShortText] | None = Field(default=None, max_length=100)


class LoadWeightsRequest(_Request):
    model_id: TinkerId | None = None
    seq_id: SeqId | None = None
    session_id: TinkerId | None = None
    model_seq_id: SeqId | None = None
    base_model: TinkerName | None = None
    user_metadata: JsonObject | None = None
    path: TinkerName
    optimizer: bool
    optimizer_config: OptimizerConfig | None = None
    weights_access_token: ShortText | None = None


# --- sampling -----------------------------------------------------------------------------------


class CreateSamplingSessionRequest(_Request):
    session_id: TinkerId
    sampling_session_seq_id: SeqId = 0
    base_model: str | None = Field(default=None, max_length=512, pattern=NO_NUL_PATTERN)
    model_path: TinkerName | None = None


class CreateSamplingSessionResponse(BaseModel):
    type: Literal["create_sampling_session"] = "create_sampling_session"
    sampling_session_id: str


class GetSamplerResponse(BaseModel):
    sampler_id: str
    base_model: str
    model_path: str | None = None


class EncodedTextChunk(_Request):
    tokens: list[Annotated[int, Field(ge=0, le=INT32_MAX)]] = Field(max_length=1_000_000)
    type: Literal["encoded_text"] = "encoded_text"


class ModelInput(_Request):
    chunks: list[JsonObject] = Field(max_length=1024)

    def token_ids(self) -> list[int]:
        """The prompt's token ids; image chunks are refused (ValueError naming the chunk)."""
        tokens: list[int] = []
        for index, chunk in enumerate(self.chunks):
            if chunk.get("type", "encoded_text") != "encoded_text":
                raise ValueError(
                    f"prompt chunk {index} is {chunk.get('type')!r}: skytrain samples from token "
                    "prompts only (ModelInput.from_ints)"
                )
            tokens += EncodedTextChunk.model_validate(chunk).tokens
        return tokens


class TinkerSamplingParams(_Request):
    """The SDK's ``SamplingParams`` (``sampling_params`` of a sample request)."""

    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    seed: Seed | None = None
    stop: (
        ShortText
        | Annotated[list[ShortText], Field(max_length=16)]
        | Annotated[list[Annotated[int, Field(ge=0, le=INT32_MAX)]], Field(max_length=16)]
        | None
    ) = None
    temperature: float = Field(default=1.0, ge=0, allow_inf_nan=False)
    top_k: int = Field(default=-1, ge=-1, le=INT32_MAX)
    top_p: float = Field(default=1.0, gt=0, le=1)

    @field_validator("temperature", "top_p")
    @classmethod
    def _finite(cls, value: float) -> float:
        if not math.isfinite(value):
            raise ValueError("must be a finite number")
        return value


MAX_TOP_LOGPROBS = 20


class SampleRequest(_Request):
    num_samples: int = Field(default=1, ge=1, le=MAX_SAMPLES)
    prompt: ModelInput
    sampling_params: TinkerSamplingParams
    base_model: TinkerName | None = None
    model_path: TinkerName | None = None
    sampling_session_id: TinkerId | None = None
    seq_id: SeqId | None = None
    prompt_logprobs: bool | None = None
    # As many top tokens per position as the engines return (vLLM's and skytrain's limit).
    topk_prompt_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    topk_sample_logprobs: int = Field(default=0, ge=0, le=MAX_TOP_LOGPROBS)
    target_prompt_logprobs: JsonObject | None = None
    prompt_alt_tokens_k: int = Field(default=0, ge=0, le=INT32_MAX)
    prompt_logprobs_last_n: int | None = Field(default=None, ge=0, le=INT32_MAX)
    record_stability_info: bool | None = None


# --- futures ------------------------------------------------------------------------------------


class FutureRetrieveRequest(_Request):
    request_id: TinkerId
    allow_metadata_only: bool = False


class TryAgainResponse(BaseModel):
    type: Literal["try_again"] = "try_again"
    request_id: str
    queue_state: Literal["active", "paused_capacity", "paused_rate_limit"]
    queue_state_reason: str | None = None


class RequestFailedResponse(BaseModel):
    error: str
    category: Literal["unknown", "server", "user"]


# --- training runs and checkpoints ----------------------------------------------------------------


class TinkerCheckpointPublic(BaseModel):
    checkpoint_id: str
    checkpoint_type: Literal["training", "sampler"]
    time: datetime
    tinker_path: str
    size_bytes: int | None = None
    public: bool = False
    user_metadata: dict[str, str] | None = None
    expires_at: datetime | None = None


class Cursor(BaseModel):
    offset: int
    limit: int
    total_count: int


class CheckpointsListResponse(BaseModel):
    checkpoints: list[TinkerCheckpointPublic]
    cursor: Cursor | None = None


class TrainingRunPublic(BaseModel):
    training_run_id: str
    base_model: str
    model_owner: str
    is_lora: bool = True
    corrupted: bool = False
    lora_rank: int | None = None
    last_request_time: datetime
    last_checkpoint: TinkerCheckpointPublic | None = None
    last_sampler_checkpoint: TinkerCheckpointPublic | None = None
    user_metadata: dict[str, str] | None = None


class TrainingRunsResponse(BaseModel):
    training_runs: list[TrainingRunPublic]
    cursor: Cursor


class WeightsInfoRequest(_Request):
    tinker_path: TinkerName = Field(validation_alias=AliasChoices("tinker_path", "path"))


class WeightsInfoResponse(BaseModel):
    base_model: str
    is_lora: bool = True
    lora_rank: int
    train_unembed: bool = False
    train_mlp: bool
    train_attn: bool

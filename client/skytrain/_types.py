"""Configuration objects the SDK sends, and the results it hands back.

The configs mirror the server's ``ModelConfig``, ``RLTrainConfig`` and ``SFTTrainConfig``
field for field, with every field optional: a field left ``None`` is not sent, so the server's
default applies and a newer server's defaults reach old clients. The server validates the
values; the SDK checks what it can name early: types, allowed choices and the server's ranges
(finite floats, bounded integers and lists).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from datetime import datetime
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from skytrain._wire import _CheckpointAnswer

# The server's ranges (its ``ranges`` module): a value outside fails here, before any request.
INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
MAX_SEQUENCE_LENGTH = 1024 * 1024


class _SentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    def _to_request(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude_none=True)


class ModelConfig(_SentConfig):
    """Fixed at registration: the LoRA adapter's shape and the longest sequence trained on;
    and how many workers may serve the model (``min_replicas``/``max_replicas``)."""

    lora_rank: int | None = Field(default=None, ge=1, le=256)
    lora_alpha: int | None = Field(default=None, ge=1, le=INT32_MAX)
    lora_dropout: float | None = Field(default=None, ge=0.0, lt=1.0)
    lora_target_modules: list[str] | None = Field(default=None, min_length=1, max_length=64)
    max_seq_length: int | None = Field(default=None, ge=16, le=MAX_SEQUENCE_LENGTH)
    gradient_checkpointing: bool | None = None
    # Workers serving the model at least / at most (the scheduler follows demand between
    # them; capped by the tenant's max_workers). Changeable later: ``model.set_replicas``.
    min_replicas: int | None = Field(default=None, ge=1, le=64)
    max_replicas: int | None = Field(default=None, ge=1, le=64)


class TrainConfig(_SentConfig):
    """Options of one GRPO training job (``model.train``); ART's options keep ART's meaning.

    A job is ``num_gradient_steps`` optimizer steps over whole groups (one when unset), or with
    ``"per_row"`` ART's rule: one step per packed row. ``epsilon`` / ``epsilon_high`` default
    to ART's for the loss: PPO clips the ratio to [0.8, 1.2], CISPO's importance weight to
    [0, 5]. ``preset="art"`` trains as ART does where skytrain's defaults differ (CISPO, ART's
    loss aggregation and steps, AdamW beta2 0.99, weight decay 0.1, max_grad_norm 0.1, ART's KL
    shaping); the options set alongside it still win. docs/art.md has the table.
    """

    preset: Literal["art"] | None = None
    learning_rate: float | None = Field(default=None, gt=0, le=1.0)
    loss_fn: Literal["ppo", "cispo"] | None = None
    epsilon: float | None = Field(default=None, gt=0, le=1e3)
    epsilon_high: float | None = Field(default=None, gt=0, le=1e3)
    importance_sampling_level: (
        Literal["token", "sequence", "average", "geometric_average"] | None
    ) = None
    advantage_balance: float | None = Field(default=None, ge=-1.0, le=1.0)
    max_negative_advantage_importance_sampling_weight: float | None = Field(
        default=None, ge=0, le=1e6
    )
    mask_prob_ratio: bool | None = None
    kimi_k2_tau: float | None = Field(default=None, ge=0, le=1e3)
    precalculate_logprobs: bool | None = None
    truncated_importance_sampling: float | None = Field(default=None, gt=0, le=1e3)
    kl_penalty_coef: float | None = Field(default=None, ge=0, le=1e3)
    kl_penalty_source: Literal["current_learner", "sample"] | None = None
    # The KL reference: the model's own checkpoint at this step (0: the base model), or at the
    # step the job makes minus this lag; at most one of the two.
    kl_penalty_reference_step: int | None = Field(default=None, ge=0, le=INT32_MAX)
    kl_penalty_step_lag: int | None = Field(default=None, ge=1, le=INT32_MAX)
    scale_rewards: bool | None = None
    # Refuse groups sampled more than this many steps before the model's current step.
    max_off_policy_steps: int | None = Field(default=None, ge=0, le=INT32_MAX)
    allow_training_without_logprobs: bool | None = None
    unsampled_old_logprobs: Literal["job_start", "current"] | None = None
    warmup_step: bool | None = None
    aggregation: Literal["token_mean", "art"] | None = None
    logprob_calculation_chunk_size: int | None = Field(default=None, ge=1, le=MAX_SEQUENCE_LENGTH)
    packed_sequence_length: int | None = Field(default=None, ge=16, le=MAX_SEQUENCE_LENGTH)
    num_gradient_steps: Annotated[int, Field(ge=1, le=10_000)] | Literal["per_row"] | None = None
    num_trajectories_learning_rate_multiplier_power: float | None = Field(
        default=None, ge=-4.0, le=4.0
    )
    adam_beta2: float | None = Field(default=None, ge=0.0, lt=1.0)
    max_grad_norm: float | None = Field(default=None, gt=0, le=1e6)
    weight_decay: float | None = Field(default=None, ge=0, le=1e3)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)


class SFTConfig(_SentConfig):
    """Options of one supervised fine-tuning job (``model.train_sft``)."""

    learning_rate: float | Annotated[list[float], Field(max_length=10_000)] | None = None
    batch_size: int | None = Field(default=None, ge=1, le=INT32_MAX)
    assistant_turns: Literal["all", "last"] | None = None
    num_epochs: int | None = Field(default=None, ge=1, le=100)
    max_grad_norm: float | None = Field(default=None, gt=0)
    seed: int | None = Field(default=None, ge=INT64_MIN, le=INT64_MAX)


@dataclass(frozen=True)
class TrainResult:
    """What a finished training job produced: the new step and its training metrics.

    ``metrics`` holds the mean of each per-gradient-step metric over the job, overlaid with the
    summary the job reported when it ended.
    """

    step: int
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Checkpoint:
    """One saved step of a trainable model (step 0 is the base model itself)."""

    id: str
    step: int
    metrics: dict[str, float]
    created_at: datetime | None

    @classmethod
    def _from_api(cls, item: _CheckpointAnswer) -> Checkpoint:
        created = item.get("created_at")
        return cls(
            id=str(item["id"]),
            step=int(item["step"]),
            metrics=dict(item.get("metrics") or {}),
            created_at=datetime.fromisoformat(created) if created else None,
        )

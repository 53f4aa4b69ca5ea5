"""The configuration of models and training jobs, and the names models go by."""

from __future__ import annotations

import math
import re
from collections.abc import Callable
from typing import Annotated, Any, ClassVar, Literal

from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
    model_validator,
)

from skytrain_backend.errors import InvalidRequest
from skytrain_backend.json_types import JSONObject
from skytrain_backend.protocol.trajectories import format_validation_error
from skytrain_backend.ranges import (
    INT32_MAX,
    MAX_STEP,
    NO_NUL_PATTERN,
    Seed,
    parse_step,
)

# --- configuration ----------------------------------------------------------------------------

DEFAULT_LORA_TARGET_MODULES = (
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
)


# Tokens in one sequence or packed row: far beyond any model's context.
MAX_SEQUENCE_LENGTH = 1024 * 1024
MAX_SFT_EPOCHS = 100
# Workers one model may be served by at most.
MAX_REPLICAS = 64
MAX_SFT_LEARNING_RATES = 10_000
ModuleName = Annotated[str, StringConstraints(min_length=1, max_length=128, pattern=NO_NUL_PATTERN)]


class ModelConfig(BaseModel):
    """Per-model settings fixed at registration: the LoRA adapter and sequence length."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    lora_rank: int = Field(default=8, ge=1, le=256)
    lora_alpha: int = Field(default=16, ge=1, le=INT32_MAX)
    lora_dropout: float = Field(default=0.0, ge=0.0, lt=1.0)
    lora_target_modules: list[ModuleName] = Field(
        default_factory=lambda: list(DEFAULT_LORA_TARGET_MODULES), min_length=1, max_length=64
    )
    max_seq_length: int = Field(default=4096, ge=16, le=MAX_SEQUENCE_LENGTH)
    # None: the worker decides (its memory plan; on with CUDA).
    gradient_checkpointing: bool | None = None
    # Workers serving the model at least / at most (``scheduler/replicas.py``): the scheduler
    # adds one while demand per replica stays high, and takes one away while it stays low.
    # Changeable after registration (PATCH /v1/models/{id}); capped by the tenant's max_workers.
    min_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)
    max_replicas: int = Field(default=1, ge=1, le=MAX_REPLICAS)

    @model_validator(mode="after")
    def _replicas_in_order(self) -> ModelConfig:
        if self.min_replicas > self.max_replicas:
            raise ValueError(
                f"min_replicas ({self.min_replicas}) is more than max_replicas "
                f"({self.max_replicas})"
            )
        return self


LossFn = Literal["ppo", "cispo"]
ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]
# How a step's per-token losses become its loss (see RLTrainConfig).
Aggregation = Literal["token_mean", "art"]
KLPenaltySource = Literal["current_learner", "sample"]
# num_gradient_steps="per_row": ART's rule, one optimizer step per packed row.
PER_ROW = "per_row"
# ART's rows, when packed_sequence_length is unset: the longest sequence rounded up to this.
ART_ROW_MULTIPLE = 2048

# ART's clip defaults per loss: PPO clips the ratio to [0.8, 1.2]; CISPO's importance weight is
# clipped to [0, 5] (epsilon 1.0, epsilon_high 4.0).
DEFAULT_EPSILON: dict[str, tuple[float, float | None]] = {"ppo": (0.2, None), "cispo": (1.0, 4.0)}

# preset="art": what ART's backends do where skytrain's defaults differ (openpipe-art 0.5.23:
# ServerlessBackend.train's loss, art/dev/get_model_config.py's trainer_args, the loss
# aggregation of art/preprocessing/pack.py and art/loss.py, one step per packed row).
ART_PRESET: dict[str, str | float] = {
    "loss_fn": "cispo",
    "aggregation": "art",
    "num_gradient_steps": PER_ROW,
    "adam_beta2": 0.99,
    "weight_decay": 0.1,
    "max_grad_norm": 0.1,
    "unsampled_old_logprobs": "current",
    "warmup_step": True,
}


class RLTrainConfig(BaseModel):
    """Options of one GRPO training job: skytrain's names, and ART's ``experimental_config``
    keys with ART's meaning (``from_experimental``).

    One job is ``num_gradient_steps`` optimizer steps over whole groups (one by default): the
    groups with a reward signal are shuffled (seeded by ``seed`` and the model's step) and
    split into that many near-equal parts, at most one group per step. How rows are packed
    never changes the number of steps or what each step trains on. ``"per_row"`` is ART's
    rule instead: the sequences are packed into rows of ``packed_sequence_length`` tokens
    (unset: the longest sequence rounded up to 2048, at most the model's ``max_seq_length``)
    and each row is one optimizer step.

    ``aggregation`` says how a step's per-token losses are reduced: ``"token_mean"`` (skytrain)
    sums them over the step's trained tokens and divides by their number; ``"art"`` does what
    ART does: each trajectory weighs the same (its tokens by 1 / its trained token count,
    normalized to mean 1 over the job), advantages are divided by the job's mean |advantage|,
    trajectories whose advantage is exactly 0 are left out, and a group is skipped only when
    every reward is within 1e-12 of the first (skytrain's rule is relative to the rewards'
    size: a spread below a millionth of it is float noise).

    ``kl_penalty_source`` unset keeps skytrain's KL penalty (``kl_penalty_coef`` times the k3
    estimate of KL(policy || base model) added to each token's loss); set, it is ART's:
    each token's advantage gains ``kl_penalty_coef * (mean KL - KL)``, its KL being log pi -
    log pi_base with pi the current policy (``current_learner``) or the sampler (``sample``).
    Either way the reference (pi_base) is the base model unless ``kl_penalty_reference_step``
    or ``kl_penalty_step_lag`` names one of the model's own checkpoints (``kl_reference_step``),
    which the worker fetches and the trainer loads beside the policy.

    ``preset="art"`` fills what is left unset with ART's settings (``ART_PRESET``): CISPO,
    ART's aggregation and steps, AdamW beta2 0.99, weight decay 0.1, max_grad_norm 0.1, and
    ART's KL shaping (from the sampler when ``kl_penalty_coef`` > 0). Jobs sent with ART's
    ``experimental_config`` get it.

    Every float must be finite: an infinite epsilon or max_grad_norm is not a setting.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    preset: Literal["art"] | None = None
    learning_rate: float = Field(default=5e-6, gt=0, le=1.0)
    loss_fn: LossFn = "ppo"
    # None: ART's default for the loss (DEFAULT_EPSILON); epsilon_high None under PPO: epsilon.
    epsilon: float | None = Field(default=None, gt=0, le=1e3)
    epsilon_high: float | None = Field(default=None, gt=0, le=1e3)
    importance_sampling_level: ImportanceSamplingLevel = "token"
    # ART: > 0 scales negative advantages by (1 - b), < 0 positive ones by (1 + b).
    advantage_balance: float = Field(default=0.0, ge=-1.0, le=1.0)
    # ART: the importance ratio is capped at this value (None or 0: no cap).
    max_negative_advantage_importance_sampling_weight: float | None = Field(
        default=None, ge=0, le=1e6
    )
    # ART: tokens whose ratio lies outside (1 - epsilon, 1 + epsilon_high) get ratio 0.
    mask_prob_ratio: bool = False
    # ART (Kimi K2): each token's advantage minus tau * log(pi / pi_old) (None or 0: off).
    kimi_k2_tau: float | None = Field(default=None, ge=0, le=1e3)
    # ART: old logprobs are the trainer's own, computed before the first step, not the
    # sampler's (missing sampling logprobs are computed that way in any case).
    precalculate_logprobs: bool = False
    # ART: with precalculate_logprobs, each token's loss times min(pi_old / pi_sampler, this)
    # (None: off; ART applies it only then, and so does skytrain).
    truncated_importance_sampling: float | None = Field(default=None, gt=0, le=1e3)
    kl_penalty_coef: float = Field(default=0.0, ge=0, le=1e3)
    kl_penalty_source: KLPenaltySource | None = None
    # ART: the KL penalty's reference policy is the model's own checkpoint at this step
    # (0: the base model, as when unset), or at the step this job makes minus this lag
    # (floored at 0). At most one of the two; see kl_reference_step.
    kl_penalty_reference_step: int | None = Field(default=None, ge=0, le=MAX_STEP)
    kl_penalty_step_lag: int | None = Field(default=None, ge=1, le=MAX_STEP)
    scale_rewards: bool = True
    # Groups sampled more than this many steps before the model's current step (their
    # choices' skytrain_step, or ART's initial_policy_version: sampled_step) are refused when
    # the job is queued (400; None: any lag is trained, the sampled logprobs being the old
    # policy). Checked again when the job starts, against the step it trains from: a job
    # queued behind others leaves out the groups now too old (groups/refused_off_policy),
    # and fails when none is left.
    max_off_policy_steps: int | None = Field(default=None, ge=0, le=MAX_STEP)
    allow_training_without_logprobs: bool = False
    # Tokens the sampler gave no logprob for (allow_training_without_logprobs): their old
    # policy is the policy at the job's start ("job_start"), or each step's own, so their
    # ratio is exactly 1 on every step ("current", ART's rule).
    unsampled_old_logprobs: Literal["job_start", "current"] = "job_start"
    # ART's warm-up: a trainer with a fresh optimizer (a model's first job) first steps once
    # at learning rate 1e-9 on the first row cut to 1,024 positions, which seeds AdamW's
    # moments (with num_gradient_steps="per_row" only, as ART's rows say what it reads).
    warmup_step: bool = False
    aggregation: Aggregation = "token_mean"
    logprob_calculation_chunk_size: int = Field(default=1024, ge=1, le=MAX_SEQUENCE_LENGTH)
    packed_sequence_length: int | None = Field(default=None, ge=16, le=MAX_SEQUENCE_LENGTH)
    num_gradient_steps: Annotated[int, Field(ge=1, le=10_000)] | Literal["per_row"] = 1
    # ART: each step's learning rate times (the step's trajectories) ** this power.
    num_trajectories_learning_rate_multiplier_power: float = Field(default=0.0, ge=-4.0, le=4.0)
    adam_beta2: float = Field(default=0.999, ge=0.0, lt=1.0)
    max_grad_norm: float = Field(default=1.0, gt=0, le=1e6)
    weight_decay: float = Field(default=0.0, ge=0, le=1e3)
    seed: Seed = 0

    # ART keys that skytrain accepts and has no use for: they change no result in ART 0.5.23's
    # own backends either (plot_tensors draws the packed tensors; ART reads
    # scale_learning_rate_by_reward_std_dev nowhere).
    IGNORED_KEYS: ClassVar[frozenset[str]] = frozenset(
        {"plot_tensors", "scale_learning_rate_by_reward_std_dev"}
    )
    # ART's key for a reference adapter by path: the control plane takes it only as a
    # checkpoint of the job's own model and turns it into kl_penalty_reference_step.
    REFERENCE_PATH_KEY: ClassVar[str] = "kl_ref_adapter_path"

    @model_validator(mode="after")
    def _one_reference(self) -> RLTrainConfig:
        if self.kl_penalty_reference_step is not None and self.kl_penalty_step_lag is not None:
            raise ValueError(
                "only one of kl_penalty_reference_step and kl_penalty_step_lag may be set"
            )
        return self

    def kl_reference_step(self, base_step: int) -> int:
        """The step of the KL reference for a job that trains from ``base_step``: the
        config's ``kl_penalty_reference_step``, else ``base_step + 1 - kl_penalty_step_lag``
        (ART's lag counts from the step the job makes) floored at 0, else 0. Step 0 is the
        base model: a fresh adapter computes exactly it."""
        if self.kl_penalty_reference_step is not None:
            return self.kl_penalty_reference_step
        if self.kl_penalty_step_lag is not None:
            return max(base_step + 1 - self.kl_penalty_step_lag, 0)
        return 0

    @model_validator(mode="before")
    @classmethod
    def _replaced_keys(cls, data: Any) -> Any:
        # Jobs queued before the step rule changed stored this key as null.
        if isinstance(data, dict) and "grad_accumulation_sequences" in data:
            data = dict(data)
            if data.pop("grad_accumulation_sequences") is not None:
                raise ValueError(
                    "grad_accumulation_sequences is gone: a job's optimizer steps no longer "
                    "depend on packing; set num_gradient_steps (steps over whole groups) instead"
                )
        return data

    @model_validator(mode="before")
    @classmethod
    def _apply_preset(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("preset") != "art":
            return data
        filled = {key: value for key, value in ART_PRESET.items() if data.get(key) is None}
        if data.get("kl_penalty_source") is None:
            # ServerlessBackend.train's choice when the caller names none.
            coef = data.get("kl_penalty_coef") or 0.0
            positive = isinstance(coef, int | float) and coef > 0
            filled["kl_penalty_source"] = "sample" if positive else "current_learner"
        return data | filled

    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with ART's defaults for the loss filled in."""
        default_low, default_high = DEFAULT_EPSILON[self.loss_fn]
        epsilon = default_low if self.epsilon is None else self.epsilon
        epsilon_high = self.epsilon_high
        if epsilon_high is None:
            epsilon_high = epsilon if default_high is None else default_high
        return epsilon, epsilon_high

    @classmethod
    def from_experimental(
        cls,
        raw: JSONObject | None,
        *,
        checkpoint_step: Callable[[str], int] | None = None,
    ) -> RLTrainConfig:
        """Build from ART's ``experimental_config`` with ART's settings where it says nothing
        (``preset="art"``): null means ART's default, ``ppo`` picks the loss (false: CISPO)
        unless ``loss_fn`` does (they must agree), ``normalize_advantages=false`` turns
        ``scale_rewards`` off; unknown keys are refused naming the known ones.

        ``kl_ref_adapter_path`` goes through ``checkpoint_step`` (the control plane's lookup
        of a checkpoint of the job's model: its step, or InvalidRequest) into
        ``kl_penalty_reference_step``; without one it is refused."""
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
        if cls.REFERENCE_PATH_KEY in raw:
            path = raw.pop(cls.REFERENCE_PATH_KEY)
            if checkpoint_step is None:
                raise InvalidRequest(
                    f"experimental_config.{cls.REFERENCE_PATH_KEY} is not taken here: name the "
                    "reference with kl_penalty_reference_step"
                )
            if "kl_penalty_reference_step" in raw or "kl_penalty_step_lag" in raw:
                raise InvalidRequest(
                    f"experimental_config has {cls.REFERENCE_PATH_KEY} and "
                    "kl_penalty_reference_step or kl_penalty_step_lag: send one of them"
                )
            if not isinstance(path, str):
                raise InvalidRequest(
                    f"experimental_config.{cls.REFERENCE_PATH_KEY} must be a checkpoint id"
                )
            raw["kl_penalty_reference_step"] = checkpoint_step(path)
        if "ppo" in raw:
            ppo = raw.pop("ppo")
            if not isinstance(ppo, bool):
                raise InvalidRequest(f"experimental_config.ppo must be true or false, not {ppo!r}")
            loss_fn = "ppo" if ppo else "cispo"
            if raw.setdefault("loss_fn", loss_fn) != loss_fn:
                raise InvalidRequest(
                    f"experimental_config has ppo={ppo} and loss_fn={raw['loss_fn']!r}, which "
                    "disagree: send one of them"
                )
        if "normalize_advantages" in raw:
            raw["scale_rewards"] = bool(raw.pop("normalize_advantages")) and bool(
                raw.get("scale_rewards", True)
            )
        for key in cls.IGNORED_KEYS:
            raw.pop(key, None)
        known = (
            set(cls.model_fields)
            | {"ppo", "normalize_advantages", cls.REFERENCE_PATH_KEY}
            | cls.IGNORED_KEYS
        ) - {"preset"}
        unknown = sorted(set(raw) - known)
        if unknown:
            raise InvalidRequest(
                f"experimental_config has unsupported keys {unknown}; skytrain supports: "
                + ", ".join(sorted(known))
            )
        try:
            return cls.model_validate(raw | {"preset": "art"})
        except ValidationError as exc:
            raise InvalidRequest(format_validation_error(exc, root="experimental_config")) from exc


class SFTTrainConfig(BaseModel):
    """Options of one supervised fine-tuning job.

    ``learning_rate`` is one number or one per optimizer step (at most
    ``MAX_SFT_LEARNING_RATES``); ``num_epochs`` is at most ``MAX_SFT_EPOCHS``.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float | Annotated[list[float], Field(max_length=MAX_SFT_LEARNING_RATES)] = 2e-5
    batch_size: int | None = Field(default=None, ge=1, le=INT32_MAX)
    assistant_turns: Literal["all", "last"] = "all"
    num_epochs: int = Field(default=1, ge=1, le=MAX_SFT_EPOCHS)
    max_grad_norm: float = Field(default=1.0, gt=0)
    seed: Seed = 0

    @field_validator("learning_rate")
    @classmethod
    def _positive(cls, value: float | list[float]) -> float | list[float]:
        values = value if isinstance(value, list) else [value]
        if not values or any(not (v > 0 and math.isfinite(v)) for v in values):
            raise ValueError("learning_rate must be a positive number or a non-empty list of them")
        return value


def lora_name(model_id: str, step: int) -> str:
    """The name a model's checkpoint is served under in a worker's engine."""
    return f"{model_id}@{step}"


# Who asked, on every request the gateway sends to an engine: the CPU engine takes turns
# between tenants by it (vLLM ignores it).
TENANT_HEADER = "X-Skytrain-Tenant"


# --- model references -------------------------------------------------------------------------

ARTIFACT_PREFIX = "wandb-artifact:///"
_REF_RE = re.compile(
    r"^(?P<entity>[^/:]+)/(?P<project>[^/:]+)/(?P<name>[^/:]+)(?::step(?P<step>[0-9]+))?$"
)


class ModelRef(BaseModel):
    """``<entity>/<project>/<name>`` with an optional ``:step<N>`` pin."""

    entity: str
    project: str
    name: str
    step: int | None = None

    @classmethod
    def parse(cls, value: str) -> ModelRef:
        text = value.removeprefix(ARTIFACT_PREFIX).removesuffix(":latest")
        match = _REF_RE.match(text)
        if match is None:
            raise InvalidRequest(
                f"model {value!r} is not a skytrain model name: use "
                "'<entity>/<project>/<name>' or '<entity>/<project>/<name>:step<N>'"
            )
        step = match.group("step")
        return cls(
            entity=match.group("entity"),
            project=match.group("project"),
            name=match.group("name"),
            step=parse_step(step, where="the model's :step<N>") if step is not None else None,
        )

    def __str__(self) -> str:
        base = f"{self.entity}/{self.project}/{self.name}"
        return base if self.step is None else f"{base}:step{self.step}"

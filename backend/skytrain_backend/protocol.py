"""The wire types shared by the control plane, the worker and the trainer.

Trajectory groups arrive as ART's client sends them (``TrajectoryGroup.model_dump(mode="json")``):
``messages_and_choices`` mixes chat message dicts (context the agent wrote or received) with
OpenAI ``Choice`` objects (turns sampled from a skytrain endpoint, with the logprobs and token
ids of the sampled tokens). Unknown fields are ignored so newer clients keep working; what is
known is validated strictly, and every error names the group and trajectory it is about.

This module imports neither torch nor the database: the API validates with it, the trainer
parses its input with it.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, Literal, NamedTuple, NotRequired

from pydantic import (
    BaseModel,
    ConfigDict,
    Discriminator,
    Field,
    StringConstraints,
    Tag,
    ValidationError,
    field_validator,
    model_validator,
)
from typing_extensions import TypedDict

from skytrain_backend.errors import InvalidRequest
from skytrain_backend.ranges import (
    INT32_MAX,
    NO_NUL_PATTERN,
    MetricValue,
    Seed,
    parse_step,
)

TOKEN_ID_PREFIX = "token_id:"
# A token id has at most 20 digits (ids are 64-bit): longer digit strings are not ids, and
# would cost int() quadratic time (or a ValueError past Python's 4,300-digit limit).
MAX_TOKEN_ID_DIGITS = 20
_TOKEN_ID_RE = re.compile(rf"^token_id:(\d{{1,{MAX_TOKEN_ID_DIGITS}}})$")
# Tokens joined by commas, each ``token_id:<id>``.
_JOINED_IDS_RE = re.compile(
    rf"token_id:\d{{1,{MAX_TOKEN_ID_DIGITS}}}(?:,token_id:\d{{1,{MAX_TOKEN_ID_DIGITS}}})*"
)

EventType = Literal[
    "training_started", "gradient_step", "job_timeline", "training_ended", "training_failed"
]
# "tinker": a Tinker training run's lease on its model (see scheduler.tinker).
JobKind = Literal["rl", "sft", "tinker"]
JobStatus = Literal["queued", "running", "succeeded", "failed", "cancelled"]
TERMINAL_JOB_STATUSES: frozenset[str] = frozenset({"succeeded", "failed", "cancelled"})


class _Lenient(BaseModel):
    """Ignores fields it does not know; newer clients may send more."""

    model_config = ConfigDict(extra="ignore")


# --- messages and choices ---------------------------------------------------------------------


class FunctionCall(_Lenient):
    name: str = Field(min_length=1)
    arguments: str = "{}"


class ToolCall(_Lenient):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class Message(_Lenient):
    """A chat message given as a plain dict: context, not trained on by default."""

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_shape(self) -> Message:
        problem = message_shape_problem(
            self.role, self.content, self.tool_calls, tool_call_id=self.tool_call_id
        )
        if problem is not None:
            raise ValueError(problem)
        return self

    def text(self) -> str:
        """The content as plain text (text parts of a multi-part content joined)."""
        if self.content is None:
            return ""
        if isinstance(self.content, str):
            return self.content
        return "".join(str(part.get("text", "")) for part in self.content)


# Token logprobs are TypedDicts, not models: a batch holds one per sampled token (hundreds of
# thousands per request), and validating them into plain dicts is several times faster than
# building a model object for each. Unknown keys are ignored, as on the models.
class TopLogprob(TypedDict):
    token: str
    logprob: float
    bytes: NotRequired[list[int] | None]


class TokenLogprob(TypedDict):
    token: str
    logprob: float
    bytes: NotRequired[list[int] | None]
    top_logprobs: NotRequired[list[TopLogprob]]


class ChoiceLogprobs(_Lenient):
    content: list[TokenLogprob] | None = None


class Choice(_Lenient):
    """An assistant turn sampled from a skytrain endpoint (an OpenAI ``Choice``).

    Besides the sampled tokens' ids and logprobs (``logprobs.content``, vLLM's
    ``return_tokens_as_token_ids``), a choice from skytrain carries vLLM's
    ``return_token_ids`` fields: ``prompt_token_ids``, the exact prompt the engine sampled
    after (the gateway copies it from the response onto every choice, where ART reads it too),
    and ``token_ids``, the sampled ids. The trainer trains each turn on exactly these.
    """

    index: int = 0
    finish_reason: str | None = None
    message: Message
    logprobs: ChoiceLogprobs | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = None

    @field_validator("message")
    @classmethod
    def _assistant_only(cls, message: Message) -> Message:
        if message.role != "assistant":
            raise ValueError("a choice's message must have role 'assistant'")
        return message

    @field_validator("prompt_token_ids")
    @classmethod
    def _non_empty_prompt(cls, ids: list[int] | None) -> list[int] | None:
        if ids is not None and not ids:
            raise ValueError("prompt_token_ids is empty: leave it out or send the prompt's ids")
        return ids

    def logprob_token_ids(self) -> list[int] | None:
        content = self.logprobs.content if self.logprobs else None
        if not content:
            return None
        digits = token_id_digits([entry["token"] for entry in content])
        return None if digits is None else list(map(int, digits))

    def sampled_token_ids(self) -> list[int] | None:
        """Ids of the sampled tokens: from ``logprobs`` (every token ``token_id:<id>``), else
        ``token_ids``; None when neither says them."""
        ids = self.logprob_token_ids()
        return ids if ids is not None else self.token_ids or None

    def sampled_logprobs(self) -> list[float] | None:
        """The engine's logprob of each sampled token, when ``logprobs`` has them all."""
        if self.logprob_token_ids() is None:
            return None
        assert self.logprobs is not None and self.logprobs.content is not None
        return [entry["logprob"] for entry in self.logprobs.content]


def message_shape_problem(
    role: str, content: object, tool_calls: list[Any] | None, *, tool_call_id: str | None
) -> str | None:
    """What a message of ``role`` lacks, or None: the rule for pydantic's ``Message`` and the
    ingest's msgspec mirror of it (``api.trajectory_structs``)."""
    if role == "assistant":
        if content is None and not tool_calls:
            return "an assistant message needs content or tool_calls"
    elif content is None:
        return f"a {role} message needs content"
    if role == "tool" and not tool_call_id:
        return "a tool message needs tool_call_id"
    return None


def token_id_digits(tokens: Sequence[str]) -> list[str] | None:
    """The ids (as digits) of sampled tokens written ``token_id:<id>``; None unless every
    token is one."""
    # All at once (a batch holds hundreds of thousands of tokens): if no token holds a comma,
    # the tokens joined by commas split at ",token_id:" into one part per token exactly when
    # each starts with the prefix.
    joined = "," + ",".join(tokens)
    if joined.count(",") == len(tokens):
        digits = joined.split("," + TOKEN_ID_PREFIX)[1:]
        if (
            len(digits) == len(tokens)
            and all(digits)
            and max(map(len, digits)) <= MAX_TOKEN_ID_DIGITS
            and "".join(digits).isdecimal()
        ):
            return digits
    found = []
    for token in tokens:  # one at a time: the pattern also takes a final newline
        match = _TOKEN_ID_RE.match(token)
        if match is None:
            return None
        found.append(match.group(1))
    return found


def names_token_ids(tokens: Sequence[str]) -> bool:
    """Whether ``token_id_digits(tokens)`` finds ids, without making them: the tokens joined
    by commas (when none holds one) matched by one pattern, each ``\\d`` a decimal digit as
    ``isdecimal`` takes it. Anything else is left to ``token_id_digits``."""
    joined = ",".join(tokens)
    if tokens and joined.count(",") == len(tokens) - 1 and _JOINED_IDS_RE.fullmatch(joined):
        return True
    return token_id_digits(tokens) is not None


def _message_or_choice(value: Any) -> str:
    if isinstance(value, dict):
        return "choice" if "message" in value and "role" not in value else "message"
    return "choice" if isinstance(value, Choice) else "message"


MessageOrChoice = Annotated[
    Annotated[Message, Tag("message")] | Annotated[Choice, Tag("choice")],
    Discriminator(_message_or_choice),
]


# --- trajectories -----------------------------------------------------------------------------


# Metric names become keys of JSON columns (and of checkpoint metrics): no NUL.
MetricName = Annotated[str, StringConstraints(max_length=256, pattern=NO_NUL_PATTERN)]
Metrics = dict[MetricName, MetricValue]


class History(_Lenient):
    """Another conversation of the same rollout (e.g. a sub-agent's), trained with its reward."""

    messages_and_choices: list[MessageOrChoice] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None


class Trajectory(_Lenient):
    messages_and_choices: list[MessageOrChoice] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: float = Field(allow_inf_nan=False)
    metrics: Metrics = Field(default_factory=dict)
    metadata: dict[str, Any] = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)

    def histories(self) -> list[History]:
        """The main conversation followed by the additional ones."""
        return [
            # Built from validated fields: validating them again would cost as much as the
            # trajectory did.
            History.model_construct(
                messages_and_choices=self.messages_and_choices, tools=self.tools
            ),
            *self.additional_histories,
        ]


class TrajectoryGroup(_Lenient):
    """Rollouts of one scenario: advantages are computed within a group."""

    trajectories: list[Trajectory] = Field(min_length=1)
    exceptions: list[dict[str, Any]] = Field(default_factory=list)
    metadata: dict[str, Any] = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)


def format_validation_error(error: ValidationError, *, root: str = "") -> str:
    """One line per problem, each with the path to the offending field.

    Paths read ``trajectory_groups[0].trajectories[3].reward`` so a user finds the group and
    trajectory at once.
    """
    lines = []
    for item in error.errors(include_url=False):
        path = root
        for part in item["loc"]:
            if isinstance(part, int):
                path += f"[{part}]"
            elif part in ("message", "choice") and path.endswith("]"):
                continue  # the discriminator's tag, not a field the user wrote
            else:
                path += f".{part}" if path else str(part)
        lines.append(f"{path or 'body'}: {item['msg']}")
    return "; ".join(lines)


def parse_trajectory_groups(raw: Any) -> list[TrajectoryGroup]:
    """Validate ``trajectory_groups`` as sent by a client; InvalidRequest names each problem."""
    if not isinstance(raw, list):
        raise InvalidRequest("trajectory_groups must be a list of trajectory groups")
    if not raw:
        raise InvalidRequest("trajectory_groups is empty: send at least one group")
    groups = []
    for index, item in enumerate(raw):
        try:
            groups.append(TrajectoryGroup.model_validate(item))
        except ValidationError as exc:
            raise InvalidRequest(
                format_validation_error(exc, root=f"trajectory_groups[{index}]")
            ) from exc
    return groups


def check_trainable(
    groups: list[TrajectoryGroup], *, allow_training_without_logprobs: bool = False
) -> None:
    """Refuse groups the RL trainer could not learn from, naming the trajectory at fault."""
    check_trainable_turns(
        sum(
            count_trainable_turns(
                group, g, allow_training_without_logprobs=allow_training_without_logprobs
            )
            for g, group in enumerate(groups)
        )
    )


class SampledTurn(NamedTuple):
    """What the trainability rule reads of a sampled choice (``check_sampled_choice``)."""

    listed_ids: list[int] | None
    token_ids: list[int] | None
    logprobs: list[float] | None


def sampled_turn(
    item: Message | Choice, allow_training_without_logprobs: bool
) -> SampledTurn | None:
    """A model's turn as the trainability rule reads it; None for a message. The logprobs are
    read only when training needs them."""
    if isinstance(item, Message):
        return None
    return SampledTurn(
        listed_ids=item.logprob_token_ids(),
        token_ids=item.token_ids,
        logprobs=None if allow_training_without_logprobs else item.sampled_logprobs(),
    )


def count_trainable_turns(
    group: Any,
    g: int,
    *,
    allow_training_without_logprobs: bool = False,
    sampled: Callable[[Any, bool], SampledTurn | None] = sampled_turn,
) -> int:
    """The turns of group ``g`` the RL trainer can learn from; refuses a choice it cannot.

    ``group`` is a ``TrajectoryGroup``, or anything shaped like one (the ingest's msgspec
    mirror) with ``sampled`` reading its turns as ``sampled_turn`` reads the models'."""
    trainable_turns = 0
    allow = allow_training_without_logprobs
    for t, trajectory in enumerate(group.trajectories):
        for h, history in enumerate(trajectory.histories()):
            for m, item in enumerate(history.messages_and_choices):
                choice = sampled(item, allow)
                if choice is None:
                    trainable_turns += item.role == "assistant" and allow
                    continue
                trainable_turns += 1
                check_sampled_choice(
                    choice_location(g, t, h, m),
                    listed_ids=choice.listed_ids,
                    token_ids=choice.token_ids,
                    logprobs=choice.logprobs,
                    allow_training_without_logprobs=allow,
                )
    return trainable_turns


def choice_location(g: int, t: int, h: int, m: int) -> str:
    """How errors name the choice at ``messages_and_choices[m]`` of history ``h`` (0: the
    trajectory's own conversation) of trajectory ``t`` of group ``g``."""
    where = f"trajectory {t} of group {g}" + (f" (additional history {h - 1})" if h else "")
    return f"{where}: the choice at messages_and_choices[{m}]"


def check_sampled_choice(
    choice: str,
    *,
    listed_ids: list[int] | None,
    token_ids: list[int] | None,
    logprobs: list[float] | None,
    allow_training_without_logprobs: bool,
) -> None:
    """Refuse a sampled turn the RL trainer cannot learn from. ``listed_ids``: the ids its
    logprobs name (None unless every token is ``token_id:<id>``); ``logprobs``: their values
    (None likewise; not read when training without logprobs is allowed), checked only to be
    finite: the ingest's msgspec reader, whose floats are all finite, passes an empty list
    (a rule on the values themselves would need it to pass them)."""
    if listed_ids is not None and token_ids and listed_ids != token_ids:
        raise InvalidRequest(
            f"{choice} has token_ids that differ from the ids in its logprobs: "
            "send the choice as the model's endpoint returned it"
        )
    if allow_training_without_logprobs:
        return
    if logprobs is None:
        raise InvalidRequest(
            f"{choice} has no logprobs with token ids: sample it through the "
            "model's skytrain endpoint (which returns them) or pass "
            "allow_training_without_logprobs=True"
        )
    # A finite sum is the quick proof that every value is finite.
    if not math.isfinite(sum(logprobs)) and not all(math.isfinite(value) for value in logprobs):
        raise InvalidRequest(
            f"{choice} has NaN or infinite logprobs: resample it, or pass "
            "allow_training_without_logprobs=True to recompute them"
        )


def check_trainable_turns(trainable_turns: int) -> None:
    """Refuse a batch with no turn to train on."""
    if trainable_turns == 0:
        raise InvalidRequest(
            "no trajectory has a sampled assistant turn to train on: include the Choice objects "
            "returned by the model's endpoint in messages_and_choices, or pass "
            "allow_training_without_logprobs=True to train on plain assistant messages"
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
    gradient_checkpointing: bool = False


LossFn = Literal["ppo", "cispo"]
ImportanceSamplingLevel = Literal["token", "sequence", "average", "geometric_average"]

# ART's clip defaults per loss: PPO clips the ratio to [0.8, 1.2]; CISPO's importance weight is
# clipped to [0, 5] (epsilon 1.0, epsilon_high 4.0).
DEFAULT_EPSILON: dict[str, tuple[float, float | None]] = {"ppo": (0.2, None), "cispo": (1.0, 4.0)}


class RLTrainConfig(BaseModel):
    """Options of one GRPO training job: skytrain's names, and ART's ``experimental_config``
    keys with ART's meaning (``from_experimental``).

    One job is ``num_gradient_steps`` optimizer steps over whole groups (one by default): the
    groups with a reward signal are shuffled (seeded by ``seed`` and the model's step) and
    split into that many near-equal parts, at most one group per step. How rows are packed
    never changes the number of steps or what each step trains on.

    Every float must be finite: an infinite epsilon or max_grad_norm is not a setting.
    """

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    learning_rate: float = Field(default=5e-6, gt=0, allow_inf_nan=False)
    loss_fn: LossFn = "ppo"
    # None: ART's default for the loss (DEFAULT_EPSILON); epsilon_high None under PPO: epsilon.
    epsilon: float | None = Field(default=None, gt=0)
    epsilon_high: float | None = Field(default=None, gt=0)
    importance_sampling_level: ImportanceSamplingLevel = "token"
    # ART: > 0 scales negative advantages by (1 - b), < 0 positive ones by (1 + b).
    advantage_balance: float = Field(default=0.0, ge=-1.0, le=1.0, allow_inf_nan=False)
    # ART: the importance ratio is capped at this value (None or 0: no cap).
    max_negative_advantage_importance_sampling_weight: float | None = Field(
        default=None, ge=0, le=1e6, allow_inf_nan=False
    )
    # ART: tokens whose ratio lies outside (1 - epsilon, 1 + epsilon_high) get ratio 0.
    mask_prob_ratio: bool = False
    # ART (Kimi K2): each token's advantage minus tau * log(pi / pi_old) (None or 0: off).
    kimi_k2_tau: float | None = Field(default=None, ge=0, le=1e3, allow_inf_nan=False)
    # ART: old logprobs are the trainer's own, computed before the first step, not the
    # sampler's (missing sampling logprobs are computed that way in any case).
    precalculate_logprobs: bool = False
    kl_penalty_coef: float = Field(default=0.0, ge=0)
    scale_rewards: bool = True
    allow_training_without_logprobs: bool = False
    logprob_calculation_chunk_size: int = Field(default=1024, ge=1, le=MAX_SEQUENCE_LENGTH)
    packed_sequence_length: int | None = Field(default=None, ge=16, le=MAX_SEQUENCE_LENGTH)
    num_gradient_steps: int = Field(default=1, ge=1, le=10_000)
    max_grad_norm: float = Field(default=1.0, gt=0)
    weight_decay: float = Field(default=0.0, ge=0)
    seed: Seed = 0

    # ART keys that skytrain accepts and has no use for (they change no result).
    IGNORED_KEYS: ClassVar[frozenset[str]] = frozenset({"plot_tensors"})

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

    def clip_range(self) -> tuple[float, float]:
        """(epsilon, epsilon_high) with ART's defaults for the loss filled in."""
        default_low, default_high = DEFAULT_EPSILON[self.loss_fn]
        epsilon = default_low if self.epsilon is None else self.epsilon
        epsilon_high = self.epsilon_high
        if epsilon_high is None:
            epsilon_high = epsilon if default_high is None else default_high
        return epsilon, epsilon_high

    @classmethod
    def from_experimental(cls, raw: dict[str, Any] | None) -> RLTrainConfig:
        """Build from ART's ``experimental_config``: null means ART's default, ``ppo`` picks
        the loss (false: CISPO), unknown keys are refused naming the known ones."""
        raw = {k: v for k, v in (raw or {}).items() if v is not None}
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
        known = set(cls.model_fields) | {"ppo", "normalize_advantages"} | cls.IGNORED_KEYS
        unknown = sorted(set(raw) - set(cls.model_fields))
        if unknown:
            raise InvalidRequest(
                f"experimental_config has unsupported keys {unknown}; skytrain supports: "
                + ", ".join(sorted(known))
            )
        try:
            return cls.model_validate(raw)
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


# --- the worker protocol (``/v1/worker/...``) ---------------------------------------------------
#
# What workers and the control plane say to each other: the routes declare these as their
# bodies and ``response_model``, and the worker's client validates every answer with them, so a
# worker and a control plane of different versions fail loudly at the first call.

WorkerStatus = Literal["starting", "ready", "training", "sleeping", "draining"]
# Events a worker reports during a job; the control plane writes the end events itself.
WorkerEventType = Literal["training_started", "gradient_step", "job_timeline"]
# The largest PEM certificate a worker may register (a self-signed EC certificate is ~700 B).
MAX_CERTIFICATE_CHARS = 16_384


class WorkerCapacity(BaseModel):
    max_models: int = Field(ge=1, le=10_000)
    # The largest LoRA rank the worker's engine loads (vLLM's --max-lora-rank); None: any.
    max_lora_rank: int | None = Field(default=None, ge=1)


class WorkerRegistration(BaseModel):
    """``POST /register``: who the worker is and where its front door is."""

    base_model: str = Field(min_length=1, max_length=512)
    served_model_name: str = Field(min_length=1, max_length=512)
    engine_secret: str = Field(min_length=16, max_length=128)
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


class Heartbeat(BaseModel):
    status: WorkerStatus
    served: list[ServedCheckpoint] = Field(default_factory=list, max_length=10_000)
    job_id: str | None = Field(default=None, max_length=64)


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


class LeasedJob(BaseModel):
    """What a worker needs to run the job it leased."""

    id: str
    kind: JobKind
    model_id: str
    base_model: str
    config: dict[str, Any] | None = None
    model_config_: ModelConfig = Field(alias="model_config")
    base_step: int = Field(ge=0)
    # The step the job commits: base_step + 1, or higher when newer steps were deleted (a
    # deleted step's number is never given again).
    step: int = Field(ge=1)
    attempt: int = Field(ge=1)

    model_config = ConfigDict(populate_by_name=True, serialize_by_alias=True)


class JobLease(BaseModel):
    job: LeasedJob


class JobAttempt(BaseModel):
    """The attempt of the job the worker holds; a stale attempt is answered 409."""

    attempt: int = Field(ge=1)


class LeaseRenewed(BaseModel):
    cancel_requested: bool


class JobEventReport(JobAttempt):
    type: WorkerEventType
    data: dict[str, Any] = Field(default_factory=dict)


class CheckpointFile(BaseModel):
    name: str = Field(min_length=1, max_length=255)
    size: int = Field(ge=0)


class JobCompletion(JobAttempt):
    step: int = Field(ge=1)
    metrics: dict[str, float] = Field(default_factory=dict)
    files: list[CheckpointFile] = Field(min_length=1, max_length=64)


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

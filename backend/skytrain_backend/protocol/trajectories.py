"""Trajectory groups as ART's client sends them, and the checks on them.

Groups arrive as ``TrajectoryGroup.model_dump(mode="json")``: ``messages_and_choices`` mixes
chat message dicts (context the agent wrote or received) with OpenAI ``Choice`` objects (turns
sampled from a skytrain endpoint, with the logprobs and token ids of the sampled tokens).
Unknown fields are ignored so newer clients keep working; what is known is validated strictly,
and every error names the group and trajectory it is about.
"""

from __future__ import annotations

import math
import re
from collections.abc import Callable, Sequence
from typing import Annotated, Any, Literal, NamedTuple, NotRequired, TypeVar

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

from skytrain_backend.errors import InvalidRequest, TrainingError
from skytrain_backend.json_types import JSONObject
from skytrain_backend.ranges import (
    MAX_STEP,
    NO_NUL_PATTERN,
    MetricValue,
    Reward,
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
    content: str | list[JSONObject] | None = None
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
    ``skytrain_step`` is the step of the model that sampled it (the gateway writes it on
    every choice, as ``X-Skytrain-Step`` says it of the answer): a group sampled from an older
    step than the one a job trains from is off-policy by that many steps.
    """

    index: int = 0
    finish_reason: str | None = None
    message: Message
    logprobs: ChoiceLogprobs | None = None
    prompt_token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    token_ids: list[Annotated[int, Field(ge=0)]] | None = None
    skytrain_step: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None

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
    """What a message of ``role`` lacks, or None: ``Message``'s rule (which the ingest's
    msgspec Structs, derived from the models, run as well)."""
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
    tools: list[JSONObject] | None = None


class Trajectory(_Lenient):
    """One scored rollout. ``initial_policy_version`` is ART's: the model's step when the
    rollout began (ART's ``PipelineTrainer`` writes it), counted as the step that sampled it
    when its choices do not say theirs (``sampled_step``)."""

    messages_and_choices: list[MessageOrChoice] = Field(min_length=1)
    tools: list[JSONObject] | None = None
    additional_histories: list[History] = Field(default_factory=list)
    reward: Reward
    initial_policy_version: Annotated[int, Field(ge=0, le=MAX_STEP)] | None = None
    metrics: Metrics = Field(default_factory=dict)
    metadata: JSONObject = Field(default_factory=dict)
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
    metadata: JSONObject = Field(default_factory=dict)
    metrics: Metrics = Field(default_factory=dict)
    logs: list[str] = Field(default_factory=list)


def sampled_step(group: Any) -> int | None:
    """The oldest step that sampled a turn of ``group`` (a ``TrajectoryGroup``, or the
    ingest's Struct of one): its choices' ``skytrain_step`` (the gateway's word) and its
    trajectories' ``initial_policy_version`` (ART's: the step when the rollout began); None
    when neither says. A group is as far off-policy as its oldest turn."""
    steps = [
        item.skytrain_step
        for trajectory in group.trajectories
        for history in (trajectory, *trajectory.additional_histories)
        for item in history.messages_and_choices
        if isinstance(getattr(item, "skytrain_step", None), int)
    ]
    steps += [
        trajectory.initial_policy_version
        for trajectory in group.trajectories
        if isinstance(trajectory.initial_policy_version, int)
    ]
    return min(steps) if steps else None


G = TypeVar("G")


def within_off_policy(
    groups: Sequence[G], *, base_step: int, limit: int | None
) -> tuple[list[G], list[int]]:
    """The groups sampled at most ``limit`` steps before ``base_step`` (all of them when
    ``limit`` is None, and those that say no step), and the steps of the others.
    TrainingError when there were groups and none is left: the job has nothing to train on."""
    kept, refused = [], []
    for group in groups:
        step = sampled_step(group)
        if limit is not None and step is not None and base_step - step > limit:
            refused.append(step)
        else:
            kept.append(group)
    if refused and not kept:
        raise TrainingError(
            f"every one of the {len(refused)} groups was sampled more than "
            f"max_off_policy_steps={limit} steps before step {base_step}, the step this job "
            f"trains from (the newest from step {max(refused)}): the model moved on while the "
            "job waited. Sample the groups again from the current step, or raise "
            "max_off_policy_steps"
        )
    return kept, refused


def off_policy_steps(groups: Sequence[Any], *, base_step: int) -> dict[str, float]:
    """How many steps behind ``base_step`` (the step a job trains from) its groups were
    sampled: ``off_policy_steps/mean`` and ``/max`` over the groups that say their step
    (``sampled_step``), and ``groups/off_policy``, how many were behind. Empty when no group
    says."""
    behind = [max(base_step - step, 0) for step in map(sampled_step, groups) if step is not None]
    if not behind:
        return {}
    return {
        "off_policy_steps/mean": sum(behind) / len(behind),
        "off_policy_steps/max": float(max(behind)),
        "groups/off_policy": float(sum(1 for lag in behind if lag > 0)),
    }


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
    Structs) with ``sampled`` reading its turns as ``sampled_turn`` reads the models'."""
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

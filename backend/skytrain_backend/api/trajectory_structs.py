"""msgspec mirrors of ``protocol``'s trajectory models: how the API reads a batch quickly.

The pydantic models in ``protocol`` (``TrajectoryGroup``, ``Trajectory``...) define what a
trajectory is: the OpenAPI document shows them, the worker reads stored batches with them, and
their error messages are what a client sees. Validating hundreds of thousands of small objects
with them is slow, so ``api.ingest`` first decodes each group (or SFT trajectory) into these
Structs, in msgspec's C decoder, and checks it with the functions below; only an item msgspec
refuses is validated again by pydantic, which either names the problem as it always has, or
accepts it (pydantic is laxer: ``"1.5"`` for a float).

The rule is one-sided, and ``tests/api/test_trajectory_structs.py`` holds the two to it:
whatever these Structs accept, pydantic accepts too, as the same values, and
``msgspec.json.encode`` of a Struct writes the JSON ``model_dump_json`` writes: the same
fields in the same order, defaults filled in, unknown fields dropped (byte for byte but for
how a few floats are spelled: ``1e+16`` there, ``1e16`` here). Where msgspec cannot
say exactly what pydantic says (its JSON parser nests deeper than pydantic's), the Structs
refuse, and pydantic decides.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

import msgspec
from msgspec import UNSET, Meta, UnsetType

from skytrain_backend import protocol
from skytrain_backend.protocol import (
    TOKEN_ID_PREFIX,
    SampledTurn,
    message_shape_problem,
    names_token_ids,
    token_id_digits,
)
from skytrain_backend.ranges import INT64_MAX, INT64_MIN, NO_NUL_PATTERN

# pydantic's JSON parser refuses values nested 200 deep, counted from the group; msgspec's
# goes deeper. Free-form fields (metadata, tools, content parts: at most ten levels into a
# group) nested deeper than this are left to pydantic to judge.
MAX_FREE_FORM_DEPTH = 64

# msgspec refuses numbers a float cannot hold (1e999) where pydantic reads infinity, so a float
# that decodes here is finite, as ``allow_inf_nan=False`` asks.
MetricName = Annotated[str, Meta(max_length=256, pattern=NO_NUL_PATTERN)]
Int64 = Annotated[int, Meta(ge=INT64_MIN, le=INT64_MAX)]
MetricValue = float | Int64 | bool
FreeForm = dict[str, Any]
NonNegativeInt = Annotated[int, Meta(ge=0)]


# Every Struct lists its fields in its model's order (kw_only lets a defaulted field come
# before one without a default) and, like the models, ignores fields it does not know.


class FunctionCall(msgspec.Struct, kw_only=True):
    name: Annotated[str, Meta(min_length=1)]
    arguments: str = "{}"


class ToolCall(msgspec.Struct, kw_only=True):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


Role = Literal["system", "developer", "user", "assistant", "tool"]
Content = str | list[FreeForm] | None


def _check_message(
    role: str, content: Content, tool_calls: list[ToolCall] | None, call: Any
) -> None:
    problem = message_shape_problem(role, content, tool_calls, tool_call_id=call)
    if problem is not None:
        raise ValueError(problem)
    if isinstance(content, list) and _too_deep(content):
        raise ValueError("nested too deep to judge here")


class Message(msgspec.Struct, kw_only=True):
    """A choice's message (always a plain message, never a choice)."""

    role: Role
    content: Content = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    def __post_init__(self) -> None:
        _check_message(self.role, self.content, self.tool_calls, self.tool_call_id)


class TopLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    # Left out when the client left it out, as the TypedDict does.
    bytes: list[int] | UnsetType | None = UNSET


class TokenLogprob(msgspec.Struct, kw_only=True):
    token: str
    logprob: float
    bytes: list[int] | UnsetType | None = UNSET
    top_logprobs: list[TopLogprob] | UnsetType = UNSET


class ChoiceLogprobs(msgspec.Struct, kw_only=True):
    content: list[TokenLogprob] | None = None


class Turn(msgspec.Struct, kw_only=True):
    """One item of ``messages_and_choices``: a chat message or a sampled ``Choice``.

    msgspec has no union told apart by a function, so one Struct holds the fields of both
    (a message's first, then a choice's, each in its model's order) and ``__post_init__``
    decides as ``protocol._message_or_choice`` does: a choice has ``message`` and no ``role``.
    The other kind's fields are then dropped (UNSET is never encoded) and the kind's defaults
    filled in, so the Struct encodes as the model would.
    """

    role: Role | UnsetType = UNSET
    content: Content | UnsetType = UNSET
    name: str | UnsetType | None = UNSET
    tool_calls: list[ToolCall] | UnsetType | None = UNSET
    tool_call_id: str | UnsetType | None = UNSET
    index: int | UnsetType = UNSET
    finish_reason: str | UnsetType | None = UNSET
    message: Message | UnsetType = UNSET
    logprobs: ChoiceLogprobs | UnsetType | None = UNSET
    prompt_token_ids: list[NonNegativeInt] | UnsetType | None = UNSET
    token_ids: list[NonNegativeInt] | UnsetType | None = UNSET

    def __post_init__(self) -> None:
        if self.role is UNSET:
            if self.message is UNSET:
                raise ValueError("neither a message nor a choice")
            self._as_choice(self.message)
        else:
            self._as_message(self.role)

    def _as_choice(self, message: Message) -> None:
        if message.role != "assistant":
            raise ValueError("a choice's message must have role 'assistant'")
        if self.prompt_token_ids == []:
            raise ValueError("prompt_token_ids is empty")
        self.content = self.name = self.tool_calls = self.tool_call_id = UNSET
        if self.index is UNSET:
            self.index = 0
        if self.finish_reason is UNSET:
            self.finish_reason = None
        if self.logprobs is UNSET:
            self.logprobs = None
        if self.prompt_token_ids is UNSET:
            self.prompt_token_ids = None
        if self.token_ids is UNSET:
            self.token_ids = None

    def _as_message(self, role: Role) -> None:
        self.index = self.finish_reason = self.message = self.logprobs = UNSET
        self.prompt_token_ids = self.token_ids = UNSET
        if self.content is UNSET:
            self.content = None
        if self.name is UNSET:
            self.name = None
        if self.tool_calls is UNSET:
            self.tool_calls = None
        if self.tool_call_id is UNSET:
            self.tool_call_id = None
        _check_message(role, self.content, self.tool_calls, self.tool_call_id)

    @property
    def is_choice(self) -> bool:
        return self.role is UNSET


Turns = Annotated[list[Turn], Meta(min_length=1)]


class History(msgspec.Struct, kw_only=True):
    messages_and_choices: Turns
    tools: list[FreeForm] | None = None

    def __post_init__(self) -> None:
        if self.tools is not None and _too_deep(self.tools):
            raise ValueError("nested too deep to judge here")


class Trajectory(msgspec.Struct, kw_only=True):
    messages_and_choices: Turns
    tools: list[FreeForm] | None = None
    additional_histories: list[History] = []
    # An integer is read as one, so that one past 64 bits is refused as pydantic refuses it,
    # then stored as the float the model makes of it.
    reward: float | Int64
    metrics: dict[MetricName, MetricValue] = {}
    metadata: FreeForm = {}
    logs: list[str] = []

    def __post_init__(self) -> None:
        if _too_deep(self.metadata) or (self.tools is not None and _too_deep(self.tools)):
            raise ValueError("nested too deep to judge here")
        self.reward = float(self.reward)

    def histories(self) -> list[Trajectory | History]:
        """The main conversation followed by the additional ones."""
        return [self, *self.additional_histories]


class TrajectoryGroup(msgspec.Struct, kw_only=True):
    trajectories: Annotated[list[Trajectory], Meta(min_length=1)]
    exceptions: list[FreeForm] = []
    metadata: FreeForm = {}
    metrics: dict[MetricName, MetricValue] = {}
    logs: list[str] = []

    def __post_init__(self) -> None:
        if _too_deep(self.metadata) or _too_deep(self.exceptions):
            raise ValueError("nested too deep to judge here")


def _too_deep(value: object, depth: int = 1) -> bool:
    """Whether ``value`` (a container ``depth`` levels deep) nests past the limit."""
    if depth > MAX_FREE_FORM_DEPTH:
        return True
    if isinstance(value, dict):
        return any(
            _too_deep(item, depth + 1) for item in value.values() if isinstance(item, dict | list)
        )
    if isinstance(value, list):
        return any(_too_deep(item, depth + 1) for item in value if isinstance(item, dict | list))
    return False


GROUP_DECODER = msgspec.json.Decoder(TrajectoryGroup)
TRAJECTORY_DECODER = msgspec.json.Decoder(Trajectory)


def sampled_turn(item: Turn, allow_training_without_logprobs: bool) -> SampledTurn | None:
    """``protocol.sampled_turn`` on a Struct: the same reading of a choice."""
    if not item.is_choice:
        return None
    token_ids = item.token_ids if isinstance(item.token_ids, list) else None
    logprobs = item.logprobs
    content = logprobs.content if isinstance(logprobs, ChoiceLogprobs) else None
    if not content:
        return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
    tokens = [entry.token for entry in content]
    listed_ids: list[int] | None = None  # only compared with token_ids: read only then
    if not token_ids:
        if not names_token_ids(tokens):
            return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
    elif _names_exactly(tokens, token_ids):
        listed_ids = token_ids
    else:
        digits = token_id_digits(tokens)
        if digits is None:
            return SampledTurn(listed_ids=None, token_ids=token_ids, logprobs=None)
        listed_ids = list(map(int, digits))
    return SampledTurn(
        listed_ids=listed_ids,
        token_ids=token_ids,
        logprobs=None if allow_training_without_logprobs else _DECODED_FLOATS,
    )


# The logprobs of a choice the Structs read need no check but being there: every float msgspec
# decodes is finite (it refuses NaN, Infinity and numbers out of range), so the rule is given
# none of the values to check (reading 64 of them per choice cost more than the rest of it).
_DECODED_FLOATS: list[float] = []


_TOKEN_ID_SEPARATOR = "," + TOKEN_ID_PREFIX
_encode = msgspec.json.Encoder().encode


def _names_exactly(tokens: list[str], token_ids: list[int]) -> bool:
    """Whether ``tokens`` are ``token_id:<id>`` of each of ``token_ids`` in turn, written as
    skytrain's endpoint writes them: what ``token_id_digits`` would find, proved with one
    string comparison. A token holding a comma adds one to the joined tokens, which then
    cannot equal ids joined by exactly ``len(token_ids) - 1`` commas."""
    if len(tokens) != len(token_ids):
        return False
    # The ids as msgspec writes them, "[1,2,3]": the same digits as str() gives each int, made
    # in C (str() of every id took most of the reading of a choice).
    listed = _encode(token_ids)[1:-1].decode("ascii").replace(",", _TOKEN_ID_SEPARATOR)
    return ",".join(tokens) == TOKEN_ID_PREFIX + listed


def count_trainable_turns(
    group: TrajectoryGroup, g: int, *, allow_training_without_logprobs: bool = False
) -> int:
    """``protocol.count_trainable_turns`` on the Structs: the same rules and messages."""
    return protocol.count_trainable_turns(
        group,
        g,
        allow_training_without_logprobs=allow_training_without_logprobs,
        sampled=sampled_turn,
    )


def has_assistant_turn(trajectory: Trajectory) -> bool:
    """Whether an SFT trajectory has a turn to learn from (a choice or an assistant message)."""
    return any(
        item.is_choice or item.role == "assistant" for item in trajectory.messages_and_choices
    )

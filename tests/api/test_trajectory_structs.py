"""The msgspec Structs the API reads batches with agree with the pydantic models they are
derived from.

Whatever the Structs accept, pydantic accepts as the same values, and the line stored is the
one ``model_dump_json`` writes; whatever they refuse is judged by pydantic, whose message the
client gets; the trainability rules say the same on both.
"""

from __future__ import annotations

import copy
import json
from collections.abc import Callable
from typing import Annotated, Any

import msgspec
import pytest
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    ValidationError,
    field_validator,
)

from skytrain_backend import protocol
from skytrain_backend.api import ingest
from skytrain_backend.api import trajectory_structs as structs
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import (
    Trajectory,
    TrajectoryGroup,
    count_trainable_turns,
    format_validation_error,
    names_token_ids,
    token_id_digits,
)
from skytrain_backend.ranges import Reward
from tests.api.support import choice, group, sft_trajectory, trajectory


def _changed(change: Callable[[dict[str, Any]], object]) -> dict[str, Any]:
    """support.group() with ``change`` applied to it."""
    value = group()
    change(value)
    return value


def _first(value: dict[str, Any]) -> dict[str, Any]:
    return value["trajectories"][0]  # type: ignore[no-any-return]


def _turns(value: dict[str, Any]) -> list[Any]:
    return _first(value)["messages_and_choices"]  # type: ignore[no-any-return]


def _nested(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"leaf": 1}
    for _ in range(depth):
        value = {"a": value}
    return value


def _tool_turns(value: dict[str, Any]) -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "move", "arguments": "{}"}}
    _turns(value)[1:1] = [
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "content": "ok", "tool_call_id": "c1", "unknown": [1, 2]},
        {"role": "user", "content": [{"type": "text", "text": "go on"}], "name": "player"},
    ]


def _sampled_ids(value: dict[str, Any]) -> None:
    sampled = _turns(value)[-1]
    sampled["prompt_token_ids"] = [1, 2, 3]
    sampled["token_ids"] = [19, 20]
    sampled["logprobs"]["content"][0]["top_logprobs"] = [
        {"token": "token_id:19", "logprob": -0.5},
        {"token": "token_id:7", "logprob": -2.0, "bytes": [55], "extra": True},
    ]
    del sampled["logprobs"]["content"][1]["bytes"]


def _message_with_a_message_field(value: dict[str, Any]) -> None:
    # It has a role, so it is a message; its "message" is an unknown field, ignored.
    _turns(value)[1]["message"] = {"role": "user", "content": "not a choice"}


VALID: dict[str, dict[str, Any]] = {
    "as ART sends it": group(),
    "metrics of each kind": group(1.0, 0.5, score=2.5, turns=3, solved=True),  # type: ignore[arg-type]
    "tool calls, a tool answer, content parts": _changed(_tool_turns),
    "prompt and sampled ids, top logprobs, bytes left out": _changed(_sampled_ids),
    "an additional history": _changed(
        lambda g: _first(g)["additional_histories"].append(
            {"messages_and_choices": [{"role": "user", "content": "sub"}, choice()], "x": 1}
        )
    ),
    "nested metadata, big integers, unicode": _changed(
        lambda g: g.update(
            metadata={"deep": _nested(20), "big": 2**80, "text": "h\u00e9llo \U0001f600 \x00"},
            exceptions=[{"type": "Timeout"}],
            logs=["a", "b"],
        )
    ),
    "a message with an unknown message field": _changed(_message_with_a_message_field),
    "defaults left out": {"trajectories": [{"messages_and_choices": [choice()], "reward": 1}]},
    "a reward written as an integer of 64 bits": _changed(
        lambda g: _first(g).update(reward=-(2**53))
    ),
    "a choice without logprobs": _changed(lambda g: _turns(g)[-1].pop("logprobs")),
    "numbers in every form": _changed(
        lambda g: _first(g).update(reward=-0.0, metrics={"a": 1e-7, "b": 1.5e300, "c": -(2**63)})
    ),
}


@pytest.mark.parametrize("name", VALID)
def test_what_the_structs_accept_is_stored_as_pydantic_would(name: str) -> None:
    raw = json.dumps(VALID[name], ensure_ascii=False).encode()
    fast = structs.GROUP_DECODER.decode(raw)
    model = TrajectoryGroup.model_validate_json(raw)
    line = msgspec.json.encode(fast)
    assert json.loads(line) == json.loads(model.model_dump_json())
    if name != "numbers in every form":  # msgspec writes 1.5e300 where pydantic has 1.5e+300
        assert line == model.model_dump_json().encode()


# Accepted by pydantic's lax mode only: stored as pydantic reads them.
LAX: dict[str, dict[str, Any]] = {
    "a reward written as text": _changed(lambda g: _first(g).update(reward="0.5")),
    "an index written as a float": _changed(lambda g: _turns(g)[-1].update(index=1.0)),
    "metadata nested past what msgspec judges": _changed(
        lambda g: g.update(metadata=_nested(structs.MAX_FREE_FORM_DEPTH + 1))
    ),
}


@pytest.mark.parametrize("name", LAX)
def test_what_only_pydantic_accepts_is_stored_as_pydantic_reads_it(name: str) -> None:
    raw = json.dumps(LAX[name]).encode()
    with pytest.raises(msgspec.ValidationError):
        structs.GROUP_DECODER.decode(raw)
    parsed = ingest.parse_group(raw, "trajectory_groups[0]")
    assert isinstance(parsed, TrajectoryGroup)
    assert parsed == TrajectoryGroup.model_validate_json(raw)


def _set(path: str, value: Any) -> Callable[[dict[str, Any]], None]:
    """Set the field at a dotted path of support.group() (numbers index lists)."""

    def change(root: dict[str, Any]) -> None:
        *parents, last = path.split(".")
        node: Any = root
        for part in parents:
            node = node[int(part)] if part.isdigit() else node[part]
        if value is _DELETE:
            del node[int(last) if last.isdigit() else last]
        else:
            node[int(last) if last.isdigit() else last] = value

    return change


_DELETE = object()
_T = "trajectories.0"
_M = f"{_T}.messages_and_choices"
_TOKEN = f"{_M}.2.logprobs.content.0"

INVALID: dict[str, Callable[[dict[str, Any]], None]] = {
    "no trajectories": _set("trajectories", _DELETE),
    "empty trajectories": _set("trajectories", []),
    "trajectories not a list": _set("trajectories", {"a": 1}),
    "a trajectory not an object": _set(_T, "rollout"),
    "no reward": _set(f"{_T}.reward", _DELETE),
    "a reward in words": _set(f"{_T}.reward", "high"),
    "a null reward": _set(f"{_T}.reward", None),
    "no messages": _set(f"{_M}", _DELETE),
    "empty messages": _set(f"{_M}", []),
    "an item that is text": _set(f"{_M}.0", "hello"),
    "an item with neither role nor message": _set(f"{_M}.0", {"content": "hi"}),
    "an unknown role": _set(f"{_M}.0.role", "robot"),
    "a null role": _set(f"{_M}.0.role", None),
    "a user message without content": _set(f"{_M}.1.content", _DELETE),
    "content as a number": _set(f"{_M}.1.content", 4),
    "content parts that are not objects": _set(f"{_M}.1.content", ["text"]),
    "a name as a number": _set(f"{_M}.1.name", 7),
    "an assistant message with nothing": _set(f"{_M}.2.message.content", None),
    "a tool message without its call id": _set(f"{_M}.1.role", "tool"),
    "a tool call with an empty name": _set(
        f"{_M}.1", {"role": "assistant", "tool_calls": [{"id": "c", "function": {"name": ""}}]}
    ),
    "a tool call of another type": _set(
        f"{_M}.1",
        {
            "role": "assistant",
            "tool_calls": [{"id": "c", "type": "code", "function": {"name": "f"}}],
        },
    ),
    "a choice whose message is a user's": _set(f"{_M}.2.message.role", "user"),
    "a choice with a null message": _set(f"{_M}.2.message", None),
    "empty prompt token ids": _set(f"{_M}.2.prompt_token_ids", []),
    "a negative token id": _set(f"{_M}.2.token_ids", [19, -1]),
    "an index as text": _set(f"{_M}.2.index", "first"),
    "logprobs content not a list": _set(f"{_M}.2.logprobs.content", "many"),
    "a token that is a number": _set(f"{_TOKEN}.token", 19),
    "a logprob missing": _set(f"{_TOKEN}.logprob", _DELETE),
    "a logprob in words": _set(f"{_TOKEN}.logprob", "low"),
    "token bytes as text": _set(f"{_TOKEN}.bytes", ["a"]),
    "a top logprob without its token": _set(f"{_TOKEN}.top_logprobs", [{"logprob": -1.0}]),
    "a metric name with NUL": _set(f"{_T}.metrics", {"a\x00b": 1.0}),
    "a metric name too long": _set(f"{_T}.metrics", {"m" * 257: 1.0}),
    "a metric in words": _set(f"{_T}.metrics", {"m": "high"}),
    "a metric that is a list": _set("metrics", {"m": [1.0]}),
    "a metric past 64 bits": _set(f"{_T}.metrics", {"m": 2**64}),
    "a group metric past 64 bits": _set("metrics", {"m": -(2**63) - 1}),
    "a reward past 64 bits": _set(f"{_T}.reward", 2**70),
    "metadata not an object": _set(f"{_T}.metadata", [1]),
    "metadata nested past pydantic's limit": _set("metadata", _nested(250)),
    "logs that are numbers": _set(f"{_T}.logs", [1]),
    "exceptions that are text": _set("exceptions", ["boom"]),
    "tools as text": _set(f"{_T}.tools", "all"),
    "an additional history without messages": _set(
        f"{_T}.additional_histories", [{"messages_and_choices": []}]
    ),
}


@pytest.mark.parametrize("name", INVALID)
def test_what_the_structs_refuse_pydantic_refuses_and_names(name: str) -> None:
    body = group()
    INVALID[name](body)
    raw = json.dumps(body).encode()
    with pytest.raises(msgspec.ValidationError):
        structs.GROUP_DECODER.decode(raw)
    with pytest.raises(ValidationError) as refused:
        TrajectoryGroup.model_validate_json(raw)
    with pytest.raises(InvalidRequest) as answered:
        ingest.parse_group(raw, "trajectory_groups[3]")
    expected = format_validation_error(refused.value, root="trajectory_groups[3]")
    assert str(answered.value) == expected
    assert expected.startswith("trajectory_groups[3]")


def test_a_group_that_is_not_an_object_is_refused_by_both() -> None:
    for raw in (b'"groups"', b"[1, 2]", b"null"):
        with pytest.raises(InvalidRequest, match=r"^trajectory_groups\[0\]"):
            ingest.parse_group(raw, "trajectory_groups[0]")


def test_sft_trajectories_read_by_the_structs_are_stored_as_pydantic_would() -> None:
    for value in (sft_trajectory(), trajectory(0.5, score=1.0)):
        raw = json.dumps(value).encode()
        parsed = ingest.parse_trajectory(raw, "trajectories[0]")
        assert isinstance(parsed, structs.Trajectory)
        assert (
            msgspec.json.encode(parsed)
            == Trajectory.model_validate_json(raw).model_dump_json().encode()
        )
    no_answer = {"messages_and_choices": [{"role": "user", "content": "hi"}], "reward": 0}
    with pytest.raises(InvalidRequest, match="no assistant turn"):
        ingest.parse_trajectory(json.dumps(no_answer), "trajectories[0]")
    with pytest.raises(InvalidRequest, match=r"trajectories\[0\]\.reward"):
        ingest.parse_trajectory(json.dumps({**no_answer, "reward": None}), "trajectories[0]")


def _sampled(change: Callable[[dict[str, Any]], None]) -> dict[str, Any]:
    """support.group() with ``change`` applied to the second trajectory's choice."""
    value = group()
    change(value["trajectories"][1]["messages_and_choices"][-1])
    return value


def _plain_assistant(value: dict[str, Any]) -> dict[str, Any]:
    for item in value["trajectories"]:
        item["messages_and_choices"][-1] = {"role": "assistant", "content": "4"}
    return value


_NO_LOGPROBS = "trajectory 1 of group 4: the choice at messages_and_choices[2] has no logprobs"

# A group, and what the rules say of it without and with allow_training_without_logprobs:
# the number of trainable turns, or a fragment of the refusal.
TRAINABILITY: dict[str, tuple[dict[str, Any], int | str, int | str]] = {
    "trainable": (group(), 2, 2),
    "no logprobs": (_sampled(lambda c: c.update(logprobs=None)), _NO_LOGPROBS, 2),
    "empty logprobs": (_sampled(lambda c: c["logprobs"].update(content=[])), _NO_LOGPROBS, 2),
    "a token that is text": (
        _sampled(lambda c: c["logprobs"]["content"][1].update(token="4")),
        _NO_LOGPROBS,
        2,
    ),
    "a token with a comma": (
        _sampled(lambda c: c["logprobs"]["content"][0].update(token="token_id:1,token_id:2")),
        _NO_LOGPROBS,
        2,
    ),
    "token ids that differ": (
        _sampled(lambda c: c.update(token_ids=[19, 21])),
        "token_ids that differ from the ids in its logprobs",
        "token_ids that differ from the ids in its logprobs",
    ),
    "token ids that agree": (_sampled(lambda c: c.update(token_ids=[19, 20])), 2, 2),
    "token ids that agree with tokens written with a leading zero": (
        _sampled(
            lambda c: (
                c.update(token_ids=[19, 20]),
                c["logprobs"]["content"][0].update(token="token_id:019"),
            )
        ),
        2,
        2,
    ),
    "a token with a comma, and ids that match the tokens joined": (
        _sampled(
            lambda c: (
                c.update(token_ids=[18, 19, 20]),
                c["logprobs"]["content"][0].update(token="token_id:18,token_id:19"),
            )
        ),
        _NO_LOGPROBS,
        2,
    ),
    "token ids one longer than the logprobs": (
        _sampled(lambda c: c.update(token_ids=[19, 20, 21])),
        "token_ids that differ from the ids in its logprobs",
        "token_ids that differ from the ids in its logprobs",
    ),
    "no logprobs but token ids": (
        _sampled(lambda c: c.update(logprobs=None, token_ids=[19, 20])),
        _NO_LOGPROBS,
        2,
    ),
    "a token id ending in a newline": (
        _sampled(lambda c: c["logprobs"]["content"][0].update(token="token_id:19\n")),
        2,
        2,
    ),
    "an additional history without logprobs": (
        _changed(
            lambda g: _first(g)["additional_histories"].append(
                {
                    "messages_and_choices": [
                        {"role": "user", "content": "q"},
                        {**choice(), "logprobs": None},
                    ]
                }
            )
        ),
        "trajectory 0 of group 4 (additional history 0): the choice at "
        "messages_and_choices[1] has no logprobs",
        3,
    ),
    "plain assistant messages only": (_plain_assistant(group()), 0, 2),
}


@pytest.mark.parametrize("allow", [False, True])
@pytest.mark.parametrize("name", TRAINABILITY)
def test_trainability_rules_agree_on_structs_and_models(name: str, allow: bool) -> None:
    value, refused, allowed = TRAINABILITY[name]
    raw = json.dumps(value).encode()

    def outcome(count: Callable[..., int], parsed: Any) -> int | str:
        try:
            return count(parsed, 4, allow_training_without_logprobs=allow)
        except InvalidRequest as exc:
            return str(exc)

    fast = outcome(structs.count_trainable_turns, structs.GROUP_DECODER.decode(raw))
    slow = outcome(count_trainable_turns, TrajectoryGroup.model_validate_json(raw))
    assert fast == slow
    expected = allowed if allow else refused
    if isinstance(expected, int):
        assert fast == expected
    else:
        assert isinstance(fast, str) and expected in fast


@pytest.mark.parametrize(
    ("tokens", "digits"),
    [
        (["token_id:1", "token_id:22"], ["1", "22"]),
        (["token_id:5\n"], ["5"]),  # the pattern's "$" takes a final newline
        (["token_id:1", "token_id:2\n"], ["1", "2"]),
        (["token_id:007", "token_id:0"], ["007", "0"]),
        (["token_id:1", "token_id:2", "token_id:x"], None),
        (["token_id:1", ""], None),
        (["Hello", " world"], None),
        (["token_id:\u0663"], ["\u0663"]),  # an Arabic-Indic three: a decimal digit
        (["token_id:1,token_id:2"], None),
        (["token_id:1", "token_id:"], None),
        (["token_id:1", "4"], None),
        (["token_id:1token_id:2"], None),
        (["token_id:1", ",token_id:2"], None),
        (["token_id:" + "9" * 20], ["9" * 20]),
        (["token_id:" + "1" * 21], None),  # longer than a 64-bit id: not an id
        (["token_id:" + "1" * 5000, "token_id:1"], None),  # past int()'s digit limit
        ([], []),
    ],
)
def test_token_ids_are_read_only_from_whole_tokens(
    tokens: list[str], digits: list[str] | None
) -> None:
    assert token_id_digits(tokens) == digits
    assert names_token_ids(tokens) is (digits is not None)


def test_a_struct_decoded_twice_does_not_share_defaults() -> None:
    raw = json.dumps(VALID["defaults left out"]).encode()
    first, second = structs.GROUP_DECODER.decode(raw), structs.GROUP_DECODER.decode(raw)
    first.trajectories[0].logs.append("mine")
    assert second.trajectories[0].logs == []
    assert copy.deepcopy(second) == second


# --- the derivation: a change to the models carries over, or stops the import ----------------


class _Scored(BaseModel):
    """A model as ``protocol``'s are written: constraints, a default, an after-validator."""

    model_config = ConfigDict(extra="ignore")

    label: Annotated[str, StringConstraints(max_length=3)]
    score: Annotated[int, Field(ge=0)] = 7
    reward: Reward = 0.0
    tags: list[str] = Field(default_factory=list)

    @field_validator("label")
    @classmethod
    def _not_x(cls, label: str) -> str:
        if label == "x":
            raise ValueError("x is not a label")
        return label


def test_a_field_added_to_a_model_is_read_and_written_as_the_model_does() -> None:
    decoder = msgspec.json.Decoder(structs.derive(_Scored))
    for raw in (b'{"label": "ab"}', b'{"label": "ab", "score": 3, "reward": 2, "other": 1}'):
        assert (
            msgspec.json.encode(decoder.decode(raw))
            == _Scored.model_validate_json(raw).model_dump_json().encode()
        )
    for refused in (
        b'{"label": "abcd"}',  # too long
        b'{"label": "ab", "score": -1}',  # below its bound
        b'{"label": "x"}',  # the model's own validator
        b'{"label": "ab", "reward": 1180591620717411303424}',  # an integer past 64 bits
        b'{"score": 1}',  # a required field left out
    ):
        with pytest.raises(msgspec.ValidationError):
            decoder.decode(refused)
        with pytest.raises(ValidationError):
            _Scored.model_validate_json(refused)


class _Before(BaseModel):
    name: str

    @field_validator("name", mode="before")
    @classmethod
    def _strip(cls, name: Any) -> Any:
        return name.strip() if isinstance(name, str) else name


class _Stripped(BaseModel):
    name: Annotated[str, StringConstraints(strip_whitespace=True)]


class _Forbidding(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


@pytest.mark.parametrize("model", [_Before, _Stripped, _Forbidding])
def test_what_msgspec_cannot_mirror_stops_the_derivation(model: type[BaseModel]) -> None:
    with pytest.raises(TypeError, match=model.__name__):
        structs.derive(model)


def test_the_structs_have_the_models_fields_in_their_order() -> None:
    for struct, model in (
        (structs.TrajectoryGroup, TrajectoryGroup),
        (structs.Trajectory, Trajectory),
        (structs.Turn, None),
    ):
        names = list(struct.__struct_fields__)
        if model is None:
            names_of = [*protocol.Message.model_fields, *protocol.Choice.model_fields]
        else:
            names_of = list(model.model_fields)
        assert names == names_of

"""Trajectories keep the sampled Choice objects and serialize to the JSON the server parses."""

from __future__ import annotations

import asyncio
import json
import math
from typing import Any

import pytest
from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ValidationError

import skytrain
from skytrain_backend import protocol
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import check_trainable, parse_trajectory_groups


def make_choice(
    text: str | None = "4",
    *,
    token_ids: tuple[int, ...] = (19, 2),
    tool_calls: list[dict[str, Any]] | None = None,
) -> Choice:
    """A Choice as skytrain's endpoint returns it: logprobs with ``token_id:<id>`` tokens."""
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls" if tool_calls else "stop",
            "message": {"role": "assistant", "content": text, "tool_calls": tool_calls},
            "logprobs": {
                "content": [
                    {
                        "token": f"token_id:{i}",
                        "logprob": -0.25 * (n + 1),
                        "bytes": None,
                        "top_logprobs": [],
                    }
                    for n, i in enumerate(token_ids)
                ]
            },
        }
    )


TOOL_CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "search", "arguments": '{"keywords": ["invoice"]}'},
}


def make_trajectory(reward: float = 1.0) -> skytrain.Trajectory:
    return skytrain.Trajectory(
        messages_and_choices=[
            {"role": "system", "content": "You search email."},
            {"role": "user", "content": "Find the invoice."},
            make_choice(None, tool_calls=[TOOL_CALL], token_ids=(7, 8, 9)),
            {"role": "tool", "tool_call_id": "call_1", "content": "1 result"},
            make_choice("Found it."),
        ],
        reward=reward,
        metrics={"turns": 2, "found": True},
        metadata={"scenario": 12},
        tools=[{"type": "function", "function": {"name": "search", "parameters": {}}}],
        additional_histories=[
            skytrain.History(
                messages_and_choices=[{"role": "user", "content": "Summarize."}, make_choice("ok")]
            )
        ],
    )


def server_choice(history: protocol.History | protocol.Trajectory, index: int) -> protocol.Choice:
    item = history.messages_and_choices[index]
    assert isinstance(item, protocol.Choice)
    return item


def test_trajectory_keeps_the_choice_objects_as_they_are() -> None:
    choice = make_choice()
    trajectory = skytrain.Trajectory(
        messages_and_choices=[{"role": "user", "content": "2+2?"}, choice], reward=1.0
    )
    assert trajectory.messages_and_choices[1] is choice


def test_messages_turns_choices_into_assistant_messages_and_keeps_tool_calls() -> None:
    messages = make_trajectory().messages()
    assert [m["role"] for m in messages] == ["system", "user", "assistant", "tool", "assistant"]
    assert messages[2] == {"role": "assistant", "content": None, "tool_calls": [TOOL_CALL]}
    assert messages[4] == {"role": "assistant", "content": "Found it."}
    assert all(isinstance(m, dict) for m in messages)


def test_json_round_trip_gives_back_choices_with_their_logprobs() -> None:
    trajectory = make_trajectory()
    restored = skytrain.Trajectory.model_validate_json(
        json.dumps(trajectory.model_dump(mode="json"))
    )
    choice = restored.messages_and_choices[4]
    assert isinstance(choice, Choice)
    assert choice.logprobs is not None
    assert [entry.token for entry in choice.logprobs.content or []] == [
        "token_id:19",
        "token_id:2",
    ]
    assert restored.messages() == trajectory.messages()


def test_art_json_is_accepted_by_the_servers_parser() -> None:
    """What the SDK sends is what ``protocol.parse_trajectory_groups`` reads, token ids included."""
    group = skytrain.TrajectoryGroup(
        [make_trajectory(1.0), make_trajectory(0.0)], metadata={"scenario": "s1"}
    )
    wire = json.loads(json.dumps([group.model_dump(mode="json")]))
    (parsed,) = parse_trajectory_groups(wire)
    check_trainable([parsed])
    first = parsed.trajectories[0]
    assert [t.reward for t in parsed.trajectories] == [1.0, 0.0]
    tool_turn, answer = server_choice(first, 2), server_choice(first, 4)
    assert tool_turn.sampled_token_ids() == [7, 8, 9]
    assert answer.sampled_logprobs() == [-0.25, -0.5]
    assert [call.function.name for call in tool_turn.message.tool_calls or []] == ["search"]
    assert server_choice(first.additional_histories[0], 1).sampled_token_ids() == [19, 2]
    assert first.metrics == {"turns": 2, "found": True}
    assert parsed.metadata == {"scenario": "s1"}


@pytest.mark.parametrize(
    ("sdk", "server"),
    [
        (skytrain.TrajectoryGroup, protocol.TrajectoryGroup),
        (skytrain.Trajectory, protocol.Trajectory),
        (skytrain.History, protocol.History),
    ],
)
def test_the_sdk_sends_every_field_the_server_reads_and_no_other(
    sdk: type[BaseModel], server: type[BaseModel]
) -> None:
    """The SDK cannot import the server's models (it stays light), so its own trajectory
    types are held to them here, the one definition of the wire shape: the same fields, and
    where the server has a default the SDK's is the same."""
    assert set(sdk.model_fields) == set(server.model_fields)
    group = skytrain.TrajectoryGroup([make_trajectory()])
    sent = {
        skytrain.TrajectoryGroup: group,
        skytrain.Trajectory: group.trajectories[0],
        skytrain.History: group.trajectories[0].additional_histories[0],
    }[sdk].model_dump(mode="json")
    assert set(sent) == set(server.model_fields)
    for name, field in server.model_fields.items():
        if not field.is_required():
            assert sdk.model_fields[name].get_default(call_default_factory=True) == (
                field.get_default(call_default_factory=True)
            ), name


def test_server_refuses_plain_assistant_messages_the_sdk_sends_for_rl() -> None:
    """Without the Choice objects there is nothing to train on: the server says so."""
    trajectory = skytrain.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"},
        ],
        reward=1.0,
    )
    groups = parse_trajectory_groups(
        [skytrain.TrajectoryGroup([trajectory]).model_dump(mode="json")]
    )
    with pytest.raises(InvalidRequest, match="include the Choice objects"):
        check_trainable(groups)


def test_messages_must_be_chat_messages() -> None:
    with pytest.raises(ValidationError, match="a dict with a 'role'"):
        skytrain.Trajectory(messages_and_choices=["just text"], reward=1.0)


@pytest.mark.parametrize("bad", [math.nan, math.inf])
def test_reward_and_metrics_must_be_finite(bad: float) -> None:
    with pytest.raises(ValidationError, match="reward"):
        skytrain.Trajectory(messages_and_choices=[{"role": "user", "content": "x"}], reward=bad)
    with pytest.raises(ValidationError, match="metric 'loss' is"):
        skytrain.Trajectory(
            messages_and_choices=[{"role": "user", "content": "x"}],
            reward=0.0,
            metrics={"loss": bad},
        )
    trajectory = make_trajectory()
    with pytest.raises(ValidationError, match="reward"):
        trajectory.reward = bad


async def test_group_from_rollout_coroutines_resolves_when_awaited() -> None:
    async def rollout(reward: float) -> skytrain.Trajectory:
        await asyncio.sleep(0)
        return make_trajectory(reward)

    group = skytrain.TrajectoryGroup(rollout(r) for r in (0.0, 0.5, 1.0))
    assert not group.is_resolved
    assert len(group) == 0
    resolved = await group
    assert resolved is group
    assert group.is_resolved
    assert [t.reward for t in group.trajectories] == [0.0, 0.5, 1.0]
    assert await group is group  # awaiting again runs nothing twice
    assert len(group) == 3


async def test_awaiting_a_group_alone_raises_the_first_rollout_failure() -> None:
    async def fails() -> skytrain.Trajectory:
        raise RuntimeError("the environment crashed")

    group = skytrain.TrajectoryGroup([fails()])
    with pytest.raises(RuntimeError, match="the environment crashed"):
        await group
    assert group.exceptions[0].type == "builtins.RuntimeError"


def test_exceptions_given_to_a_group_are_recorded_with_their_traceback() -> None:
    try:
        raise KeyError("missing tool")
    except KeyError as exc:
        caught = exc
    group = skytrain.TrajectoryGroup([make_trajectory(), caught], exceptions=[ValueError("bad")])
    assert len(group) == 1
    assert [e.type for e in group.exceptions] == ["builtins.KeyError", "builtins.ValueError"]
    assert "raise KeyError" in group.exceptions[0].traceback
    assert group.exceptions[1].message == "bad"


def test_group_refuses_what_is_neither_trajectory_nor_awaitable() -> None:
    with pytest.raises(TypeError, match=r"trajectories\[1\] is a dict"):
        skytrain.TrajectoryGroup([make_trajectory(), {"reward": 1}])  # type: ignore[list-item]


async def test_a_rollout_returning_something_else_is_a_clear_error() -> None:
    async def wrong() -> Any:
        return {"reward": 1.0}

    with pytest.raises(TypeError, match=r"rollouts must return a skytrain\.Trajectory"):
        await skytrain.TrajectoryGroup([wrong()])

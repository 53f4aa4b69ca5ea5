"""The CPU engine with SmolLM2-135M-Instruct, through the official openai SDK: answers that must
make sense, a tool-call round trip, and the end-of-sequence token in the logprobs.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoTokenizer

from tests.engine.conftest import RunningEngine
from tests.engine.conversations import TOOLS, WEATHER_CONVERSATION

pytestmark = pytest.mark.slow

CAPITAL = [{"role": "user", "content": "What is the capital of France?"}]
TOKEN_IDS = {"return_tokens_as_token_ids": True}


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(smollm2_path)


def _ids(choice: Any) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]


def test_a_greedy_answer_makes_sense_and_its_eos_token_closes_the_logprobs(
    smollm2_engine: RunningEngine, tokenizer: Any
) -> None:
    response = smollm2_engine.openai().chat.completions.create(
        model="smollm2",
        messages=CAPITAL,
        temperature=0,
        max_tokens=40,
        logprobs=True,
        top_logprobs=2,
        extra_body=TOKEN_IDS,
    )
    [choice] = response.choices
    assert "Paris" in choice.message.content
    assert choice.finish_reason == "stop"
    ids = _ids(choice)
    # Like vLLM: the end-of-turn token that stopped generation is the last sampled token,
    # with its logprob, but its text is not part of the message.
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"
    assert tokenizer.decode(ids[:-1]) == choice.message.content
    assert response.usage.completion_tokens == len(ids)
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_streaming_gives_the_same_answer_token_by_token(smollm2_engine: RunningEngine) -> None:
    client = smollm2_engine.openai()
    plain = client.chat.completions.create(
        model="smollm2", messages=CAPITAL, temperature=0, max_tokens=40
    )
    chunks = list(
        client.chat.completions.create(
            model="smollm2",
            messages=CAPITAL,
            temperature=0,
            max_tokens=40,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert len(pieces) > 3  # streamed as produced, not in one piece
    assert "".join(pieces) == plain.choices[0].message.content
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].usage.completion_tokens == plain.usage.completion_tokens


def test_tool_call_round_trip(smollm2_engine: RunningEngine) -> None:
    client = smollm2_engine.openai()
    first = client.chat.completions.create(
        model="smollm2", messages=WEATHER_CONVERSATION, tools=TOOLS, temperature=0, max_tokens=40
    )
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    conversation = [
        *WEATHER_CONVERSATION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25 C"},
    ]
    second = client.chat.completions.create(
        model="smollm2", messages=conversation, tools=TOOLS, temperature=0, max_tokens=40
    )
    [answer] = second.choices
    assert answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    assert "sunny" in answer.message.content.lower()


def test_a_streamed_tool_call_arrives_as_a_tool_call_delta(smollm2_engine: RunningEngine) -> None:
    chunks = list(
        smollm2_engine.openai().chat.completions.create(
            model="smollm2",
            messages=WEATHER_CONVERSATION,
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas).strip()  # no <tool_call> text leaks
    [call] = [call for d in deltas for call in d.tool_calls or []]
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_n_sampled_answers_differ_and_their_ids_decode_to_their_text(
    smollm2_engine: RunningEngine, tokenizer: Any
) -> None:
    response = smollm2_engine.openai().chat.completions.create(
        model="smollm2",
        messages=[{"role": "user", "content": "Write a haiku about the sea."}],
        n=3,
        temperature=0.9,
        seed=1,
        max_tokens=30,
        logprobs=True,
        extra_body=TOKEN_IDS,
    )
    texts = [c.message.content for c in response.choices]
    assert len(set(texts)) == 3
    for choice in response.choices:
        ids = _ids(choice)
        if choice.finish_reason == "stop":
            ids = ids[:-1]
        assert tokenizer.decode(ids) == choice.message.content
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in response.choices
    )


def _resident_mib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) // 1024
    raise AssertionError("no VmRSS in /proc status")


async def test_sleep_gives_the_weights_memory_back_and_wake_up_restores_the_model(
    smollm2_engine: RunningEngine,
) -> None:
    pid = smollm2_engine.process.pid
    assert pid is not None
    client = smollm2_engine.openai()
    before = client.chat.completions.create(
        model="smollm2", messages=CAPITAL, temperature=0, max_tokens=20
    )
    awake = _resident_mib(pid)
    async with smollm2_engine.client() as engine:
        await engine.sleep()
        try:
            asleep = _resident_mib(pid)
        finally:
            await engine.wake_up()
    # 135M parameters in float32 are 515 MiB; most of it must leave the process.
    assert awake - asleep > 300, (awake, asleep)
    after = client.chat.completions.create(
        model="smollm2", messages=CAPITAL, temperature=0, max_tokens=20
    )
    assert after.choices[0].message.content == before.choices[0].message.content

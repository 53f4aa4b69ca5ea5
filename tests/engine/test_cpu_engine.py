"""The CPU engine over HTTP with the official openai SDK, on the tiny random model: what it
does beyond the contract it shares with vLLM (tests/engine/test_engine_contract.py).

Batching that never changes a result, max_tokens checked against the context, requests
checked field by field, and a sleep that refuses requests (503) and frees memory.
"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer
from transformers.utils import logging as transformers_logging

from skytrain_backend.errors import EngineError
from tests.engine.conftest import TINY_MAX_MODEL_LEN, RunningEngine, sampled_ids

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
# The tiny model rarely samples its end-of-turn token; these tests want exact lengths.
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _greedy(engine: RunningEngine, content: str, max_tokens: int, model: str | None = None) -> Any:
    return engine.openai().chat.completions.create(
        model=model or engine.name,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )


@pytest.mark.slow
def test_a_seed_repeats_n_choices_exactly(tiny_engine: RunningEngine) -> None:
    def sample() -> list[list[int]]:
        response = tiny_engine.openai().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            n=4,
            seed=1234,
            temperature=1.0,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
        )
        return [sampled_ids(choice) for choice in response.choices]

    first = sample()
    assert len({tuple(ids) for ids in first}) == 4
    assert sample() == first


async def test_requests_decoded_together_get_the_tokens_they_get_alone(
    tiny_engine: RunningEngine,
) -> None:
    """Batching (left padding, sequences joining and leaving) must not change any result."""
    prompts = [f"Prompt number {i} " + "with more words " * i for i in range(8)]
    lengths = [5 + 3 * i for i in range(8)]
    alone = [
        sampled_ids(_greedy(tiny_engine, p, n).choices[0])
        for p, n in zip(prompts, lengths, strict=True)
    ]

    client = tiny_engine.async_openai()

    async def one(prompt: str, max_tokens: int, delay: float) -> list[int]:
        await asyncio.sleep(delay)  # some join a batch that is already decoding
        response = await client.chat.completions.create(
            model="tiny",
            messages=[{"role": "user", "content": prompt}],
            max_tokens=max_tokens,
            temperature=0,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
        )
        return sampled_ids(response.choices[0])

    together = await asyncio.gather(
        *(one(p, n, 0.05 * (i % 3)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
    )
    assert list(together) == alone


def test_max_tokens_beyond_the_context_is_a_400_and_the_engine_keeps_serving(
    tiny_engine: RunningEngine,
) -> None:
    """(vLLM 0.32 serves such a request up to the context's end instead.)"""
    client = tiny_engine.openai()
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(
            model="tiny", messages=MESSAGES, max_tokens=TINY_MAX_MODEL_LEN
        )
    assert f"maximum context length is {TINY_MAX_MODEL_LEN} tokens" in raised.value.message
    with pytest.raises(openai.BadRequestError, match="shorten the prompt"):
        client.chat.completions.create(
            model="tiny", messages=[{"role": "user", "content": "word " * 2000}], max_tokens=1
        )
    assert _greedy(tiny_engine, "Still there?", 3).choices[0].finish_reason == "length"


@pytest.mark.parametrize(
    ("body", "named"),
    [
        ({"messages": [{"role": "robot", "content": "hi"}]}, "messages.0.role"),
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "tool", "content": "42"}]}, "tool_call_id"),
        ({"messages": [{"role": "user"}]}, "needs content"),
        ({"messages": MESSAGES, "presence_penalty": 0.5}, "presence_penalty"),
        ({"messages": MESSAGES, "tool_choice": "required"}, "tool_choice"),
        ({"messages": MESSAGES, "temperature": -1}, "temperature"),
        ({"messages": MESSAGES, "top_logprobs": 3}, "top_logprobs needs logprobs"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "image_url",
        ),
    ],
)
def test_malformed_requests_are_400s_naming_the_problem(
    tiny_engine: RunningEngine, body: dict[str, Any], named: str
) -> None:
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/chat/completions", json={"model": "tiny", **body}, timeout=60
    )
    assert response.status_code == 400
    error = response.json()["error"]
    assert named in error["message"]
    assert error["code"] == 400
    assert _greedy(tiny_engine, "ok?", 2).choices[0].finish_reason == "length"


async def test_sleep_refuses_requests_with_503_and_wake_up_serves_them_again(
    tiny_engine: RunningEngine,
) -> None:
    before = sampled_ids(_greedy(tiny_engine, "Before sleeping.", 6).choices[0])
    async with tiny_engine.client() as client:
        await client.sleep()
        try:
            assert await client.is_sleeping()
            assert await client.health()  # alive, just not holding the model
            with pytest.raises(openai.InternalServerError) as raised:
                _greedy(tiny_engine, "Before sleeping.", 6)
            assert raised.value.status_code == 503
            assert "wake_up" in raised.value.message
            with pytest.raises(EngineError, match="503"):
                await client.load_lora("while-asleep", "/nonexistent")
        finally:
            await client.wake_up()
        assert not await client.is_sleeping()
    assert sampled_ids(_greedy(tiny_engine, "Before sleeping.", 6).choices[0]) == before


# Long enough that the stream still runs while the test asks for a sleep and sends another
# request (the tiny model decodes a token in a few milliseconds).
LONG_STREAM_TOKENS = TINY_MAX_MODEL_LEN - 16


async def _stream_until_done(engine: RunningEngine, started: asyncio.Event) -> list[str]:
    """A long completion streamed to its end; ``started`` is set at its first event."""
    body = {
        "model": "tiny",
        "prompt": "Count:",
        "max_tokens": LONG_STREAM_TOKENS,
        "ignore_eos": True,
        "stream": True,
    }
    events = []
    async with (
        httpx.AsyncClient(timeout=300) as http,
        http.stream("POST", f"{engine.base_url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        async for line in response.aiter_lines():
            if line.startswith("data: "):
                events.append(line)
                started.set()
    return events


async def test_a_sleep_that_waits_lets_running_requests_finish_and_refuses_new_ones(
    tiny_engine: RunningEngine,
) -> None:
    started = asyncio.Event()
    streaming = asyncio.create_task(_stream_until_done(tiny_engine, started))
    await asyncio.wait_for(started.wait(), 120)
    async with tiny_engine.client() as client:
        sleeping = asyncio.create_task(client.sleep(mode="wait"))
        try:
            await asyncio.sleep(0.2)
            async with httpx.AsyncClient(timeout=60) as http:
                late = await http.post(
                    f"{tiny_engine.base_url}/v1/completions",
                    json={"model": "tiny", "prompt": "Late", "max_tokens": 2},
                )
            assert not streaming.done(), "the stream ended before the late request: lengthen it"
            assert late.status_code == 503
            assert "going to sleep" in late.json()["error"]["message"]
            events = await streaming
            await sleeping
            assert await client.is_sleeping()
        finally:
            await client.wake_up()
    # The running request got every token it asked for, and ended normally.
    assert events[-1] == "data: [DONE]"
    tokens = [e for e in events[:-1] if '"text"' in e]
    assert len(tokens) == LONG_STREAM_TOKENS
    assert '"finish_reason":"length"' in events[-2].replace(" ", "")


def test_prompt_logprobs_are_those_of_a_direct_forward_pass(
    tiny_engine: RunningEngine, tiny_model_path: Path
) -> None:
    prompt = [1, 17, 230, 5, 99, 4, 12]
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/completions",
        json={
            "model": tiny_engine.name,
            "prompt": prompt,
            "max_tokens": 1,
            "prompt_logprobs": 3,
            "return_tokens_as_token_ids": True,
        },
        timeout=120,
    )
    assert response.status_code == 200, response.text
    scored = response.json()["choices"][0]["prompt_logprobs"]

    transformers_logging.disable_progress_bar()  # no tqdm thread left running
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    with torch.no_grad():
        logprobs = model(torch.tensor([prompt])).logits[0].log_softmax(dim=-1)
    assert len(scored) == len(prompt) and scored[0] is None
    for position in range(1, len(prompt)):
        row = logprobs[position - 1]
        entry = scored[position]
        own = entry[str(prompt[position])]
        assert own["logprob"] == pytest.approx(float(row[prompt[position]]), abs=1e-4)
        assert own["rank"] == int((row > row[prompt[position]]).sum()) + 1
        assert own["decoded_token"] == f"token_id:{prompt[position]}"
        values, ids = row.topk(3)
        for rank, (token, value) in enumerate(zip(ids.tolist(), values.tolist(), strict=True)):
            assert entry[str(token)]["logprob"] == pytest.approx(value, abs=1e-4)
            if token != prompt[position]:
                assert entry[str(token)]["rank"] == rank + 1
    # Streamed completions do not carry them: refused, not silently dropped.
    streamed = httpx.post(
        f"{tiny_engine.base_url}/v1/completions",
        json={"model": tiny_engine.name, "prompt": prompt, "prompt_logprobs": 0, "stream": True},
        timeout=60,
    )
    assert streamed.status_code == 400 and "prompt_logprobs" in streamed.text

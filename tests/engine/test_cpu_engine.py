"""The CPU engine over HTTP with the official openai SDK, on the tiny random model.

The tiny model writes nonsense, so these tests check the protocol and the decoding machinery
(ids, usage, logprobs, n, seeds, stops, batching, limits, errors, sleep); SmolLM2 tests check
text that has to make sense.
"""

from __future__ import annotations

import asyncio
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from skytrain_backend.errors import EngineError
from tests.engine.conftest import TINY_MAX_MODEL_LEN, RunningEngine, start_engine

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
# The tiny model rarely samples its end-of-turn token; these tests want exact lengths.
NO_EOS = {"ignore_eos": True}


@pytest.fixture(scope="module")
def tokenizer(tiny_model_path: Path) -> Any:
    return AutoTokenizer.from_pretrained(tiny_model_path)


def _ids(choice: Any) -> list[int]:
    return [int(entry.token.removeprefix("token_id:")) for entry in choice.logprobs.content]


def _greedy(engine: RunningEngine, content: str, max_tokens: int, model: str | None = None) -> Any:
    return engine.openai().chat.completions.create(
        model=model or engine.name,
        messages=[{"role": "user", "content": content}],
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )


def test_chat_completion_is_a_valid_openai_response_with_exact_usage(
    tiny_engine: RunningEngine, tokenizer: Any
) -> None:
    response = tiny_engine.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=7, logprobs=True, extra_body=NO_EOS
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert abs(response.created - time.time()) < 600
    assert response.model == "tiny"
    [choice] = response.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(
        tokenizer(prompt, add_special_tokens=False).input_ids
    )
    assert response.usage.completion_tokens == 7 == len(choice.logprobs.content)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


def test_logprob_token_ids_decode_to_the_returned_text(
    tiny_engine: RunningEngine, tokenizer: Any
) -> None:
    response = tiny_engine.openai().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )
    [choice] = response.choices
    ids = _ids(choice)
    assert len(ids) == 12
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    for entry in choice.logprobs.content:
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)
        # Greedy: the sampled token is the most likely one, with the same logprob.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        assert entry.bytes == list(entry.token.encode())


def test_without_token_ids_logprob_tokens_are_the_token_texts(tiny_engine: RunningEngine) -> None:
    response = tiny_engine.openai().chat.completions.create(
        model="tiny",
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body=NO_EOS,
    )
    [choice] = response.choices
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content


def test_streaming_sends_the_same_tokens_as_a_plain_request_and_a_final_usage_chunk(
    tiny_engine: RunningEngine,
) -> None:
    plain = _greedy(tiny_engine, "Stream this.", 9)
    stream = tiny_engine.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stream this."}],
        max_tokens=9,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    ids = [
        int(entry.token.removeprefix("token_id:"))
        for c in content_chunks
        if c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content
    ]
    assert text == plain.choices[0].message.content
    assert ids == _ids(plain.choices[0])
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert not chunks[-1].choices
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9
    assert chunks[-1].usage.prompt_tokens == plain.usage.prompt_tokens


def test_n_choices_are_distinct_and_a_seed_repeats_them(tiny_engine: RunningEngine) -> None:
    def sample() -> Any:
        return tiny_engine.openai().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=8,
            n=4,
            seed=1234,
            temperature=1.0,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
        )

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    samples = [_ids(c) for c in first.choices]
    assert len({tuple(s) for s in samples}) == 4
    assert [_ids(c) for c in second.choices] == samples
    assert first.usage.completion_tokens == 32


async def test_requests_decoded_together_get_the_tokens_they_get_alone(
    tiny_engine: RunningEngine,
) -> None:
    """Batching (left padding, sequences joining and leaving) must not change any result."""
    prompts = [f"Prompt number {i} " + "with more words " * i for i in range(8)]
    lengths = [5 + 3 * i for i in range(8)]
    alone = [
        _ids(_greedy(tiny_engine, p, n).choices[0]) for p, n in zip(prompts, lengths, strict=True)
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
        return _ids(response.choices[0])

    together = await asyncio.gather(
        *(one(p, n, 0.05 * (i % 3)) for i, (p, n) in enumerate(zip(prompts, lengths, strict=True)))
    )
    assert list(together) == alone


def test_a_stop_string_ends_the_text_before_it_and_is_reported(tiny_engine: RunningEngine) -> None:
    reference = _greedy(tiny_engine, "Stop somewhere.", 12).choices[0]
    text = reference.message.content
    pieces = [entry for entry in reference.logprobs.content]
    assert len(pieces) == 12
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    response = tiny_engine.openai().chat.completions.create(
        model="tiny",
        messages=[{"role": "user", "content": "Stop somewhere."}],
        max_tokens=12,
        temperature=0,
        stop=[stop],
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, **NO_EOS},
    )
    [choice] = response.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert choice.message.content == text[: text.index(stop)]
    ids = _ids(choice)
    assert 0 < len(ids) < 12
    assert ids == _ids(reference)[: len(ids)]  # the tokens sampled up to the stop, unchanged


def test_completions_accept_text_token_ids_and_several_prompts(
    tiny_engine: RunningEngine, tokenizer: Any
) -> None:
    client = tiny_engine.openai()
    ids = tokenizer("Once upon a time").input_ids
    by_ids = client.completions.create(
        model="tiny", prompt=ids, max_tokens=5, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    by_text = client.completions.create(
        model="tiny", prompt="Once upon a time", max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.id.startswith("cmpl-")
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    logprobs = by_ids.choices[0].logprobs
    assert "".join(logprobs.tokens) == by_ids.choices[0].text
    assert len(logprobs.token_logprobs) == 5
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)

    several = client.completions.create(
        model="tiny", prompt=["One", "Two words"], n=2, max_tokens=4, seed=3, extra_body=NO_EOS
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.completion_tokens == 16


def test_streamed_completion_concatenates_to_the_plain_one(tiny_engine: RunningEngine) -> None:
    client = tiny_engine.openai()
    plain = client.completions.create(
        model="tiny", prompt="Hello", max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    chunks = list(
        client.completions.create(
            model="tiny",
            prompt="Hello",
            max_tokens=6,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body=NO_EOS,
        )
    )
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    assert chunks[-1].usage.completion_tokens == 6


def test_max_tokens_beyond_the_context_is_a_400_and_the_engine_keeps_serving(
    tiny_engine: RunningEngine,
) -> None:
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


def test_unknown_model_is_an_openai_style_404(tiny_engine: RunningEngine) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        tiny_engine.openai().chat.completions.create(model="gpt-5", messages=MESSAGES)
    body = raised.value.body
    assert isinstance(body, dict)
    assert "gpt-5" in body["message"]
    assert body["code"] == 404


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


def test_invalid_json_and_out_of_vocabulary_prompts_are_400s(tiny_engine: RunningEngine) -> None:
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json"},
        timeout=60,
    )
    assert response.status_code == 400
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/completions",
        json={"model": "tiny", "prompt": [1, 2, 10**9]},
        timeout=60,
    )
    assert response.status_code == 400
    assert "outside the vocabulary" in response.json()["error"]["message"]


async def test_sleep_refuses_requests_with_503_and_wake_up_serves_them_again(
    tiny_engine: RunningEngine,
) -> None:
    before = _ids(_greedy(tiny_engine, "Before sleeping.", 6).choices[0])
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
    assert _ids(_greedy(tiny_engine, "Before sleeping.", 6).choices[0]) == before


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


def test_with_an_api_key_every_v1_route_needs_it(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    engine = start_engine(
        tiny_model_path, "locked", tmp_path_factory.mktemp("locked"), api_key="engine-secret"
    )
    try:
        with pytest.raises(openai.AuthenticationError):
            engine.openai(api_key="wrong").chat.completions.create(
                model="locked", messages=MESSAGES
            )
        assert httpx.get(f"{engine.base_url}/v1/models", timeout=30).status_code == 401
        assert httpx.get(f"{engine.base_url}/health", timeout=30).status_code == 200
        models = engine.openai().models.list()
        assert [m.id for m in models.data] == ["locked"]
        response = engine.openai().chat.completions.create(
            model="locked", messages=MESSAGES, max_tokens=2
        )
        assert response.choices[0].message.content is not None
    finally:
        engine.process.stop()


def test_return_token_ids_gives_the_prompt_and_sampled_ids_as_vllm_does(
    tiny_engine: RunningEngine, tokenizer: Any
) -> None:
    prompt = tokenizer(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    options = {"return_token_ids": True, "return_tokens_as_token_ids": True, **NO_EOS}
    chat = tiny_engine.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=5, n=2, logprobs=True, extra_body=options
    )
    assert chat.model_extra["prompt_token_ids"] == prompt  # type: ignore[index]
    for choice in chat.choices:
        assert choice.model_extra["token_ids"] == _ids(choice)  # type: ignore[index]

    chunks = list(
        tiny_engine.openai().chat.completions.create(
            model="tiny",
            messages=MESSAGES,
            max_tokens=5,
            logprobs=True,
            stream=True,
            seed=1,
            extra_body=options,
        )
    )
    assert chunks[0].model_extra["prompt_token_ids"] == prompt  # type: ignore[index]
    assert all(chunk.model_extra.get("prompt_token_ids") is None for chunk in chunks[1:])  # type: ignore[union-attr]
    streamed = [t for c in chunks for ch in c.choices for t in (ch.model_extra["token_ids"] or [])]  # type: ignore[index]
    listed = [
        int(e.token.split(":")[1])
        for c in chunks
        for ch in c.choices
        for e in (ch.logprobs.content if ch.logprobs else [])
    ]  # type: ignore[union-attr]
    assert streamed == listed and len(streamed) == 5

    completion = tiny_engine.openai().completions.create(
        model="tiny", prompt="Once upon", max_tokens=3, n=2, extra_body=options
    )
    for choice in completion.choices:
        assert choice.model_extra["prompt_token_ids"] == tokenizer("Once upon").input_ids  # type: ignore[index]
        assert len(choice.model_extra["token_ids"]) == 3  # type: ignore[index]

    plain = tiny_engine.openai().chat.completions.create(
        model="tiny", messages=MESSAGES, max_tokens=2, extra_body=NO_EOS
    )
    assert plain.model_extra.get("prompt_token_ids") is None  # type: ignore[union-attr]

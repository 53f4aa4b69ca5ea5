"""One engine contract, two engines: the HTTP behaviour the worker and the gateway rely on.

Every test here runs against skytrain's CPU engine (the tiny random model; SmolLM2 for the
tests whose answers must make sense, marked slow) and against real vLLM (its CPU build serving
SmolLM2, started by skytrain's launcher; marked ``vllm``: only ``scripts/test-vllm.sh`` runs
it, a plain pytest run leaves it out). Behaviour of one engine alone stays beside it:
tests/engine/test_cpu_engine.py, test_lora.py, test_smollm2.py (the CPU engine),
tests/engine/test_vllm_cpu.py (vLLM).

What differs between the two, by design or by vLLM's choice, is said where a test meets it:
vLLM computes in bfloat16 on CPU (the CPU engine in float32), so "the same answer" allows
bf16 noise there; vLLM caps max_tokens at what the context leaves (the CPU engine refuses);
vLLM's sleep on CPU pauses the scheduler and frees nothing.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from transformers import AutoTokenizer

from skytrain_backend.errors import EngineError
from tests.engine.conftest import RunningEngine, sampled_ids, start_engine
from tests.engine.conversations import TOOLS, WEATHER_CONVERSATION

MESSAGES: list[Any] = [{"role": "user", "content": "Say something."}]
CAPITAL: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
# The tiny model rarely samples its end-of-turn token; these tests want exact lengths.
NO_EOS = {"ignore_eos": True}
TOKEN_IDS = {"return_tokens_as_token_ids": True}
# Two answers "the same" up to the order of floating-point operations: float32 on the CPU
# engine; vLLM on CPU computes in bfloat16 (8 bits of mantissa: a logprob near -5 is only
# known to about 2**-8 * 5 ~ 0.02), and its batches differ from one request to the next.
LOGPROB_NOISE = {"cpu": 1e-4, "vllm": 0.05}


@pytest.fixture(scope="module", params=["cpu", pytest.param("vllm", marks=pytest.mark.vllm)])
def engine(request: pytest.FixtureRequest) -> RunningEngine:
    """The CPU engine on the tiny model, or vLLM on SmolLM2 (it takes no head size of 16)."""
    fixture = "tiny_engine" if request.param == "cpu" else "vllm_engine"
    return request.getfixturevalue(fixture)  # type: ignore[no-any-return]


@pytest.fixture(
    scope="module",
    params=[
        pytest.param("cpu", marks=pytest.mark.slow),
        pytest.param("vllm", marks=pytest.mark.vllm),
    ],
)
def sensible_engine(request: pytest.FixtureRequest) -> RunningEngine:
    """An engine serving SmolLM2, for answers that have to make sense."""
    fixture = "smollm2_engine" if request.param == "cpu" else "vllm_engine"
    return request.getfixturevalue(fixture)  # type: ignore[no-any-return]


@pytest.fixture(scope="module", params=["cpu", pytest.param("vllm", marks=pytest.mark.vllm)])
def locked_engine(
    request: pytest.FixtureRequest,
    tiny_model_path: Path,
    tmp_path_factory: pytest.TempPathFactory,
) -> Any:
    """An engine that requires its API key (vLLM's test engine always does, as a worker's)."""
    if request.param == "vllm":
        yield request.getfixturevalue("vllm_engine")
        return
    engine = start_engine(
        tiny_model_path, "locked", tmp_path_factory.mktemp("locked"), api_key="engine-secret"
    )
    yield engine
    engine.process.stop()


@cache
def _tokenizer(path: Path) -> Any:
    return AutoTokenizer.from_pretrained(path)


def tokenizer_of(engine: RunningEngine) -> Any:
    assert engine.model_path is not None
    return _tokenizer(engine.model_path)


def _greedy(
    engine: RunningEngine, model: str | None = None, *, content: str = "Say something.", n: int = 8
) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs: a fingerprint of the weights that served them."""
    response = engine.openai().chat.completions.create(
        model=model or engine.name,
        messages=[{"role": "user", "content": content}],
        max_tokens=n,
        temperature=0,
        logprobs=True,
        extra_body={**TOKEN_IDS, **NO_EOS},
    )
    content_logprobs = response.choices[0].logprobs.content
    return sampled_ids(response.choices[0]), [e.logprob for e in content_logprobs]


def _same(
    engine: RunningEngine, a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]
) -> bool:
    """Same tokens with logprobs equal up to the engine's noise."""
    noise = LOGPROB_NOISE[engine.kind]
    return a[0] == b[0] and all(abs(x - y) < noise for x, y in zip(a[1], b[1], strict=True))


def _model_ids(engine: RunningEngine) -> list[str]:
    return [m.id for m in engine.openai().models.list().data]


# --- chat completions and completions --------------------------------------------------------


def test_chat_completion_is_a_valid_openai_response_with_exact_usage(
    engine: RunningEngine,
) -> None:
    response = engine.openai().chat.completions.create(
        model=engine.name, messages=MESSAGES, max_tokens=7, logprobs=True, extra_body=NO_EOS
    )
    assert response.id.startswith("chatcmpl-")
    assert response.object == "chat.completion"
    assert response.model == engine.name
    [choice] = response.choices
    assert choice.index == 0
    assert choice.finish_reason == "length"
    assert choice.message.role == "assistant"
    assert isinstance(choice.message.content, str)
    tokenizer = tokenizer_of(engine)
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    assert response.usage is not None
    assert response.usage.prompt_tokens == len(
        tokenizer(prompt, add_special_tokens=False).input_ids
    )
    assert response.usage.completion_tokens == 7 == len(choice.logprobs.content)
    assert response.usage.total_tokens == response.usage.prompt_tokens + 7


def test_logprob_token_ids_decode_to_the_returned_text_and_bytes_are_the_tokens_text(
    engine: RunningEngine,
) -> None:
    response = engine.openai().chat.completions.create(
        model=engine.name,
        messages=MESSAGES,
        max_tokens=12,
        temperature=0,
        logprobs=True,
        top_logprobs=3,
        extra_body={**TOKEN_IDS, **NO_EOS},
    )
    [choice] = response.choices
    ids = sampled_ids(choice)
    assert len(ids) == 12
    tokenizer = tokenizer_of(engine)
    assert tokenizer.decode(ids, skip_special_tokens=True) == choice.message.content
    for token_id, entry in zip(ids, choice.logprobs.content, strict=True):
        assert entry.logprob <= 0
        assert len(entry.top_logprobs) == 3
        assert all(top.token.startswith("token_id:") for top in entry.top_logprobs)
        # Greedy: the sampled token is the most likely one, with the same logprob.
        assert entry.top_logprobs[0].token == entry.token
        assert entry.top_logprobs[0].logprob == pytest.approx(entry.logprob)
        # As in vLLM (and OpenAI): bytes are the token's own text, not its "token_id:" name.
        assert bytes(entry.bytes).decode() == tokenizer.decode([token_id])


def test_without_token_ids_logprob_tokens_are_the_token_texts(engine: RunningEngine) -> None:
    response = engine.openai().chat.completions.create(
        model=engine.name,
        messages=MESSAGES,
        max_tokens=6,
        temperature=0,
        logprobs=True,
        extra_body=NO_EOS,
    )
    [choice] = response.choices
    assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content


def test_streaming_sends_the_same_tokens_as_a_plain_request_and_a_final_usage_chunk(
    engine: RunningEngine,
) -> None:
    plain = _greedy(engine, content="Stream this.", n=9)
    stream = engine.openai().chat.completions.create(
        model=engine.name,
        messages=[{"role": "user", "content": "Stream this."}],
        max_tokens=9,
        temperature=0,
        logprobs=True,
        stream=True,
        stream_options={"include_usage": True},
        extra_body={**TOKEN_IDS, **NO_EOS},
    )
    chunks = list(stream)
    assert len({chunk.id for chunk in chunks}) == 1
    assert chunks[0].choices[0].delta.role == "assistant"
    content_chunks = [c for c in chunks if c.choices]
    ids = [
        int(entry.token.removeprefix("token_id:"))
        for c in content_chunks
        if c.choices[0].logprobs
        for entry in c.choices[0].logprobs.content
    ]
    assert ids == plain[0]
    text = "".join(c.choices[0].delta.content or "" for c in content_chunks)
    assert text == tokenizer_of(engine).decode(ids, skip_special_tokens=True)
    assert content_chunks[-1].choices[0].finish_reason == "length"
    assert not chunks[-1].choices
    assert chunks[-1].usage is not None
    assert chunks[-1].usage.completion_tokens == 9


def test_n_choices_are_distinct_and_a_seed_repeats_their_draws(engine: RunningEngine) -> None:
    """A seed repeats the random draws; on vLLM the logits they are drawn from differ by bf16
    noise between two runs (other batches, cached prefixes), so a near-tie may flip a later
    token: every choice starts alike. (The CPU engine repeats them exactly:
    tests/engine/test_cpu_engine.py.)"""

    def sample() -> Any:
        return engine.openai().chat.completions.create(
            model=engine.name,
            messages=MESSAGES,
            max_tokens=8,
            n=4,
            seed=1234,
            temperature=1.0,
            logprobs=True,
            extra_body={**TOKEN_IDS, **NO_EOS},
        )

    first, second = sample(), sample()
    assert [c.index for c in first.choices] == [0, 1, 2, 3]
    samples = [sampled_ids(c) for c in first.choices]
    assert len({tuple(s) for s in samples}) == 4
    assert [sampled_ids(c)[:2] for c in second.choices] == [s[:2] for s in samples]
    assert first.usage.completion_tokens == 32


def test_a_stop_string_ends_the_text_before_it_and_is_reported(engine: RunningEngine) -> None:
    reference = engine.openai().chat.completions.create(
        model=engine.name,
        messages=[{"role": "user", "content": "Stop somewhere."}],
        max_tokens=12,
        temperature=0,
        logprobs=True,
        extra_body={**TOKEN_IDS, **NO_EOS},
    )
    text = reference.choices[0].message.content
    stop = text[len(text) // 2 : len(text) // 2 + 3]
    response = engine.openai().chat.completions.create(
        model=engine.name,
        messages=[{"role": "user", "content": "Stop somewhere."}],
        max_tokens=12,
        temperature=0,
        stop=[stop],
        logprobs=True,
        extra_body={**TOKEN_IDS, **NO_EOS},
    )
    [choice] = response.choices
    assert choice.finish_reason == "stop"
    assert choice.model_extra["stop_reason"] == stop
    assert choice.message.content == text[: text.index(stop)]
    ids = sampled_ids(choice)
    assert 0 < len(ids) < 12
    assert ids == sampled_ids(reference.choices[0])[: len(ids)]  # the tokens sampled up to the stop


def test_completions_accept_text_token_ids_and_several_prompts(engine: RunningEngine) -> None:
    client = engine.openai()
    ids = tokenizer_of(engine)("Once upon a time").input_ids
    by_ids = client.completions.create(
        model=engine.name, prompt=ids, max_tokens=5, temperature=0, logprobs=2, extra_body=NO_EOS
    )
    by_text = client.completions.create(
        model=engine.name, prompt="Once upon a time", max_tokens=5, temperature=0, extra_body=NO_EOS
    )
    assert by_ids.id.startswith("cmpl-")
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(ids)
    logprobs = by_ids.choices[0].logprobs
    assert "".join(logprobs.tokens) == by_ids.choices[0].text
    assert len(logprobs.token_logprobs) == 5
    assert all(len(top) >= 2 for top in logprobs.top_logprobs)

    several = client.completions.create(
        model=engine.name,
        prompt=["One", "Two words"],
        n=2,
        max_tokens=4,
        seed=3,
        extra_body=NO_EOS,
    )
    assert [c.index for c in several.choices] == [0, 1, 2, 3]
    assert several.usage.completion_tokens == 16


def test_streamed_completion_concatenates_to_the_plain_one(engine: RunningEngine) -> None:
    client = engine.openai()
    plain = client.completions.create(
        model=engine.name, prompt="Hello", max_tokens=6, temperature=0, extra_body=NO_EOS
    )
    chunks = list(
        client.completions.create(
            model=engine.name,
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


def test_return_token_ids_gives_the_prompt_and_sampled_ids(engine: RunningEngine) -> None:
    tokenizer = tokenizer_of(engine)
    prompt = tokenizer(
        tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False),
        add_special_tokens=False,
    ).input_ids
    options = {"return_token_ids": True, **TOKEN_IDS, **NO_EOS}
    chat = engine.openai().chat.completions.create(
        model=engine.name, messages=MESSAGES, max_tokens=5, n=2, logprobs=True, extra_body=options
    )
    assert chat.model_extra["prompt_token_ids"] == prompt  # type: ignore[index]
    for choice in chat.choices:
        assert choice.model_extra["token_ids"] == sampled_ids(choice)  # type: ignore[index]

    chunks = list(
        engine.openai().chat.completions.create(
            model=engine.name,
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
    streamed = [
        t for c in chunks for ch in c.choices for t in (ch.model_extra.get("token_ids") or [])
    ]  # type: ignore[union-attr]
    listed = [
        int(e.token.split(":")[1])
        for c in chunks
        for ch in c.choices
        for e in (ch.logprobs.content if ch.logprobs else [])
    ]  # type: ignore[union-attr]
    assert streamed == listed and len(streamed) == 5

    completion = engine.openai().completions.create(
        model=engine.name, prompt="Once upon", max_tokens=3, n=2, extra_body=options
    )
    for choice in completion.choices:
        assert choice.model_extra["prompt_token_ids"] == tokenizer("Once upon").input_ids  # type: ignore[index]
        assert len(choice.model_extra["token_ids"]) == 3  # type: ignore[index]

    plain = engine.openai().chat.completions.create(
        model=engine.name, messages=MESSAGES, max_tokens=2, extra_body=NO_EOS
    )
    assert plain.model_extra.get("prompt_token_ids") is None  # type: ignore[union-attr]


# --- errors ----------------------------------------------------------------------------------


def test_a_prompt_longer_than_the_context_is_a_400_and_the_engine_keeps_serving(
    engine: RunningEngine,
) -> None:
    """(A max_tokens beyond what the context leaves: the CPU engine refuses it, vLLM 0.32
    serves up to the context's end; tests/engine/test_cpu_engine.py.)"""
    with pytest.raises(openai.BadRequestError) as raised:
        engine.openai().chat.completions.create(
            model=engine.name,
            messages=[{"role": "user", "content": "word " * 2000}],
            max_tokens=1,
        )
    assert f"maximum context length is {engine.max_model_len} tokens" in raised.value.message
    assert _greedy(engine, content="Still there?", n=3)[0]


def test_unknown_model_is_an_openai_style_404(engine: RunningEngine) -> None:
    with pytest.raises(openai.NotFoundError) as raised:
        engine.openai().chat.completions.create(model="gpt-5", messages=MESSAGES)
    body = raised.value.body
    assert isinstance(body, dict)
    assert "gpt-5" in body["message"]
    assert body["code"] == 404


def test_invalid_json_and_out_of_vocabulary_prompts_are_400s(engine: RunningEngine) -> None:
    auth = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    response = httpx.post(
        f"{engine.base_url}/v1/completions",
        content=b"{not json",
        headers={"content-type": "application/json", **auth},
        timeout=60,
    )
    assert response.status_code == 400
    response = httpx.post(
        f"{engine.base_url}/v1/completions",
        json={"model": engine.name, "prompt": [1, 2, 10**9]},
        headers=auth,
        timeout=60,
    )
    assert response.status_code == 400
    assert "vocabulary" in response.json()["error"]["message"]


def test_with_an_api_key_every_v1_route_needs_it(locked_engine: RunningEngine) -> None:
    engine = locked_engine
    with pytest.raises(openai.AuthenticationError):
        engine.openai(api_key="wrong").chat.completions.create(model=engine.name, messages=MESSAGES)
    assert httpx.get(f"{engine.base_url}/v1/models", timeout=30).status_code == 401
    unloaded = httpx.post(
        f"{engine.base_url}/v1/load_lora_adapter",
        json={"lora_name": "x", "lora_path": "/x"},
        timeout=30,
    )
    assert unloaded.status_code == 401
    assert httpx.get(f"{engine.base_url}/health", timeout=30).status_code == 200
    assert _model_ids(engine) == [engine.name]
    response = engine.openai().chat.completions.create(
        model=engine.name, messages=MESSAGES, max_tokens=2
    )
    assert response.choices[0].message.content is not None


# --- sleep -----------------------------------------------------------------------------------


async def test_sleep_and_wake_up_are_reported_and_the_answers_do_not_change(
    engine: RunningEngine,
) -> None:
    """(What a sleeping engine does with a request differs: the CPU engine answers 503,
    vLLM holds it until wake_up; on CPU vLLM frees nothing either way.)"""
    before = _greedy(engine, content="Before sleeping.", n=6)
    async with engine.client() as client:
        assert not await client.is_sleeping()
        await client.sleep(mode="wait")
        try:
            assert await client.is_sleeping()
            assert await client.health()
        finally:
            await client.wake_up()
        assert not await client.is_sleeping()
    assert _same(engine, _greedy(engine, content="Before sleeping.", n=6), before)


# --- LoRA adapters ---------------------------------------------------------------------------


async def test_adapters_load_at_runtime_and_serve_beside_the_base_model(
    engine: RunningEngine, make_adapter: Callable[..., Path]
) -> None:
    assert engine.model_path is not None
    first = make_adapter(engine.model_path, seed=1)
    second = make_adapter(
        engine.model_path, seed=2, rank=8, target_modules=("q_proj", "o_proj", "up_proj")
    )
    base = _greedy(engine)
    async with engine.client() as client:
        await client.load_lora("hot-first", str(first))
        await client.load_lora("hot-second", str(second))
        try:
            assert _model_ids(engine) == [engine.name, "hot-first", "hot-second"]
            names = (engine.name, "hot-first", "hot-second")
            outputs = {name: _greedy(engine, name) for name in names}
            assert _same(engine, outputs[engine.name], base)
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    assert not _same(engine, outputs[a], outputs[b]), (a, b)

            await client.unload_lora("hot-first")
            assert not await client.is_serving("hot-first")
            with pytest.raises(openai.NotFoundError):
                _greedy(engine, "hot-first")
            assert _same(engine, _greedy(engine, "hot-second"), outputs["hot-second"])
            assert _same(engine, _greedy(engine), base)
        finally:
            for name in ("hot-first", "hot-second"):
                if await client.is_serving(name):
                    await client.unload_lora(name)
    assert _model_ids(engine) == [engine.name]


async def test_reloading_a_name_needs_load_inplace_and_then_serves_the_new_weights(
    engine: RunningEngine, make_adapter: Callable[..., Path]
) -> None:
    assert engine.model_path is not None
    old, new = make_adapter(engine.model_path, seed=31), make_adapter(engine.model_path, seed=32)
    async with engine.client() as client:
        await client.load_lora("step", str(old))
        try:
            old_output = _greedy(engine, "step")
            with pytest.raises(EngineError, match="already been loaded"):
                await client.load_lora("step", str(new))
            assert _same(engine, _greedy(engine, "step"), old_output)
            await client.load_lora("step", str(new), replace=True)
            new_output = _greedy(engine, "step")
            assert not _same(engine, new_output, old_output)
            await client.load_lora("step-again", str(new))
            assert _same(engine, _greedy(engine, "step-again"), new_output)
            await client.unload_lora("step-again")
        finally:
            await client.unload_lora("step")


async def test_a_missing_adapter_is_refused_and_changes_nothing(
    engine: RunningEngine, make_adapter: Callable[..., Path], tmp_path: Path
) -> None:
    """(The CPU engine answers 400 and names what is wrong with the files,
    tests/engine/test_lora.py; vLLM 0.32 answers 404 "No adapter found for <path>", the path
    left out.)"""
    assert engine.model_path is not None
    good = make_adapter(engine.model_path, seed=21)
    async with engine.client() as client:
        await client.load_lora("kept", str(good))
        try:
            kept = _greedy(engine, "kept")
            with pytest.raises(EngineError, match=r"load_lora_adapter \((400|404)\)"):
                await client.load_lora("broken", str(tmp_path / "does-not-exist"))
            assert _model_ids(engine) == [engine.name, "kept"]
            assert _same(engine, _greedy(engine, "kept"), kept)
            with pytest.raises(openai.NotFoundError):
                _greedy(engine, "broken")
        finally:
            await client.unload_lora("kept")


def test_unloading_an_unknown_adapter_is_a_404(engine: RunningEngine) -> None:
    auth = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    response = httpx.post(
        f"{engine.base_url}/v1/unload_lora_adapter",
        json={"lora_name": "never-loaded"},
        headers=auth,
        timeout=60,
    )
    assert response.status_code == 404
    assert "never-loaded" in response.json()["error"]["message"]


async def test_verify_adapter_accepts_a_trained_adapter_and_refuses_a_no_op(
    engine: RunningEngine, make_adapter: Callable[..., Path]
) -> None:
    assert engine.model_path is not None
    trained = make_adapter(engine.model_path, seed=41)
    no_op = make_adapter(engine.model_path, seed=42, no_op=True)
    async with engine.client() as client:
        await client.load_lora("trained", str(trained))
        await client.load_lora("no-op", str(no_op))
        try:
            await client.verify_adapter("trained", engine.name, "Hello there")
            with pytest.raises(EngineError, match="answers exactly like the base model"):
                await client.verify_adapter("no-op", engine.name, "Hello there")
            with pytest.raises(EngineError, match="404"):
                await client.verify_adapter("absent", engine.name, "Hello there")
        finally:
            await client.unload_lora("trained")
            await client.unload_lora("no-op")


# --- answers that make sense (SmolLM2) -------------------------------------------------------


def test_a_greedy_answer_makes_sense_and_its_eos_token_closes_the_logprobs(
    sensible_engine: RunningEngine,
) -> None:
    engine = sensible_engine
    response = engine.openai().chat.completions.create(
        model=engine.name,
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
    ids = sampled_ids(choice)
    tokenizer = tokenizer_of(engine)
    # The end-of-turn token that stopped generation is the last sampled token, with its
    # logprob, but its text is not part of the message.
    assert tokenizer.convert_ids_to_tokens(ids[-1]) == "<|im_end|>"
    assert tokenizer.decode(ids[:-1]) == choice.message.content
    assert response.usage.completion_tokens == len(ids)
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)


def test_streaming_gives_the_same_answer_token_by_token(sensible_engine: RunningEngine) -> None:
    engine = sensible_engine
    client = engine.openai()
    plain = client.chat.completions.create(
        model=engine.name, messages=CAPITAL, temperature=0, max_tokens=40
    )
    chunks = list(
        client.chat.completions.create(
            model=engine.name,
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


def test_tool_call_round_trip(sensible_engine: RunningEngine) -> None:
    engine = sensible_engine
    client = engine.openai()
    first = client.chat.completions.create(
        model=engine.name, messages=WEATHER_CONVERSATION, tools=TOOLS, temperature=0, max_tokens=40
    )
    [choice] = first.choices
    assert choice.finish_reason == "tool_calls"
    assert not choice.message.content
    [call] = choice.message.tool_calls
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris"}

    conversation = [
        *WEATHER_CONVERSATION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": "sunny, 25 C"},
    ]
    second = client.chat.completions.create(
        model=engine.name, messages=conversation, tools=TOOLS, temperature=0, max_tokens=40
    )
    [answer] = second.choices
    assert answer.finish_reason == "stop"
    assert not answer.message.tool_calls
    assert "sunny" in answer.message.content.lower()


def test_a_streamed_tool_call_arrives_as_a_tool_call_delta(sensible_engine: RunningEngine) -> None:
    engine = sensible_engine
    chunks = list(
        engine.openai().chat.completions.create(
            model=engine.name,
            messages=WEATHER_CONVERSATION,
            tools=TOOLS,
            temperature=0,
            max_tokens=40,
            stream=True,
        )
    )
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert not "".join(d.content or "" for d in deltas).strip()  # no <tool_call> text leaks
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert calls and all(call.index == 0 for call in calls)
    assert calls[0].function.name == "get_weather"
    arguments = "".join(call.function.arguments or "" for call in calls)
    assert json.loads(arguments) == {"city": "Paris"}
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_n_sampled_answers_differ_and_their_ids_decode_to_their_text(
    sensible_engine: RunningEngine,
) -> None:
    engine = sensible_engine
    response = engine.openai().chat.completions.create(
        model=engine.name,
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
    tokenizer = tokenizer_of(engine)
    for choice in response.choices:
        ids = sampled_ids(choice)
        if choice.finish_reason == "stop":
            ids = ids[:-1]
        assert tokenizer.decode(ids) == choice.message.content
    assert response.usage.completion_tokens == sum(
        len(c.logprobs.content) for c in response.choices
    )

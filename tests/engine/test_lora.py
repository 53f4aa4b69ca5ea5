"""LoRA adapters loaded into a running CPU engine, served by name beside the base model.

Adapters are made in the tests with peft (random non-zero weights, ``save_pretrained``), the
same files the trainer writes. Each test loads adapters under its own names and unloads them.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import httpx
import openai
import pytest
import torch
from peft import PeftModel
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    GPT2Config,
    GPT2LMHeadModel,
    LlamaConfig,
    LlamaForCausalLM,
)

from skytrain_backend.errors import EngineError
from tests.engine.conftest import RunningEngine

PROMPT = [{"role": "user", "content": "Which adapter are you?"}]


def _greedy(
    engine: RunningEngine, model: str, max_tokens: int = 8
) -> tuple[list[int], list[float]]:
    """Greedy token ids and their logprobs: a fingerprint of the weights that served them."""
    response = engine.openai().chat.completions.create(
        model=model,
        messages=PROMPT,
        max_tokens=max_tokens,
        temperature=0,
        logprobs=True,
        extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
    )
    content = response.choices[0].logprobs.content
    return [int(e.token.removeprefix("token_id:")) for e in content], [e.logprob for e in content]


def _greedy_ids(engine: RunningEngine, model: str, max_tokens: int = 8) -> list[int]:
    return _greedy(engine, model, max_tokens)[0]


def _same(a: tuple[list[int], list[float]], b: tuple[list[int], list[float]]) -> bool:
    """Same tokens with logprobs equal up to batching noise."""
    return a[0] == b[0] and all(abs(x - y) < 1e-4 for x, y in zip(a[1], b[1], strict=True))


def _model_ids(engine: RunningEngine) -> list[str]:
    return [m.id for m in engine.openai().models.list().data]


async def test_adapters_load_at_runtime_and_serve_beside_the_base_model(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    first = make_adapter(tiny_model_path, seed=1)
    second = make_adapter(
        tiny_model_path, seed=2, rank=8, target_modules=("q_proj", "o_proj", "up_proj")
    )
    third = make_adapter(tiny_model_path, seed=3)
    base = _greedy(tiny_engine, "tiny")
    async with tiny_engine.client() as client:
        await client.load_lora("hot-first", str(first))
        await client.load_lora("hot-second", str(second))
        try:
            assert _model_ids(tiny_engine) == ["tiny", "hot-first", "hot-second"]
            names = ("tiny", "hot-first", "hot-second")
            outputs = {name: _greedy(tiny_engine, name) for name in names}
            assert _same(outputs["tiny"], base)
            for i, a in enumerate(names):
                for b in names[i + 1 :]:
                    assert not _same(outputs[a], outputs[b]), (a, b)

            # A fresh adapter is loaded while the others are mid-request, then served at once.
            aclient = tiny_engine.async_openai()

            async def fingerprint(model: str) -> tuple[list[int], list[float]]:
                response = await aclient.chat.completions.create(
                    model=model,
                    messages=PROMPT,
                    max_tokens=200,
                    temperature=0,
                    logprobs=True,
                    extra_body={"return_tokens_as_token_ids": True, "ignore_eos": True},
                )
                content = response.choices[0].logprobs.content
                ids = [int(e.token.removeprefix("token_id:")) for e in content]
                return ids, [e.logprob for e in content]

            running = [asyncio.create_task(fingerprint(m)) for m in names]
            await asyncio.sleep(0.2)
            await client.load_lora("hot-third", str(third))
            assert await client.is_serving("hot-third")
            third_output = _greedy(tiny_engine, "hot-third")
            long_outputs = await asyncio.gather(*running)
            for name, (ids, logprobs) in zip(names, long_outputs, strict=True):
                # Mixed-adapter batches give each request what it gets alone.
                assert _same((ids[:8], logprobs[:8]), outputs[name]), name
            assert not any(_same(third_output, output) for output in outputs.values())

            await client.unload_lora("hot-first")
            assert not await client.is_serving("hot-first")
            with pytest.raises(openai.NotFoundError):
                _greedy_ids(tiny_engine, "hot-first")
            assert _same(_greedy(tiny_engine, "hot-second"), outputs["hot-second"])
            assert _same(_greedy(tiny_engine, "tiny"), base)
        finally:
            for name in ("hot-first", "hot-second", "hot-third"):
                if await client.is_serving(name):
                    await client.unload_lora(name)
    assert _model_ids(tiny_engine) == ["tiny"]


def test_an_adapter_generates_exactly_what_peft_generates(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(
        tiny_model_path, seed=11, target_modules=("q_proj", "k_proj", "v_proj", "down_proj")
    )
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reference = PeftModel.from_pretrained(model, adapter).eval()
    text = tokenizer.apply_chat_template(PROMPT, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    with torch.inference_mode():
        generated = reference.generate(
            prompt_ids, max_new_tokens=10, do_sample=False, min_new_tokens=10, pad_token_id=0
        )
    expected = generated[0, prompt_ids.shape[1] :].tolist()
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/load_lora_adapter",
        json={"lora_name": "peft-reference", "lora_path": str(adapter)},
        timeout=60,
    )
    assert response.status_code == 200
    try:
        assert _greedy_ids(tiny_engine, "peft-reference", 10) == expected
    finally:
        httpx.post(
            f"{tiny_engine.base_url}/v1/unload_lora_adapter",
            json={"lora_name": "peft-reference"},
            timeout=60,
        )


def _other_architecture_adapter(make_adapter: Callable[..., Path]) -> Path:
    """An adapter for a Llama of another width: same module names, wrong shapes."""
    config = LlamaConfig(
        vocab_size=128,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
    )
    return make_adapter(LlamaForCausalLM(config), seed=5)


@pytest.mark.parametrize(
    "problem", ["missing", "not-an-adapter", "other-architecture", "other-modules"]
)
async def test_a_bad_adapter_is_a_400_and_changes_nothing(
    tiny_engine: RunningEngine,
    tiny_model_path: Path,
    make_adapter: Callable[..., Path],
    tmp_path: Path,
    problem: str,
) -> None:
    good = make_adapter(tiny_model_path, seed=21)
    if problem == "missing":
        path, reason = tmp_path / "does-not-exist", "no LoRA adapter at"
    elif problem == "not-an-adapter":
        path, reason = tiny_model_path, "no LoRA adapter at"
    elif problem == "other-architecture":
        path, reason = _other_architecture_adapter(make_adapter), "does not fit"
    else:
        gpt2 = GPT2LMHeadModel(GPT2Config(n_embd=32, n_layer=2, n_head=2, vocab_size=128))
        path, reason = make_adapter(gpt2, seed=22, target_modules=("c_attn",)), "does not fit"
    async with tiny_engine.client() as client:
        await client.load_lora("kept", str(good))
        try:
            kept = _greedy(tiny_engine, "kept")
            async with httpx.AsyncClient(base_url=tiny_engine.base_url, timeout=60) as http:
                response = await http.post(
                    "/v1/load_lora_adapter", json={"lora_name": "broken", "lora_path": str(path)}
                )
            assert response.status_code == 400
            assert reason in response.json()["error"]["message"]
            assert _model_ids(tiny_engine) == ["tiny", "kept"]
            assert _same(_greedy(tiny_engine, "kept"), kept)
            with pytest.raises(openai.NotFoundError):
                _greedy_ids(tiny_engine, "broken")
        finally:
            await client.unload_lora("kept")


async def test_reloading_a_name_needs_load_inplace_and_then_serves_the_new_weights(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    old, new = make_adapter(tiny_model_path, seed=31), make_adapter(tiny_model_path, seed=32)
    async with tiny_engine.client() as client:
        await client.load_lora("step", str(old))
        try:
            old_output = _greedy(tiny_engine, "step")
            with pytest.raises(EngineError, match="already been loaded"):
                await client.load_lora("step", str(new))
            assert _same(_greedy(tiny_engine, "step"), old_output)
            await client.load_lora("step", str(new), replace=True)
            new_output = _greedy(tiny_engine, "step")
            assert not _same(new_output, old_output)
            await client.load_lora("step-again", str(new))
            assert _same(_greedy(tiny_engine, "step-again"), new_output)
            await client.unload_lora("step-again")
        finally:
            await client.unload_lora("step")


def test_unloading_an_unknown_adapter_is_a_404(tiny_engine: RunningEngine) -> None:
    response = httpx.post(
        f"{tiny_engine.base_url}/v1/unload_lora_adapter",
        json={"lora_name": "never-loaded"},
        timeout=60,
    )
    assert response.status_code == 404
    assert "never-loaded" in response.json()["error"]["message"]
    with pytest.raises(httpx.HTTPStatusError):
        httpx.post(
            f"{tiny_engine.base_url}/v1/load_lora_adapter",
            json={"lora_name": "tiny", "lora_path": "/x"},
            timeout=60,
        ).raise_for_status()


async def test_verify_adapter_accepts_a_trained_adapter_and_refuses_a_no_op(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    trained = make_adapter(tiny_model_path, seed=41)
    no_op = make_adapter(tiny_model_path, seed=42, no_op=True)
    async with tiny_engine.client() as client:
        await client.load_lora("trained", str(trained))
        await client.load_lora("no-op", str(no_op))
        try:
            await client.verify_adapter("trained", "tiny", "Hello there")
            with pytest.raises(EngineError, match="answers exactly like the base model"):
                await client.verify_adapter("no-op", "tiny", "Hello there")
            with pytest.raises(EngineError, match="404"):
                await client.verify_adapter("absent", "tiny", "Hello there")
        finally:
            await client.unload_lora("trained")
            await client.unload_lora("no-op")


async def test_adapters_survive_sleep_and_wake_up(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    adapter = make_adapter(tiny_model_path, seed=51)
    async with tiny_engine.client() as client:
        await client.load_lora("sleeper", str(adapter))
        try:
            before = _greedy(tiny_engine, "sleeper")
            await client.sleep(level=2)
            # The adapter's files may be gone by the time the engine wakes; it keeps a copy.
            for file in adapter.iterdir():
                file.unlink()
            await client.wake_up()
            assert await client.is_serving("sleeper")
            assert _same(_greedy(tiny_engine, "sleeper"), before)
        finally:
            await client.unload_lora("sleeper")

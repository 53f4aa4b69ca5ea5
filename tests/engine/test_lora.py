"""LoRA adapters in the CPU engine beyond the contract it shares with vLLM
(tests/engine/test_engine_contract.py): adapters loaded while requests run and mixed in one
batch, exactly peft's output, a bad adapter named for what is wrong, adapters kept over sleep.

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


async def test_adapters_loaded_while_requests_run_serve_at_once_and_mixed_batches_change_nothing(
    tiny_engine: RunningEngine, tiny_model_path: Path, make_adapter: Callable[..., Path]
) -> None:
    names = ("tiny", "mixed-first", "mixed-second")
    async with tiny_engine.client() as client:
        await client.load_lora("mixed-first", str(make_adapter(tiny_model_path, seed=1)))
        await client.load_lora("mixed-second", str(make_adapter(tiny_model_path, seed=2)))
        try:
            outputs = {name: _greedy(tiny_engine, name) for name in names}
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
            await client.load_lora("mixed-third", str(make_adapter(tiny_model_path, seed=3)))
            assert await client.is_serving("mixed-third")
            third_output = _greedy(tiny_engine, "mixed-third")
            long_outputs = await asyncio.gather(*running)
            for name, (ids, logprobs) in zip(names, long_outputs, strict=True):
                # Mixed-adapter batches give each request what it gets alone.
                assert _same((ids[:8], logprobs[:8]), outputs[name]), name
            assert not any(_same(third_output, output) for output in outputs.values())
        finally:
            for name in ("mixed-first", "mixed-second", "mixed-third"):
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

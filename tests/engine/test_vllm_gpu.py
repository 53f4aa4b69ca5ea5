"""vLLM for real: started by skytrain's launcher, driven by the engine client (needs CUDA).

The same checks the CPU engine passes, against `vllm serve` with SmolLM2: runtime LoRA loading,
logprobs with token ids ending on the end-of-turn token, tool calls through the hermes parser,
sleep and wake-up, unloading.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import pytest

from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import EngineProcess
from skytrain_backend.engine.options import EngineOptions
from tests.engine.conftest import free_port
from tests.engine.conversations import TOOLS, WEATHER_CONVERSATION

pytestmark = pytest.mark.gpu


async def test_vllm_serves_runtime_adapters_logprobs_tool_calls_and_sleeps(
    smollm2_path: Path, make_adapter: Callable[..., Path], tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    import openai

    options = EngineOptions(
        model=str(smollm2_path),
        served_model_name="smollm2",
        port=free_port(),
        api_key="gpu-secret",
        max_model_len=2048,
        gpu_memory_utilization=0.3,
    )
    process = EngineProcess.for_engine(
        options, kind="vllm", log_path=tmp_path / "vllm.log", startup_timeout_s=900
    )
    await process.launch()
    try:
        adapter = make_adapter(smollm2_path, seed=3)
        client = openai.OpenAI(
            base_url=f"{options.base_url}/v1", api_key="gpu-secret", max_retries=0
        )
        async with EngineClient(options.base_url, api_key="gpu-secret") as engine:
            await engine.load_lora("gpu-adapter", str(adapter))
            assert await engine.is_serving("gpu-adapter")
            await engine.verify_adapter("gpu-adapter", "smollm2", "The capital of France is")

            response = client.chat.completions.create(
                model="smollm2",
                messages=[{"role": "user", "content": "What is the capital of France?"}],
                temperature=0,
                max_tokens=40,
                logprobs=True,
                extra_body={"return_tokens_as_token_ids": True},
            )
            [choice] = response.choices
            assert "Paris" in choice.message.content
            ids = [int(e.token.removeprefix("token_id:")) for e in choice.logprobs.content]
            assert choice.finish_reason == "stop"
            assert ids[-1] == 2  # <|im_end|>, as the CPU engine returns it
            assert response.usage.completion_tokens == len(ids)

            tool = client.chat.completions.create(
                model="smollm2",
                messages=WEATHER_CONVERSATION,
                tools=TOOLS,
                temperature=0,
                max_tokens=40,
            )
            [call] = tool.choices[0].message.tool_calls
            assert call.function.name == "get_weather"
            assert json.loads(call.function.arguments) == {"city": "Paris"}

            await engine.sleep()
            await engine.wake_up()
            again = client.chat.completions.create(
                model="gpu-adapter", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
            )
            assert again.choices[0].message.content is not None

            await engine.unload_lora("gpu-adapter")
            assert not await engine.is_serving("gpu-adapter")
            with pytest.raises(openai.NotFoundError):
                client.chat.completions.create(
                    model="gpu-adapter", messages=[{"role": "user", "content": "Hi"}], max_tokens=4
                )
    finally:
        process.stop()

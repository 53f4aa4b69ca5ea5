"""vLLM for real: started by skytrain's launcher, driven by the engine client (needs CUDA).

The same checks the CPU engine passes, against `vllm serve` with SmolLM2: runtime LoRA loading,
logprobs with token ids ending on the end-of-turn token, tool calls through the hermes parser,
sleep and wake-up, unloading; behind the worker's front door, nothing but inference is
reachable. Then a worker's job order on one GPU: vLLM sleeps (giving its memory back), the
trainer loads, trains and saves on that GPU, is released, vLLM wakes and serves the new
adapter. Then the same with Qwen2.5-7B held to an L4's 24 GB (when the model is in the
Hugging Face cache), with the context `skytrain workers plan` computes.

Run by scripts/gpu-check.sh on a CUDA machine.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
import pytest

from skytrain_backend import tls
from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import EngineProcess
from skytrain_backend.engine.options import EngineOptions
from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.worker.frontdoor import FrontDoor
from tests.engine.conversations import TOOLS, WEATHER_CONVERSATION
from tests.fixtures.ports import free_port
from tests.fixtures.tls import serve_tls

GIB = 1024**3


@pytest.fixture(scope="module")
def small_model_path(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A random-weight 2-layer Llama that vLLM's attention kernels take (head size 64), with
    the tiny model's tokenizer: the job-order check needs no sensible text, only real weights
    on the GPU, and it builds without SmolLM2."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_path)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    torch.manual_seed(0)
    directory = tmp_path_factory.mktemp("small-model")
    LlamaForCausalLM(config).to(torch.bfloat16).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory


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

            await engine.sleep(mode="wait")
            assert await engine.is_sleeping()
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

        # Behind the front door: inference with the worker's secret, nothing of dev mode.
        door = FrontDoor(
            engine_url=options.base_url,
            engine_api_key="gpu-secret",
            secret="front-door-secret",
            max_body_bytes=1 << 20,
        )
        with serve_tls(door) as server:
            secret = {"Authorization": "Bearer front-door-secret"}
            body = {"model": "smollm2", "prompt": "Hello", "max_tokens": 2}
            async with httpx.AsyncClient(
                base_url=server.url, verify=tls.pinned_context(server.certificate), timeout=120
            ) as outside:
                answer = await outside.post("/v1/completions", json=body, headers=secret)
                assert answer.status_code == 200
                for path in ("/sleep", "/collective_rpc", "/v1/load_lora_adapter", "/pause"):
                    assert (await outside.post(path, json={}, headers=secret)).status_code == 404
                    assert (await outside.post(path, json={})).status_code == 401
        async with EngineClient(options.base_url, api_key="gpu-secret") as engine:
            assert not await engine.is_sleeping()
    finally:
        process.stop()


async def test_on_one_gpu_vllm_sleeps_while_the_trainer_trains_then_serves_the_new_adapter(
    small_model_path: Path, tmp_path: Path
) -> None:
    pytest.importorskip("vllm")
    import openai
    import torch

    from skytrain_backend.trainer import Trainer

    options = EngineOptions(
        model=str(small_model_path),
        served_model_name="small",
        port=free_port(),
        api_key="gpu-secret",
        max_model_len=2048,
        gpu_memory_utilization=0.5,
    )
    process = EngineProcess.for_engine(
        options, kind="vllm", log_path=tmp_path / "vllm.log", startup_timeout_s=900
    )
    await process.launch()
    try:
        client = openai.OpenAI(
            base_url=f"{options.base_url}/v1", api_key="gpu-secret", max_retries=0
        )
        prompt = [{"role": "user", "content": "Name a colour."}]
        sampled = client.chat.completions.create(
            model="small",
            messages=prompt,
            n=4,
            max_tokens=12,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True},
        )
        group = TrajectoryGroup.model_validate(
            {
                "trajectories": [
                    {"messages_and_choices": [*prompt, c.model_dump(mode="json")], "reward": i}
                    for i, c in enumerate(sampled.choices)
                ]
            }
        )
        async with EngineClient(options.base_url, api_key="gpu-secret") as engine:
            free_awake, total = torch.cuda.mem_get_info()
            await engine.sleep(mode="wait")
            free_asleep, _ = torch.cuda.mem_get_info()
            print(f"vLLM asleep: {(free_asleep - free_awake) / GIB:.1f} GiB given back")
            # Most of what it took (util * total) comes back while it sleeps.
            assert free_asleep - free_awake > 0.5 * options.gpu_memory_utilization * total

            trainer = Trainer.load(str(small_model_path), model_config=ModelConfig(lora_rank=8))
            assert trainer.policy.device.type == "cuda"
            plan = trainer.prepare_rl([group], RLTrainConfig(learning_rate=1e-3))
            steps = list(trainer.run(plan))
            assert steps
            trainer.save(tmp_path / "step1")
            held = torch.cuda.memory_allocated()
            trainer.release()
            print(
                f"trainer released: {held / GIB:.2f} GiB -> {torch.cuda.memory_allocated() / GIB:.2f}"
            )
            assert torch.cuda.memory_allocated() < 0.05 * held
            assert [e["event"] for e in trainer.events][-2:] == ["saved", "released"]

            await engine.wake_up()
            assert not await engine.is_sleeping()
            await engine.load_lora("small@1", str(tmp_path / "step1"))
            await engine.verify_adapter("small@1", "small", "The capital of France is")
            await engine.check_generates("small@1")
    finally:
        process.stop()


L4_BYTES = 23034 * 1024**2  # an L4's memory as CUDA reports it (22.5 GiB)
SEVEN_B = "Qwen/Qwen2.5-7B-Instruct"


def _plan_for_an_l4(model: str) -> dict[str, Any]:
    """What `skytrain workers plan` computes for ``model`` on one L4 (its JSON: no Python API
    is relied on)."""
    skytrain = Path(sys.executable).with_name("skytrain")
    done = subprocess.run(
        [str(skytrain), "workers", "plan", model, "--gpu", "L4:1", "--json"],
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )
    assert done.returncode == 0, f"`skytrain workers plan` failed: {done.stderr[-2000:]}"
    plan: dict[str, Any] = json.loads(done.stdout)
    return plan


async def test_a_7b_model_serves_sleeps_trains_and_wakes_within_an_l4s_memory(
    tmp_path: Path,
) -> None:
    """The claim users care about most: Qwen2.5-7B on a 24 GB L4. vLLM gets the plan's share
    of an L4's memory (whatever this GPU has), the plan's max_model_len, samples, sleeps; the
    trainer, held to what an L4 would have left, takes one step; vLLM wakes and serves the
    LoRA it trained."""
    pytest.importorskip("vllm")
    import openai
    import torch
    from huggingface_hub import snapshot_download
    from huggingface_hub.errors import LocalEntryNotFoundError

    from skytrain_backend.trainer import Trainer

    try:
        model_dir = snapshot_download(SEVEN_B, local_files_only=True)
    except LocalEntryNotFoundError:
        pytest.skip(f"{SEVEN_B} is not in the Hugging Face cache of this machine")
    plan = _plan_for_an_l4(SEVEN_B)
    assert plan["fits"], plan["reason"]
    _, total = torch.cuda.mem_get_info()
    # The plan's utilization is of an L4; here the same bytes are a smaller share.
    utilization = plan["gpu_memory_utilization"] * L4_BYTES / total
    options = EngineOptions(
        model=model_dir,
        served_model_name="qwen7b",
        port=free_port(),
        api_key="gpu-secret",
        max_model_len=int(plan["max_model_len"]),
        gpu_memory_utilization=round(utilization, 4),
        max_lora_rank=8,
    )
    process = EngineProcess.for_engine(
        options, kind="vllm", log_path=tmp_path / "vllm.log", startup_timeout_s=1800
    )
    await process.launch()
    try:
        config = ModelConfig(lora_rank=8)
        client = openai.OpenAI(
            base_url=f"{options.base_url}/v1", api_key="gpu-secret", max_retries=0
        )
        prompt = [{"role": "user", "content": "Name a colour."}]
        async with EngineClient(options.base_url, api_key="gpu-secret") as engine:
            sampled = client.chat.completions.create(
                model="qwen7b",
                messages=prompt,
                n=4,
                max_tokens=16,
                logprobs=True,
                extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
            )
            group = TrajectoryGroup.model_validate(
                {
                    "trajectories": [
                        {"messages_and_choices": [*prompt, c.model_dump(mode="json")], "reward": i}
                        for i, c in enumerate(sampled.choices)
                    ]
                }
            )
            await engine.sleep(mode="wait")
            asleep_free, _ = torch.cuda.mem_get_info()
            held_asleep = total - asleep_free
            print(f"\nvLLM asleep holds {held_asleep / GIB:.1f} GiB")
            # The trainer gets what an L4 has left beside the sleeping vLLM.
            torch.cuda.set_per_process_memory_fraction((L4_BYTES - held_asleep) / total)
            try:
                trainer = Trainer.load(model_dir, model_config=config)
                steps = list(trainer.run(trainer.prepare_rl([group], RLTrainConfig())))
                assert steps
                print(f"trainer peak {torch.cuda.max_memory_allocated() / GIB:.1f} GiB")
                trainer.save(tmp_path / "step1")
                trainer.release()
            finally:
                torch.cuda.set_per_process_memory_fraction(1.0)
            await engine.wake_up()
            await engine.load_lora("qwen7b@1", str(tmp_path / "step1"))
            await engine.check_generates("qwen7b@1")
    finally:
        process.stop()

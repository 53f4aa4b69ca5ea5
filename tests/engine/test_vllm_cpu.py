"""Real vLLM (its CPU build) as a worker runs it: started by skytrain's launcher without sleep
mode (its platform has none), behind the worker's front door, serving a LoRA that skytrain's
trainer trained on answers vLLM sampled, with logprobs that agree with the CPU engine's.

Marked ``vllm``: scripts/test-vllm.sh builds vLLM's environment and runs these; a plain
pytest run leaves them out. The rest of what vLLM serves is the contract it shares with the
CPU engine (tests/engine/test_engine_contract.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import httpx
import pytest

from skytrain_backend import tls
from skytrain_backend.engine.vllm import vllm_platform
from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.worker.frontdoor import FrontDoor
from tests.engine.conftest import RunningEngine, vllm_python
from tests.fixtures.tls import serve_tls

pytestmark = [pytest.mark.vllm, pytest.mark.slow]

CAPITAL: list[Any] = [{"role": "user", "content": "What is the capital of France?"}]
SAMPLED = {"return_tokens_as_token_ids": True, "return_token_ids": True}
# vLLM on CPU computes in bfloat16, the CPU engine (and the trainer) in float32. bf16 keeps 8
# significant bits: each rounding is off by up to 2**-9 (0.2 %) of its value. SmolLM2's logits
# run to 20-30, so the last rounding alone moves them by 0.04-0.06, and 30 layers of rounded
# activations add more; a token's logprob moves by at most its logits' error (d logp / d logit
# is 1 - p for its own logit, -p for each other). Measured on 2 cores (2026-12-06): vLLM
# against the CPU engine, the trained LoRA's greedy answer, max 0.126 and mean 0.040 over the
# 20 tokens both sampled alike; vLLM against the trainer over 46 tokens sampled at T=1, max
# 0.145, mean 0.046. The bound is twice the largest difference seen; the same adapter against
# the base model differs by 0.79 on its first token (and the greedy answers part at once).
LOGPROB_TOLERANCE = 0.3
LEARNING_RATE = 2e-2


def test_the_launcher_leaves_out_sleep_mode_where_vllms_platform_has_none(
    vllm_engine: RunningEngine,
) -> None:
    platform = vllm_platform(vllm_python())
    assert (platform.device, platform.sleep_mode) == ("cpu", False)
    assert platform.version.endswith("+cpu")
    command = vllm_engine.process.command
    assert "--enable-sleep-mode" not in command.argv
    assert not command.sleep_frees_memory  # so a worker does not sleep it during jobs


async def test_behind_the_front_door_only_inference_reaches_vllm(
    vllm_engine: RunningEngine,
) -> None:
    door = FrontDoor(
        engine_url=vllm_engine.base_url,
        engine_api_key=vllm_engine.api_key,
        secret="front-door-secret",
        max_body_bytes=1 << 20,
    )
    with serve_tls(door) as server:
        secret = {"Authorization": "Bearer front-door-secret"}
        body = {"model": vllm_engine.name, "prompt": "Hello", "max_tokens": 2}
        async with httpx.AsyncClient(
            base_url=server.url, verify=tls.pinned_context(server.certificate), timeout=120
        ) as outside:
            answer = await outside.post("/v1/completions", json=body, headers=secret)
            assert answer.status_code == 200
            assert answer.json()["usage"]["completion_tokens"] == 2
            for path in ("/sleep", "/collective_rpc", "/v1/load_lora_adapter", "/pause"):
                assert (await outside.post(path, json={}, headers=secret)).status_code == 404
                assert (await outside.post(path, json={})).status_code == 401


def _greedy(engine: RunningEngine, model: str) -> tuple[list[int], list[float], Any]:
    response = engine.openai().chat.completions.create(
        model=model,
        messages=CAPITAL,
        temperature=0,
        max_tokens=24,
        logprobs=True,
        extra_body=SAMPLED,
    )
    [choice] = response.choices
    ids = [int(e.token.removeprefix("token_id:")) for e in choice.logprobs.content]
    assert choice.model_extra["token_ids"] == ids  # type: ignore[index]
    return ids, [e.logprob for e in choice.logprobs.content], response


async def test_vllm_serves_a_lora_skytrain_trained_with_the_cpu_engines_logprobs(
    vllm_engine: RunningEngine,
    smollm2_engine: RunningEngine,
    smollm2_path: Path,
    tmp_path: Path,
) -> None:
    from skytrain_backend.trainer import Trainer

    # Rollouts sampled from vLLM, with the prompt's and the answers' token ids, as the gateway
    # records them for trainable models.
    prompt = [{"role": "user", "content": "Name a colour."}]
    sampled = vllm_engine.openai().chat.completions.create(
        model=vllm_engine.name,
        messages=prompt,
        n=4,
        seed=5,
        temperature=1.0,
        max_tokens=12,
        logprobs=True,
        extra_body=SAMPLED,
    )
    group = TrajectoryGroup.model_validate(
        {
            "trajectories": [
                {"messages_and_choices": [*prompt, c.model_dump(mode="json")], "reward": i}
                for i, c in enumerate(sampled.choices)
            ]
        }
    )
    config = ModelConfig(lora_rank=8)
    trainer = Trainer.load(str(smollm2_path), model_config=config, device="cpu")
    plan = trainer.prepare_rl([group], RLTrainConfig(learning_rate=LEARNING_RATE))
    assert list(trainer.run(plan))
    # Measured in the first step's forward pass, before its update.
    agreement = plan.summary
    print(
        "\ntrainer (fp32) vs vLLM (bf16) on vLLM's samples: max "
        f"{agreement['logprob_agreement/max_abs_diff']:.3f}, mean "
        f"{agreement['logprob_agreement/mean_abs_diff']:.4f} over "
        f"{agreement['logprob_agreement/num_tokens']:.0f} tokens"
    )
    assert agreement["logprob_agreement/num_tokens"] >= 4
    assert agreement["logprob_agreement/max_abs_diff"] < LOGPROB_TOLERANCE
    adapter = tmp_path / "step1"
    trainer.save(adapter)
    trainer.release()

    async with vllm_engine.client() as on_vllm, smollm2_engine.client() as on_cpu:
        await on_vllm.load_lora("trained@1", str(adapter))
        await on_cpu.load_lora("trained@1", str(adapter))
        try:
            await on_vllm.verify_adapter("trained@1", vllm_engine.name, "The capital of France is")
            vllm_ids, vllm_logprobs, response = _greedy(vllm_engine, "trained@1")
            cpu_ids, cpu_logprobs, _ = _greedy(smollm2_engine, "trained@1")
            base_ids, base_logprobs, _ = _greedy(smollm2_engine, smollm2_engine.name)
        finally:
            await on_vllm.unload_lora("trained@1")
            await on_cpu.unload_lora("trained@1")

    assert response.model_extra["prompt_token_ids"]  # type: ignore[index]
    # Greedy answers agree until bf16 noise flips a near-tie (in one run: token 21 of 24);
    # the logprobs are compared where the two engines saw the same tokens.
    shared_prefix = next(
        (i for i, (a, b) in enumerate(zip(vllm_ids, cpu_ids, strict=False)) if a != b),
        min(len(vllm_ids), len(cpu_ids)),
    )
    differences = [
        abs(a - b) for a, b in zip(vllm_logprobs[:shared_prefix], cpu_logprobs, strict=False)
    ]
    print(
        f"vLLM (bf16) vs CPU engine (fp32), trained LoRA, the first {shared_prefix} tokens "
        f"alike: max {max(differences):.3f}, mean {sum(differences) / len(differences):.4f}"
    )
    assert shared_prefix >= 8, (vllm_ids, cpu_ids)
    assert max(differences) < LOGPROB_TOLERANCE
    # The comparison can fail: the trained adapter is not the base model, by more than the
    # tolerance, on the tokens both share.
    shared = [
        abs(a - b)
        for a, b, x, y in zip(cpu_logprobs, base_logprobs, cpu_ids, base_ids, strict=False)
        if x == y
    ]
    assert cpu_ids != base_ids or max(shared) > LOGPROB_TOLERANCE

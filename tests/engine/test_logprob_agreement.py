"""Sampling logprobs from the engine agree with the trainer's recomputation of them.

The trainer's importance ratios divide the policy's probability of each sampled token by the
engine's: if the two disagree, training is off from its first step. Choices sampled from the
engine (SmolLM2, with and without a LoRA adapter) go to ``Trainer.prepare_rl``, which every
training job runs: it trains each turn on the engine's prompt ids and sampled ids and measures
its own logprob of every sampled token against the engine's before the first update (here in
a pass without gradient; a job reads them in its first step's forward pass, which computes the
same).
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.engine.conftest import RunningEngine

pytestmark = pytest.mark.slow

# fp32 on both sides: what is left is the order of floating-point operations (batching,
# padding, attention kernels).
MAX_ABS_DIFF = 1e-3
PROMPTS = [
    [{"role": "user", "content": "Name three colours."}],
    [
        {"role": "system", "content": "You answer in one short sentence."},
        {"role": "user", "content": "Why is the sky blue?"},
    ],
]


def _groups(engine: RunningEngine, model: str) -> list[TrajectoryGroup]:
    groups = []
    for messages in PROMPTS:
        response = engine.openai().chat.completions.create(
            model=model,
            messages=messages,  # type: ignore[arg-type]
            n=3,
            temperature=1.0,
            seed=7,
            max_tokens=24,
            logprobs=True,
            extra_body={"return_tokens_as_token_ids": True, "return_token_ids": True},
        )
        trajectories: list[dict[str, Any]] = [
            {"messages_and_choices": [*messages, choice.model_dump()], "reward": float(i)}
            for i, choice in enumerate(response.choices)
        ]
        groups.append(TrajectoryGroup.model_validate({"trajectories": trajectories}))
    return groups


async def test_engine_logprobs_agree_with_the_trainer(
    smollm2_engine: RunningEngine, smollm2_path: Path, make_adapter: Callable[..., Path]
) -> None:
    config = ModelConfig(lora_rank=4, lora_alpha=8)
    adapter = make_adapter(
        smollm2_path, seed=7, rank=4, target_modules=tuple(config.lora_target_modules)
    )
    async with smollm2_engine.client() as client:
        await client.load_lora("agreement", str(adapter))
        try:
            base_groups = _groups(smollm2_engine, "smollm2")
            adapter_groups = _groups(smollm2_engine, "agreement")
        finally:
            await client.unload_lora("agreement")

    base = Trainer.load(str(smollm2_path), model_config=config, device="cpu")
    base_agreement = base.prepare_rl(base_groups, RLTrainConfig(), separate_pass=True).summary
    del base
    trained = Trainer.load(
        str(smollm2_path),
        model_config=config,
        adapter_dir=adapter,
        device="cpu",
        fresh_optimizer=True,  # an adapter made with peft: no optimizer state to resume
    )
    adapter_agreement = trained.prepare_rl(
        adapter_groups, RLTrainConfig(), separate_pass=True
    ).summary
    for name, agreement in (("base model", base_agreement), ("LoRA adapter", adapter_agreement)):
        print(
            f"\nengine vs trainer, {name}: max {agreement['logprob_agreement/max_abs_diff']:.2e}, "
            f"mean {agreement['logprob_agreement/mean_abs_diff']:.2e}"
        )
        assert agreement["logprob_agreement/num_tokens"] >= 6 * 3  # every choice contributed
        assert agreement["logprob_agreement/max_abs_diff"] < MAX_ABS_DIFF
    # The adapter changes the model: the base model's samples disagree with it, and say so.
    mismatched = trained.prepare_rl(base_groups, RLTrainConfig(), separate_pass=True)
    assert mismatched.summary["logprob_agreement/max_abs_diff"] > 100 * MAX_ABS_DIFF
    assert mismatched.warning is not None

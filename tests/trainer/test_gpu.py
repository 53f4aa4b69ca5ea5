"""The trainer on CUDA: bf16 base weights, fp32 adapter, Unsloth when it is installed."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.fixtures.sampling import sample_choices

pytestmark = pytest.mark.gpu


def test_cuda_training_step_in_bf16_saves_a_loadable_checkpoint(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    trainer = Trainer.load(
        str(tiny_model_path), model_config=ModelConfig(gradient_checkpointing=True)
    )
    policy = trainer.policy
    assert policy.device.type == "cuda"
    assert policy.uses_unsloth == (importlib.util.find_spec("unsloth") is not None)
    assert all(p.dtype == torch.float32 for p in policy.trainable_parameters())
    assert policy.model.get_base_model().get_decoder().embed_tokens.weight.dtype == torch.bfloat16

    prompt = [{"role": "user", "content": "Name a color."}]
    choices = sample_choices(policy.model, policy.tokenizer, prompt, n=4, max_new_tokens=8, seed=0)
    group = TrajectoryGroup.model_validate(
        {
            "trajectories": [
                {"messages_and_choices": [*prompt, c], "reward": float(i)}
                for i, c in enumerate(choices)
            ]
        }
    )
    plan = trainer.prepare_rl([group], RLTrainConfig(learning_rate=1e-2))
    print(f"sampler/learner agreement on CUDA (bf16): {plan.summary}")
    # bf16 kernels with and without a KV cache
    assert plan.summary["logprob_agreement/max_abs_diff"] < 0.1
    assert plan.warning is None

    before = [p.detach().clone() for p in policy.trainable_parameters()]
    steps = list(trainer.run(plan))
    assert steps and all(torch.isfinite(torch.tensor(m["loss/policy"])) for m in steps)
    after = policy.trainable_parameters()
    assert any(not torch.equal(a, b) for a, b in zip(before, after, strict=True))

    trainer.save(tmp_path / "step1")
    assert json.loads((tmp_path / "step1" / "trainer_state.json").read_text())["step"] == 1
    resumed = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(gradient_checkpointing=True),
        adapter_dir=tmp_path / "step1",
    )
    for a, b in zip(after, resumed.policy.trainable_parameters(), strict=True):
        assert torch.equal(a.detach(), b.detach())

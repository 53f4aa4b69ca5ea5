"""The trainer on CUDA: bf16 base weights, fp32 adapter, Unsloth when it is installed; its
memory released for the engine to wake into; out of memory as a job's error, with the GPU left
clean. Run by scripts/gpu-check.sh on a CUDA machine."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from skytrain_backend.errors import OutOfMemory
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
    before = [p.detach().clone() for p in policy.trainable_parameters()]
    steps = list(trainer.run(plan))
    # Read by the step's own forward pass (with gradient), as a job does.
    print(f"sampler/learner agreement on CUDA (bf16): {plan.summary}")
    # bf16 kernels with and without a KV cache
    assert plan.summary["logprob_agreement/max_abs_diff"] < 0.1
    assert plan.warning is None
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
    assert resumed.events[0]["event"] == "loaded"


def test_release_gives_the_gpu_memory_back(tiny_model_path: Path, tmp_path: Path) -> None:
    before = torch.cuda.memory_allocated()
    trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig())
    _train_one_step(trainer)
    trainer.save(tmp_path / "step1")
    assert torch.cuda.memory_allocated() > before
    trainer.release()
    assert torch.cuda.memory_allocated() - before < 1024 * 1024
    with pytest.raises(Exception, match="released"):
        trainer.save(tmp_path / "again")


def test_a_step_past_the_gpus_real_limit_is_an_out_of_memory_error_and_frees_it(
    tiny_model_path: Path,
) -> None:
    """A real CUDA out-of-memory: the caching allocator is capped just above what the loaded
    trainer holds, and a long row's logits do not fit."""
    trainer = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(max_seq_length=4096),
        activation_memory_limit_bytes=1 << 40,  # the estimate lets it through: CUDA decides
    )
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_reserved() + 64 * 1024 * 1024
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        long_group = _group(trainer, max_new_tokens=1024)
        config = RLTrainConfig(learning_rate=1e-3, logprob_calculation_chunk_size=4096)
        # The step runs out (its forward pass also reads the old logprobs).
        with pytest.raises(OutOfMemory, match="out of memory while"):
            list(trainer.run(trainer.prepare_rl([long_group], config)))
        held = torch.cuda.memory_allocated()
        trainer.release()
        assert torch.cuda.memory_allocated() < held
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _group(trainer: Trainer, *, max_new_tokens: int = 8) -> TrajectoryGroup:
    policy = trainer.policy
    prompt = [{"role": "user", "content": "Name a color."}]
    choices = sample_choices(
        policy.model, policy.tokenizer, prompt, n=4, max_new_tokens=max_new_tokens, seed=0
    )
    return TrajectoryGroup.model_validate(
        {
            "trajectories": [
                {"messages_and_choices": [*prompt, c], "reward": float(i)}
                for i, c in enumerate(choices)
            ]
        }
    )


def _train_one_step(trainer: Trainer) -> None:
    plan = trainer.prepare_rl([_group(trainer)], RLTrainConfig(learning_rate=1e-2))
    assert list(trainer.run(plan))

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
from skytrain_backend.protocol.tinker_api import AdamParams
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


@pytest.mark.parametrize("gradient_checkpointing", [False, True])
def test_on_cuda_the_first_steps_own_pass_reads_the_old_logprobs_within_bf16_noise(
    tiny_model_path: Path, gradient_checkpointing: bool
) -> None:
    """On CUDA the first step's forward runs in bf16 with gradients (and, with checkpointing,
    again in the backward pass): its old logprobs and agreement figures match a separate no-grad
    pass within bf16 noise, and both give the same first update."""
    model_config = ModelConfig(gradient_checkpointing=gradient_checkpointing)
    config = RLTrainConfig(learning_rate=1e-2, num_gradient_steps=2)
    results = []
    for separate_pass in (True, False):
        trainer = Trainer.load(str(tiny_model_path), model_config=model_config)
        assert trainer.policy.device.type == "cuda"
        initial = [p.detach().float().clone() for p in trainer.policy.trainable_parameters()]
        groups = [_group(trainer, seed=seed) for seed in range(3)]
        plan = trainer.prepare_rl(groups, config, separate_pass=separate_pass)
        assert plan.agreement_pending is not separate_pass
        steps = list(trainer.run(plan))
        adapter = [p.detach().float().clone() for p in trainer.policy.trainable_parameters()]
        results.append((plan, steps, adapter))
    (separate, separate_steps, separate_adapter), (fused, fused_steps, fused_adapter) = results

    old_diff = max(
        float((f.float() - s.float()).abs().max())
        for f_rows, s_rows in zip(fused.old_logprobs, separate.old_logprobs, strict=True)
        for f, s in zip(f_rows, s_rows, strict=True)
        if f is not None and s is not None
    )
    summary_diff = {
        key: abs(fused.summary[key] - value)
        for key, value in separate.summary.items()
        if key.startswith("logprob_agreement/")
    }
    loss_diff = [
        abs(f["loss/policy"] - s["loss/policy"])
        for f, s in zip(fused_steps, separate_steps, strict=True)
    ]
    adapter_diff = max(
        float((f - s).abs().max()) for f, s in zip(fused_adapter, separate_adapter, strict=True)
    )
    moved = max(float((s - i).abs().max()) for s, i in zip(separate_adapter, initial, strict=True))
    print(
        f"CUDA bf16, checkpointing={gradient_checkpointing}: old logprobs max diff {old_diff:.2e}; "
        f"summary diffs {summary_diff}; loss diffs {loss_diff}; adapter max diff {adapter_diff:.2e}"
    )
    assert fused.summary.keys() == separate.summary.keys()
    assert summary_diff
    assert fused.warning is None and separate.warning is None
    assert old_diff < 0.05  # bf16 logits: a few hundredths of a nat at most
    assert summary_diff["logprob_agreement/max_abs_diff"] < 0.05
    assert all(d < 0.05 for d in loss_diff)
    # Two Adam steps of lr 1e-2 from the same start: the two runs' adapters differ by a small
    # part of how far they moved (on an H200 they were equal, bit for bit).
    assert moved > 0 and adapter_diff <= 0.05 * moved


def test_on_cuda_checkpointing_with_lora_dropout_makes_the_same_update(
    tiny_model_path: Path,
) -> None:
    """The layers run again in the backward pass draw their forward pass's dropout masks
    (Unsloth's own checkpointing would draw new ones: a job with dropout uses transformers')."""
    config = RLTrainConfig(learning_rate=1e-2)
    results = []
    for checkpointing in (False, True):
        model_config = ModelConfig(gradient_checkpointing=checkpointing, lora_dropout=0.3)
        trainer = Trainer.load(str(tiny_model_path), model_config=model_config)
        initial = [p.detach().float().clone() for p in trainer.policy.trainable_parameters()]
        groups = [_group(trainer, seed=seed) for seed in range(3)]
        list(trainer.run(trainer.prepare_rl(groups, config)))
        adapter = [p.detach().float().clone() for p in trainer.policy.trainable_parameters()]
        results.append((initial, adapter))
    (initial, plain), (_, checkpointed) = results
    moved = max(float((p - i).abs().max()) for p, i in zip(plain, initial, strict=True))
    difference = max(float((c - p).abs().max()) for c, p in zip(checkpointed, plain, strict=True))
    print(f"CUDA, LoRA dropout 0.3: checkpointed vs plain max diff {difference:.2e}, moved {moved}")
    assert moved > 0 and difference <= 0.05 * moved


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
    long_group = _group(trainer, max_new_tokens=1024)  # sampled before the cap
    torch.cuda.empty_cache()
    total = torch.cuda.get_device_properties(0).total_memory
    cap = torch.cuda.memory_reserved() + 64 * 1024 * 1024
    torch.cuda.set_per_process_memory_fraction(cap / total)
    try:
        config = RLTrainConfig(learning_rate=1e-3, logprob_calculation_chunk_size=4096)
        # The step runs out (its forward pass also reads the old logprobs).
        with pytest.raises(OutOfMemory, match="out of memory while"):
            list(trainer.run(trainer.prepare_rl([long_group], config)))
        held = torch.cuda.memory_allocated()
        trainer.release()
        assert torch.cuda.memory_allocated() < held
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)


def _group(trainer: Trainer, *, max_new_tokens: int = 8, seed: int = 0) -> TrajectoryGroup:
    policy = trainer.policy
    prompt = [{"role": "user", "content": "Name a color."}]
    choices = sample_choices(
        policy.model, policy.tokenizer, prompt, n=4, max_new_tokens=max_new_tokens, seed=seed
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


def test_offload_frees_the_gpu_and_reload_resumes_with_the_same_state(
    tiny_model_path: Path,
) -> None:
    """A Tinker run's trainer between two operations: in host memory while the engine wakes,
    then back with its gradients and Adam moments as they were."""
    from skytrain_backend.trainer import primitives

    trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig())
    examples = [primitives.Example(tokens=[1, 5, 9, 13], inputs={"target_tokens": [5, 9, 13, 17]})]

    def forward_backward() -> None:
        primitives.forward_backward(
            trainer.policy, examples, loss_fn="cross_entropy", config={}, backward=True
        )

    forward_backward()
    primitives.adam_step(trainer, AdamParams(learning_rate=1e-2))
    forward_backward()  # gradients pending, as between forward_backward and optim_step
    params = trainer.policy.trainable_parameters()
    grads = [p.grad.detach().clone() for p in params if p.grad is not None]
    moments = [
        v.detach().clone()
        for state in trainer.optimizer.state.values()
        for v in state.values()
        if v.dim() > 0
    ]
    held = torch.cuda.memory_allocated()

    trainer.offload()
    assert torch.cuda.memory_allocated() < held / 10
    trainer.reload()
    assert all(p.device.type == "cuda" for p in trainer.policy.model.parameters())
    after_grads = [p.grad for p in params if p.grad is not None]
    assert all(torch.equal(a, b) for a, b in zip(grads, after_grads, strict=True))
    after_moments = [
        v for state in trainer.optimizer.state.values() for v in state.values() if v.dim() > 0
    ]
    assert all(torch.equal(a, b) for a, b in zip(moments, after_moments, strict=True))
    primitives.adam_step(trainer, AdamParams(learning_rate=1e-2))  # steps on

"""The Trainer API the worker uses: load, train_rl, save, resume, agreement, errors."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.fixtures.sampling import sample_choices

QUESTIONS = ["Name a color.", "Count to three.", "Say hello."]


def _groups(
    trainer: Trainer, rewards: list[list[float]], *, seed: int = 0, max_new_tokens: int = 8
) -> list[TrajectoryGroup]:
    """One group per reward list, sampled from the trainer's current policy."""
    groups = []
    for g, group_rewards in enumerate(rewards):
        prompt = [{"role": "user", "content": QUESTIONS[g % len(QUESTIONS)]}]
        choices = sample_choices(
            trainer.policy.model,
            trainer.policy.tokenizer,
            prompt,
            n=len(group_rewards),
            max_new_tokens=max_new_tokens,
            seed=seed + g,
        )
        groups.append(
            TrajectoryGroup.model_validate(
                {
                    "trajectories": [
                        {"messages_and_choices": [*prompt, choice], "reward": reward}
                        for reward, choice in zip(group_rewards, choices, strict=True)
                    ]
                }
            )
        )
    return groups


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: parameter.detach().clone()
        for name, parameter in trainer.policy.model.named_parameters()
        if parameter.requires_grad
    }


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[name], b[name]) for name in a)


def test_fresh_adapter_computes_exactly_the_base_model(
    tiny_trainer: Trainer, tiny_hf_model: Any
) -> None:
    input_ids = torch.tensor([tiny_trainer.policy.tokenizer("Hello there, world")["input_ids"]])
    with torch.no_grad():
        adapted = tiny_trainer.policy.model(input_ids=input_ids).logits
        base = tiny_hf_model(input_ids=input_ids).logits
    assert torch.equal(adapted, base)
    assert tiny_trainer.step == 0


def test_recomputed_logprobs_match_the_sampling_logprobs(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.5, 0.2]] * 3, max_new_tokens=16)
    agreement = tiny_trainer.logprob_agreement(groups)
    print(f"sampler/learner agreement on the tiny model (fp32, CPU): {agreement}")
    assert agreement["num_tokens"] == sum(
        len(item.logprobs.content)
        for group in groups
        for trajectory in group.trajectories
        for item in trajectory.messages_and_choices
        if hasattr(item, "logprobs") and item.logprobs and item.logprobs.content
    )
    assert agreement["max_abs_diff"] < 1e-4


def test_groups_without_reward_variance_change_nothing(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[1.0, 1.0, 1.0], [0.0, 0.0]])
    before = _adapter(tiny_trainer)
    run = tiny_trainer.train_rl(groups, RLTrainConfig(learning_rate=1e-2))
    assert run.num_gradient_steps == 0
    assert run.summary["groups/skipped_zero_variance"] == 2
    assert list(run) == []
    assert _same(before, _adapter(tiny_trainer))
    assert tiny_trainer.step == 1  # the worker still commits the next step


def test_train_rl_updates_the_adapter_and_reports_metrics(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.5], [2.0, 2.0]])
    before = _adapter(tiny_trainer)
    # Short rows: the two groups with a signal take several rows, two rows per step.
    config = RLTrainConfig(
        learning_rate=1e-3, packed_sequence_length=48, grad_accumulation_sequences=2
    )
    run = tiny_trainer.train_rl(groups, config)
    rows = run.summary["packing/rows"]
    assert rows >= 3
    assert run.num_gradient_steps == math.ceil(rows / 2)
    assert run.summary["groups/skipped_zero_variance"] == 1
    assert run.summary["sequences/trained"] == 7
    steps = list(run)
    assert len(steps) == run.num_gradient_steps
    for metrics in steps:
        for key in ("loss/policy", "clip_ratio/low", "clip_ratio/high", "entropy", "grad_norm"):
            assert math.isfinite(metrics[key])
        assert metrics["train/num_trainable_tokens"] > 0
    assert sum(m["train/num_trainable_tokens"] for m in steps) == run.summary["tokens/trainable"]
    assert steps[0]["clip_ratio/low"] == steps[0]["clip_ratio/high"] == 0  # on-policy: ratio 1
    assert not _same(before, _adapter(tiny_trainer))
    assert tiny_trainer.step == 1


def test_kl_penalty_is_zero_until_the_adapter_moves(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.0, 1.0]])
    config = RLTrainConfig(learning_rate=1e-2, kl_penalty_coef=0.5, packed_sequence_length=44)
    steps = list(tiny_trainer.train_rl(groups, config))
    assert len(steps) >= 2
    assert steps[0]["loss/kl"] == 0.0
    assert steps[-1]["loss/kl"] > 0.0
    assert steps[-1]["loss"] == pytest.approx(steps[-1]["loss/policy"] + 0.5 * steps[-1]["loss/kl"])


def test_saved_adapter_loads_in_peft_with_identical_outputs(
    tiny_trainer: Trainer, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    list(
        tiny_trainer.train_rl(
            _groups(tiny_trainer, [[0.0, 1.0, 1.0]]), RLTrainConfig(learning_rate=1e-2)
        )
    )
    tiny_trainer.save(tmp_path / "step1")
    assert sorted(p.name for p in (tmp_path / "step1").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    ]
    base = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    reloaded = PeftModel.from_pretrained(base, tmp_path / "step1").eval()
    tiny_trainer.policy.model.eval()
    input_ids = torch.tensor([tiny_trainer.policy.tokenizer("The sky is blue")["input_ids"]])
    with torch.no_grad():
        expected = tiny_trainer.policy.model(input_ids=input_ids).logits
        assert torch.equal(reloaded(input_ids=input_ids).logits, expected)
        with reloaded.disable_adapter():
            assert not torch.equal(reloaded(input_ids=input_ids).logits, expected)


def test_resumed_training_continues_identically(tiny_model_path: Path, tmp_path: Path) -> None:
    config = RLTrainConfig(learning_rate=1e-2)
    first = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    batches = [_groups(first, [[0.0, 1.0, 0.3]], seed=s) for s in (0, 10)]

    list(first.train_rl(batches[0], config))
    list(first.train_rl(batches[1], config))
    straight = _adapter(first)

    interrupted = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    list(interrupted.train_rl(batches[0], config))
    interrupted.save(tmp_path / "step1")
    resumed = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(),
        adapter_dir=tmp_path / "step1",
        device="cpu",
    )
    assert resumed.step == 1
    list(resumed.train_rl(batches[1], config))
    assert _same(straight, _adapter(resumed))
    assert resumed.step == 2

    # Without the optimizer state the second step would differ: the test can tell.
    (tmp_path / "step1" / "optimizer.pt").unlink()
    forgetful = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(),
        adapter_dir=tmp_path / "step1",
        device="cpu",
    )
    list(forgetful.train_rl(batches[1], config))
    assert not _same(straight, _adapter(forgetful))


def test_loading_an_adapter_of_another_shape_is_refused(
    tiny_trainer: Trainer, tiny_model_path: Path, tmp_path: Path
) -> None:
    tiny_trainer.save(tmp_path / "rank8")
    with pytest.raises(TrainingError, match=r"'r': 8.*'r': 4"):
        Trainer.load(
            str(tiny_model_path),
            model_config=ModelConfig(lora_rank=4),
            adapter_dir=tmp_path / "rank8",
            device="cpu",
        )
    with pytest.raises(TrainingError, match="not a checkpoint directory"):
        Trainer.load(
            str(tiny_model_path), model_config=ModelConfig(), adapter_dir=tmp_path, device="cpu"
        )


def test_train_rl_refuses_choices_without_usable_logprobs(tiny_trainer: Trainer) -> None:
    (group,) = _groups(tiny_trainer, [[0.0, 1.0]])
    raw = group.model_dump(mode="json")
    missing = {**raw["trajectories"][1]["messages_and_choices"][-1], "logprobs": None}
    raw["trajectories"][1]["messages_and_choices"][-1] = missing
    with pytest.raises(TrainingError, match=r"trajectory 1 of group 0.*no logprobs"):
        tiny_trainer.train_rl([TrajectoryGroup.model_validate(raw)], RLTrainConfig())

    raw = group.model_dump(mode="json")
    raw["trajectories"][0]["messages_and_choices"][-1]["logprobs"]["content"][0]["logprob"] = (
        math.nan
    )
    with pytest.raises(TrainingError, match=r"trajectory 0 of group 0.*NaN"):
        tiny_trainer.train_rl([TrajectoryGroup.model_validate(raw)], RLTrainConfig())
    assert tiny_trainer.step == 0


def test_training_without_logprobs_learns_from_plain_assistant_messages(
    tiny_trainer: Trainer,
) -> None:
    prompt = [{"role": "user", "content": "Name a color."}]
    group = TrajectoryGroup.model_validate(
        {
            "trajectories": [
                {
                    "messages_and_choices": [*prompt, {"role": "assistant", "content": text}],
                    "reward": r,
                }
                for text, r in (("Blue.", 1.0), ("I cannot say.", 0.0))
            ]
        }
    )
    with pytest.raises(TrainingError, match="allow_training_without_logprobs=True"):
        tiny_trainer.train_rl([group], RLTrainConfig())
    before = _adapter(tiny_trainer)
    run = tiny_trainer.train_rl(
        [group], RLTrainConfig(learning_rate=1e-2, allow_training_without_logprobs=True)
    )
    assert run.summary["tokens/trainable"] > 0
    list(run)
    assert not _same(before, _adapter(tiny_trainer))


def test_train_rl_refuses_a_batch_truncated_to_nothing(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0]])
    with pytest.raises(TrainingError, match="beyond 16 tokens"):
        tiny_trainer.train_rl(groups, RLTrainConfig(packed_sequence_length=16))


def test_gradient_checkpointing_gives_the_same_update(tiny_model_path: Path) -> None:
    config = RLTrainConfig(learning_rate=1e-2, kl_penalty_coef=0.1)
    updated = []
    for checkpointing in (False, True):
        trainer = Trainer.load(
            str(tiny_model_path),
            model_config=ModelConfig(gradient_checkpointing=checkpointing),
            device="cpu",
        )
        list(trainer.train_rl(_groups(trainer, [[0.0, 1.0, 0.4]]), config))
        updated.append(_adapter(trainer))
    assert not _same(
        updated[0],
        _adapter(Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")),
    )
    for name, value in updated[0].items():
        torch.testing.assert_close(updated[1][name], value)

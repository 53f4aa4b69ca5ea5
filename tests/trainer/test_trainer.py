"""The Trainer API the worker uses: load, prepare_rl + run, save, resume, agreement, errors."""

from __future__ import annotations

import json
import math
import shutil
from pathlib import Path
from typing import Any

import pytest
import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import Choice, ModelConfig, RLTrainConfig, TrajectoryGroup
from skytrain_backend.trainer import Trainer
from tests.fixtures.sampling import sampled_groups

QUESTIONS = ["Name a color.", "Count to three.", "Say hello."]


def _groups(
    trainer: Trainer, rewards: list[list[float]], *, seed: int = 0, max_new_tokens: int = 8
) -> list[TrajectoryGroup]:
    """One group per reward list, sampled from the trainer's current policy."""
    return sampled_groups(
        trainer, rewards, questions=QUESTIONS, seed=seed, max_new_tokens=max_new_tokens
    )


def _train(trainer: Trainer, groups: list[TrajectoryGroup], config: RLTrainConfig) -> list[Any]:
    return list(trainer.run(trainer.prepare_rl(groups, config)))


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


@pytest.mark.slow
def test_every_job_measures_how_far_the_sampler_is_before_its_first_update(
    tiny_trainer: Trainer,
) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.5, 0.2]] * 3, max_new_tokens=16)
    sampled_tokens = sum(
        len(item.logprobs.content)
        for group in groups
        for trajectory in group.trajectories
        for item in trajectory.messages_and_choices
        if hasattr(item, "logprobs") and item.logprobs and item.logprobs.content
    )
    # A sampler that saw something else (here: logprobs shifted by half a nat) is called out.
    raw = [group.model_dump(mode="json") for group in groups]
    for group in raw:
        for trajectory in group["trajectories"]:
            for entry in trajectory["messages_and_choices"][-1]["logprobs"]["content"]:
                entry["logprob"] -= 0.5
    shifted = tiny_trainer.prepare_rl(
        [TrajectoryGroup.model_validate(group) for group in raw],
        RLTrainConfig(),
        separate_pass=True,
    )
    assert not shifted.agreement_pending
    assert shifted.summary["logprob_agreement/mean_abs_diff"] == pytest.approx(0.5, abs=1e-4)
    assert shifted.warning is not None and "far beyond float32 noise" in shifted.warning

    # A job's first step reads the policy's logprobs in its own forward pass, before its update.
    plan = tiny_trainer.prepare_rl(groups, RLTrainConfig())
    assert plan.agreement_pending
    assert "logprob_agreement/num_tokens" not in plan.summary
    list(tiny_trainer.run(plan))
    assert not plan.agreement_pending
    print(f"sampler/learner agreement on the tiny model (fp32, CPU): {plan.summary}")
    assert plan.summary["logprob_agreement/num_tokens"] == sampled_tokens
    assert plan.summary["logprob_agreement/max_abs_diff"] < 1e-4
    assert plan.summary["tokens/without_sampling_logprob"] == 0
    assert plan.warning is None


def test_groups_without_reward_variance_change_nothing(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[1.0, 1.0, 1.0], [0.0, 0.0]])
    before = _adapter(tiny_trainer)
    plan = tiny_trainer.prepare_rl(groups, RLTrainConfig(learning_rate=1e-2))
    assert plan.num_gradient_steps == 0
    assert plan.summary["groups/skipped_zero_variance"] == 2
    assert list(tiny_trainer.run(plan)) == []
    assert _same(before, _adapter(tiny_trainer))
    assert tiny_trainer.step == 1  # the worker still commits the next step


def _sampled_at(groups: list[TrajectoryGroup], step: int) -> list[TrajectoryGroup]:
    """The groups with each choice saying it was sampled from ``step``, as the gateway says."""
    for group in groups:
        for trajectory in group.trajectories:
            for item in trajectory.messages_and_choices:
                if isinstance(item, Choice):
                    item.skytrain_step = step
    return groups


def test_a_job_reports_how_many_steps_behind_its_groups_were_sampled(
    tiny_trainer: Trainer,
) -> None:
    """Groups sampled from the step before train with their own sampled logprobs as the old
    policy (the policy has moved since: their ratios are not 1); the plan says how far behind
    they were, and a group whose choices say no step is not counted."""
    stale = _sampled_at(_groups(tiny_trainer, [[0.0, 1.0], [1.0, 0.0]]), 0)
    _train(
        tiny_trainer, _groups(tiny_trainer, [[0.0, 1.0]], seed=7), RLTrainConfig(learning_rate=1e-2)
    )
    assert tiny_trainer.step == 1
    fresh = _sampled_at(_groups(tiny_trainer, [[1.0, 0.0]], seed=3), 1)
    unsaid = _groups(tiny_trainer, [[0.0, 1.0]], seed=5)

    plan = tiny_trainer.prepare_rl([*stale, *fresh, *unsaid], RLTrainConfig(learning_rate=1e-3))

    assert plan.summary["off_policy_steps/max"] == 1.0
    assert plan.summary["off_policy_steps/mean"] == pytest.approx(2 / 3)
    assert plan.summary["groups/off_policy"] == 2.0
    (metrics,) = list(tiny_trainer.run(plan))
    assert metrics["ratio/mean"] != 1.0
    assert tiny_trainer.step == 2
    later = tiny_trainer.prepare_rl(fresh, RLTrainConfig())
    assert later.summary["off_policy_steps/max"] == 1.0  # sampled at 1, the trainer is at 2
    assert "off_policy_steps/max" not in tiny_trainer.prepare_rl(unsaid, RLTrainConfig()).summary


def test_a_job_leaves_out_the_groups_that_grew_too_old_while_it_waited(
    tiny_trainer: Trainer,
) -> None:
    """max_off_policy_steps is checked again against the step the job trains from (the API
    checked it against the step when the job was queued): groups now too old are left out and
    counted; a job with none left fails saying why. ART's initial_policy_version counts where
    the choices say no step."""
    stale = _sampled_at(_groups(tiny_trainer, [[0.0, 1.0], [1.0, 0.0]]), 0)
    (art,) = _groups(tiny_trainer, [[1.0, 0.0]], seed=9)
    for trajectory in art.trajectories:
        trajectory.initial_policy_version = 0
    _train(
        tiny_trainer, _groups(tiny_trainer, [[0.0, 1.0]], seed=7), RLTrainConfig(learning_rate=1e-2)
    )
    assert tiny_trainer.step == 1  # the model moved on while the job waited
    fresh = _sampled_at(_groups(tiny_trainer, [[1.0, 0.0]], seed=3), 1)
    unsaid = _groups(tiny_trainer, [[0.0, 1.0]], seed=5)

    strict = RLTrainConfig(learning_rate=1e-3, max_off_policy_steps=0)
    plan = tiny_trainer.prepare_rl([*stale, art, *fresh, *unsaid], strict)
    assert plan.summary["groups/refused_off_policy"] == 3.0
    assert plan.summary["off_policy_steps/max"] == 0.0  # only what it trains on is measured
    assert plan.summary["groups/total"] == 2.0
    lenient = tiny_trainer.prepare_rl(
        [*stale, art, *fresh], strict.model_copy(update={"max_off_policy_steps": 1})
    )
    assert lenient.summary["groups/refused_off_policy"] == 0.0
    assert lenient.summary["off_policy_steps/max"] == 1.0
    with pytest.raises(TrainingError, match=r"max_off_policy_steps=0 steps before step 1") as info:
        tiny_trainer.prepare_rl([*stale, art], strict)
    assert "every one of the 3 groups" in info.value.message
    assert (
        "groups/refused_off_policy" not in tiny_trainer.prepare_rl(stale, RLTrainConfig()).summary
    )


def test_a_plan_runs_once_and_only_on_the_step_it_was_prepared_at(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0]])
    stale = tiny_trainer.prepare_rl(groups, RLTrainConfig())
    plan = tiny_trainer.prepare_rl(groups, RLTrainConfig())
    list(tiny_trainer.run(plan))
    with pytest.raises(RuntimeError, match="runs once"):
        list(tiny_trainer.run(plan))
    with pytest.raises(RuntimeError, match="prepared at step 0 but the trainer is at step 1"):
        list(tiny_trainer.run(stale))


@pytest.mark.slow
def test_a_job_takes_num_gradient_steps_over_whole_groups(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.0, 1.0], [1.0, 0.0, 0.5], [2.0, 2.0], [0.0, 3.0]])
    before = _adapter(tiny_trainer)
    # Short rows: the groups with a signal take several rows; rows never decide the steps.
    config = RLTrainConfig(learning_rate=1e-3, packed_sequence_length=48, num_gradient_steps=2)
    plan = tiny_trainer.prepare_rl(groups, config)
    assert plan.summary["packing/rows"] > 2
    assert plan.num_gradient_steps == 2
    assert plan.summary["groups/skipped_zero_variance"] == 1
    assert plan.summary["sequences/trained"] == 9
    # Whole groups per step: 3 groups with a signal split 1 + 2 (or 2 + 1), never a group cut.
    per_step = [sorted({s.group_index for s in packing.sequences}) for packing in plan.steps]
    assert sorted(len(groups_of_step) for groups_of_step in per_step) == [1, 2]
    assert sorted(g for step in per_step for g in step) == [0, 1, 3]
    steps = list(tiny_trainer.run(plan))
    assert len(steps) == plan.num_gradient_steps
    for metrics in steps:
        for key in ("loss/policy", "clip_ratio/low", "clip_ratio/high", "entropy", "grad_norm"):
            assert math.isfinite(metrics[key])
        assert metrics["train/num_trainable_tokens"] > 0
    assert sum(m["train/num_trainable_tokens"] for m in steps) == plan.summary["tokens/trainable"]
    assert steps[0]["ratio/mean"] == pytest.approx(1.0, abs=1e-5)  # on-policy
    assert steps[1]["ratio/mean"] != pytest.approx(1.0, abs=1e-5)  # the policy moved
    assert not _same(before, _adapter(tiny_trainer))
    assert tiny_trainer.step == 1
    # More steps than groups with a signal: one group per step.
    many = config.model_copy(update={"num_gradient_steps": 9})
    assert tiny_trainer.prepare_rl(groups, many).num_gradient_steps == 3


@pytest.mark.slow
def test_kl_penalty_is_zero_until_the_adapter_moves(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0, 0.0, 1.0], [1.0, 0.0]])
    config = RLTrainConfig(learning_rate=1e-2, kl_penalty_coef=0.5, num_gradient_steps=2)
    steps = _train(tiny_trainer, groups, config)
    assert len(steps) == 2
    assert steps[0]["loss/kl"] == 0.0
    assert steps[-1]["loss/kl"] > 0.0
    assert steps[-1]["loss"] == pytest.approx(steps[-1]["loss/policy"] + 0.5 * steps[-1]["loss/kl"])


def test_saved_adapter_loads_in_peft_with_identical_outputs(
    tiny_trainer: Trainer, tiny_model_path: Path, tmp_path: Path
) -> None:
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    _train(
        tiny_trainer, _groups(tiny_trainer, [[0.0, 1.0, 1.0]]), RLTrainConfig(learning_rate=1e-2)
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


@pytest.mark.slow
def test_resumed_training_continues_identically(tiny_model_path: Path, tmp_path: Path) -> None:
    config = RLTrainConfig(learning_rate=1e-2)
    first = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    batches = [_groups(first, [[0.0, 1.0, 0.3]], seed=s) for s in (0, 10)]

    _train(first, batches[0], config)
    _train(first, batches[1], config)
    straight = _adapter(first)

    interrupted = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    _train(interrupted, batches[0], config)
    interrupted.save(tmp_path / "step1")
    resumed = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(),
        adapter_dir=tmp_path / "step1",
        device="cpu",
    )
    assert resumed.step == 1
    _train(resumed, batches[1], config)
    assert _same(straight, _adapter(resumed))
    assert resumed.step == 2

    # A checkpoint without its optimizer state is refused: a fresh optimizer would take another
    # step (the test can tell), so it is only used when asked for.
    (tmp_path / "step1" / "optimizer.pt").unlink()
    with pytest.raises(TrainingError, match=r"step 1 has no optimizer\.pt"):
        Trainer.load(
            str(tiny_model_path),
            model_config=ModelConfig(),
            adapter_dir=tmp_path / "step1",
            device="cpu",
        )
    forgetful = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(),
        adapter_dir=tmp_path / "step1",
        device="cpu",
        fresh_optimizer=True,
    )
    _train(forgetful, batches[1], config)
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
        tiny_trainer.prepare_rl([TrajectoryGroup.model_validate(raw)], RLTrainConfig())

    raw = group.model_dump(mode="json")
    raw["trajectories"][0]["messages_and_choices"][-1]["logprobs"]["content"][0]["logprob"] = (
        math.nan
    )
    with pytest.raises(TrainingError, match=r"trajectory 0 of group 0.*NaN"):
        tiny_trainer.prepare_rl([TrajectoryGroup.model_validate(raw)], RLTrainConfig())
    assert tiny_trainer.step == 0


def _plain_group(
    answers: list[tuple[str, float]], question: str = "Name a color."
) -> TrajectoryGroup:
    prompt = [{"role": "user", "content": question}]
    return TrajectoryGroup.model_validate(
        {
            "trajectories": [
                {
                    "messages_and_choices": [*prompt, {"role": "assistant", "content": text}],
                    "reward": reward,
                }
                for text, reward in answers
            ]
        }
    )


def test_training_without_logprobs_learns_from_plain_assistant_messages(
    tiny_trainer: Trainer,
) -> None:
    group = _plain_group([("Blue.", 1.0), ("I cannot say.", 0.0)])
    with pytest.raises(TrainingError, match="allow_training_without_logprobs=True"):
        tiny_trainer.prepare_rl([group], RLTrainConfig())
    before = _adapter(tiny_trainer)
    plan = tiny_trainer.prepare_rl(
        [group], RLTrainConfig(learning_rate=1e-2, allow_training_without_logprobs=True)
    )
    assert plan.summary["tokens/trainable"] > 0
    list(tiny_trainer.run(plan))
    assert not _same(before, _adapter(tiny_trainer))


def test_missing_sampling_logprobs_are_computed_once_so_later_steps_stay_ppo(
    tiny_trainer: Trainer,
) -> None:
    """Tokens without a sampling logprob get the policy's own, read before the first update and
    kept: once the policy moves their ratio leaves 1 and clipping acts (ART PR #467). The second
    step's rows are read before the first update too, not by their own forward pass."""
    groups = [
        _plain_group([("Blue.", 1.0), ("I cannot say.", 0.0)]),
        _plain_group([("Three.", 1.0), ("Many, many.", 0.0)], question="Count to three."),
    ]
    config = RLTrainConfig(
        learning_rate=5e-2, allow_training_without_logprobs=True, num_gradient_steps=2
    )
    plan = tiny_trainer.prepare_rl(groups, config)
    first, second = tiny_trainer.run(plan)
    assert plan.summary["tokens/without_sampling_logprob"] == plan.summary["tokens/trainable"]
    assert "logprob_agreement/mean_abs_diff" not in plan.summary  # nothing to compare
    assert first["ratio/mean"] == pytest.approx(1.0, abs=1e-6)
    assert abs(second["ratio/mean"] - 1.0) > 1e-3


FIRST_STEP_CASES = {
    "one step": RLTrainConfig(learning_rate=1e-2),
    "two steps of short rows": RLTrainConfig(
        learning_rate=1e-2, num_gradient_steps=2, packed_sequence_length=48
    ),
    "every old logprob the policy's, sequence ratios, KL": RLTrainConfig(
        learning_rate=1e-2,
        precalculate_logprobs=True,
        importance_sampling_level="sequence",
        kl_penalty_coef=0.1,
    ),
}


@pytest.mark.parametrize("case", list(FIRST_STEP_CASES))
@pytest.mark.slow
def test_the_first_step_reads_the_old_logprobs_as_a_separate_pass_would(
    tiny_model_path: Path, case: str
) -> None:
    """The first step's own forward pass gives its rows' old logprobs: the same old logprobs,
    agreement, step metrics and updated adapter as a pass without gradient before it."""
    config = FIRST_STEP_CASES[case]
    separate_trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    initial = _adapter(separate_trainer)
    groups = _groups(separate_trainer, [[0.0, 1.0, 0.5], [1.0, 0.0, 0.2], [0.3, 0.9]], seed=3)
    fused_trainer = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    results = []
    for trainer, separate_pass in ((separate_trainer, True), (fused_trainer, False)):
        plan = trainer.prepare_rl(groups, config, separate_pass=separate_pass)
        assert plan.agreement_pending is not separate_pass
        first_step_read = [old is not None for old in plan.old_logprobs[0]]
        assert all(first_step_read) if separate_pass else not any(first_step_read)
        assert all(old is not None for rows in plan.old_logprobs[1:] for old in rows)
        metrics = list(trainer.run(plan))
        assert not plan.agreement_pending
        results.append((plan, metrics, _adapter(trainer)))
    (separate, separate_steps, separate_adapter), (fused, fused_steps, fused_adapter) = results

    assert fused.num_gradient_steps == separate.num_gradient_steps == config.num_gradient_steps
    assert fused.summary.keys() == separate.summary.keys()
    for key, value in separate.summary.items():
        assert fused.summary[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert fused.warning is None and separate.warning is None
    for fused_rows, separate_rows in zip(fused.old_logprobs, separate.old_logprobs, strict=True):
        for fused_old, separate_old in zip(fused_rows, separate_rows, strict=True):
            assert fused_old is not None and separate_old is not None
            torch.testing.assert_close(fused_old, separate_old)
    for fused_metrics, separate_metrics in zip(fused_steps, separate_steps, strict=True):
        assert fused_metrics.keys() == separate_metrics.keys()
        for key, value in separate_metrics.items():
            assert fused_metrics[key] == pytest.approx(value, rel=1e-5, abs=1e-6), key
    assert not _same(initial, separate_adapter)
    for name, value in separate_adapter.items():
        torch.testing.assert_close(fused_adapter[name], value)


@pytest.mark.slow
def test_with_dropout_the_old_logprobs_are_read_in_a_separate_pass(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """A training forward pass that drops out is not the old policy's: every row is read
    without gradient before the first step, be it the adapter's dropout or the model's."""
    plain = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    assert not plain.policy.drops_out
    groups = _groups(plain, [[0.0, 1.0, 0.5], [1.0, 0.0]])
    attention_dropout = tmp_path / "attention-dropout"
    shutil.copytree(tiny_model_path, attention_dropout)
    config_path = attention_dropout / "config.json"
    config_path.write_text(
        json.dumps(json.loads(config_path.read_text()) | {"attention_dropout": 0.1})
    )
    for path, model_config in (
        (tiny_model_path, ModelConfig(lora_dropout=0.1)),
        (attention_dropout, ModelConfig()),
    ):
        trainer = Trainer.load(str(path), model_config=model_config, device="cpu")
        assert trainer.policy.drops_out
        plan = trainer.prepare_rl(groups, RLTrainConfig(learning_rate=1e-2))
        assert not plan.agreement_pending
        assert all(old is not None for rows in plan.old_logprobs for old in rows)
        assert plan.summary["logprob_agreement/max_abs_diff"] < 1e-4
        assert len(list(trainer.run(plan))) == 1


@pytest.mark.slow
def test_train_rl_refuses_a_batch_truncated_to_nothing(tiny_trainer: Trainer) -> None:
    groups = _groups(tiny_trainer, [[0.0, 1.0]])
    with pytest.raises(TrainingError, match="beyond 16 tokens"):
        tiny_trainer.prepare_rl(groups, RLTrainConfig(packed_sequence_length=16))


def test_token_ids_outside_the_vocabulary_are_refused(tiny_trainer: Trainer) -> None:
    (group,) = _groups(tiny_trainer, [[0.0, 1.0]])
    raw = group.model_dump(mode="json")
    raw["trajectories"][1]["messages_and_choices"][-1]["prompt_token_ids"] = [1, 10**7]
    with pytest.raises(TrainingError, match=r"trajectory 1 of group 0 has token ids outside"):
        tiny_trainer.prepare_rl([TrajectoryGroup.model_validate(raw)], RLTrainConfig())


@pytest.mark.slow
def test_gradient_checkpointing_gives_the_same_update(tiny_model_path: Path) -> None:
    """With LoRA dropout too: the layers run again in the backward pass draw the masks their
    forward pass drew."""
    config = RLTrainConfig(learning_rate=1e-2, kl_penalty_coef=0.1)
    updated = []
    for checkpointing in (False, True):
        trainer = Trainer.load(
            str(tiny_model_path),
            model_config=ModelConfig(gradient_checkpointing=checkpointing, lora_dropout=0.3),
            device="cpu",
        )
        _train(trainer, _groups(trainer, [[0.0, 1.0, 0.4]]), config)
        updated.append(_adapter(trainer))
    assert not _same(
        updated[0],
        _adapter(Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")),
    )
    for name, value in updated[0].items():
        torch.testing.assert_close(updated[1][name], value)


@pytest.mark.slow
def test_every_packing_takes_the_same_steps_and_makes_the_same_update(
    tiny_model_path: Path,
) -> None:
    """The rule: a job is min(num_gradient_steps, groups with a signal) optimizer steps over
    whole groups. Rows shared or not, packed or one per row (Unsloth's path), short or long,
    with gradient checkpointing or without: the same steps, the same adapter to float noise."""
    reference = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    groups = _groups(
        reference, [[0.0, 1.0, 0.5, 0.2], [1.0, 0.0, 0.0], [0.3, 0.9], [1.0, 1.0]], seed=5
    )
    results = {}
    for packing in ("shared_prefixes", "packed", "one_per_row"):
        for row_length, checkpointing in ((None, False), (48, True)):
            trainer = Trainer.load(
                str(tiny_model_path),
                model_config=ModelConfig(gradient_checkpointing=checkpointing),
                device="cpu",
                packing=packing,  # type: ignore[arg-type]
            )
            config = RLTrainConfig(
                learning_rate=1e-2,
                num_gradient_steps=2,
                packed_sequence_length=row_length,
            )
            plan = trainer.prepare_rl(groups, config)
            metrics = list(trainer.run(plan))
            results[(packing, row_length)] = (plan, metrics, _adapter(trainer))
    expected_steps = 2  # min(2, 3 groups with a signal: the [1, 1] group has none)
    (_, _, first), *_ = results.values()
    largest = 0.0
    for (packing, row_length), (plan, metrics, adapter) in results.items():
        assert plan.num_gradient_steps == len(metrics) == expected_steps, (packing, row_length)
        for name, value in first.items():
            # Adam divides each gradient by its own size: where a gradient is tiny, rounding
            # differences between packings show at up to ~1e-5 (1.26e-5 seen once), against
            # steps of ~1e-2.
            torch.testing.assert_close(adapter[name], value, rtol=1e-4, atol=1e-4)
            largest = max(largest, float((adapter[name] - value).abs().max()))
    rows = {key: plan.summary["packing/rows"] for key, (plan, _, _) in results.items()}
    assert len(set(rows.values())) > 1  # the packings really differ
    print(f"\nrows per packing: {rows}; largest adapter difference: {largest:.2e}")


@pytest.mark.parametrize("source", [None, "current_learner"])
def test_a_checkpoint_as_the_kl_reference_is_the_policy_it_saved(
    tiny_trainer: Trainer, tmp_path: Path, source: str | None
) -> None:
    """ART's ``kl_penalty_reference_step``: the reference is a checkpoint, loaded as a second
    adapter beside the policy's. Trained once and saved, the policy is that checkpoint, so the
    first step's KL against it is exactly 0 where the base model's is not; the reference stays
    out of the saved adapter and of the trained weights."""
    groups = _groups(tiny_trainer, [[1.0, 0.0], [0.0, 1.0]])
    _train(tiny_trainer, groups, RLTrainConfig(learning_rate=5e-2))
    tiny_trainer.save(tmp_path / "step-1")
    trained = set(_adapter(tiny_trainer))
    kl_key = "loss/kl" if source is None else "kl/policy_ref"
    config = RLTrainConfig(
        learning_rate=1e-2,
        kl_penalty_coef=0.5,
        kl_penalty_source=source,
        kl_penalty_reference_step=1,
        num_gradient_steps=2,
    )
    plan = tiny_trainer.prepare_rl(groups, config, reference=tmp_path / "step-1")
    against_checkpoint = list(tiny_trainer.run(plan))
    assert against_checkpoint[0][kl_key] == 0.0
    assert against_checkpoint[-1][kl_key] != 0.0  # the policy moved, the reference did not
    assert set(_adapter(tiny_trainer)) == trained
    tiny_trainer.save(tmp_path / "step-2")
    assert not (tmp_path / "step-2" / "reference").exists()
    base = config.model_copy(update={"kl_penalty_reference_step": None})
    against_base = list(tiny_trainer.run(tiny_trainer.prepare_rl(groups, base)))
    assert abs(against_base[0][kl_key]) > 1e-4


def test_a_reference_checkpoint_of_another_shape_is_refused_by_step(
    tiny_trainer: Trainer, tmp_path: Path
) -> None:
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "adapter_config.json").write_text('{"r": 3}')
    (tmp_path / "other" / "adapter_model.safetensors").write_bytes(b"")
    groups = _groups(tiny_trainer, [[1.0, 0.0]])
    config = RLTrainConfig(kl_penalty_coef=0.5, kl_penalty_reference_step=4)
    with pytest.raises(TrainingError, match=r"KL reference checkpoint \(step 4\)") as raised:
        tiny_trainer.prepare_rl(groups, config, reference=tmp_path / "other")
    assert str(tmp_path) not in str(raised.value)

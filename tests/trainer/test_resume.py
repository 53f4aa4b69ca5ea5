"""A job stopped between two optimizer steps and resumed by another trainer (another worker)
ends with exactly the adapter, optimizer state and metrics of the run that never stopped:
bitwise on CPU with one thread, LoRA dropout included (the random generators travel with
the saved state)."""

from __future__ import annotations

import shutil
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import (
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
)
from skytrain_backend.trainer import RLPlan, SFTPlan, Trainer
from tests.fixtures.sampling import sampled_groups

Plan = RLPlan | SFTPlan
Prepare = Callable[[Trainer, Path | None], Plan]


@pytest.fixture(autouse=True)
def one_thread() -> Iterator[None]:
    """One intra-op thread: the claim is bitwise, which CPU kernels promise for one thread."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


def _load(model_path: Path, model_config: ModelConfig, adapter_dir: Path | None = None) -> Trainer:
    return Trainer.load(
        str(model_path), model_config=model_config, adapter_dir=adapter_dir, device="cpu"
    )


def _adapter(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {
        name: parameter.detach().clone()
        for name, parameter in trainer.policy.model.named_parameters()
        if parameter.requires_grad
    }


def _optimizer_state(trainer: Trainer) -> list[torch.Tensor]:
    return [
        value
        for state in trainer.optimizer.state_dict()["state"].values()
        for value in state.values()
    ]


def _run_stopped_and_resumed(
    model_path: Path, model_config: ModelConfig, prepare: Prepare, *, stop_after: int, tmp: Path
) -> tuple[Trainer, Plan]:
    """Run ``stop_after`` steps, save the progress, and finish on a new trainer loaded from a
    copy of it (as another worker downloads it)."""
    first = _load(model_path, model_config)
    plan = prepare(first, None)
    steps = first.run(plan)
    for _ in range(stop_after):
        next(steps)
    first.save_progress(plan, tmp / "saved")
    shutil.copytree(tmp / "saved", tmp / "downloaded")

    second = _load(model_path, model_config, adapter_dir=tmp / "downloaded")
    assert second.step == first.step == 0  # still the job's base step
    resumed = prepare(second, tmp / "downloaded")
    assert resumed.steps_done == stop_after
    assert len(list(second.run(resumed))) == resumed.num_gradient_steps - stop_after
    return second, resumed


def _assert_same_run(
    resumed: Trainer, resumed_plan: Plan, straight: Trainer, straight_plan: Plan
) -> None:
    assert resumed.step == straight.step == 1
    expected, got = _adapter(straight), _adapter(resumed)
    assert expected.keys() == got.keys()
    for name, value in expected.items():
        assert torch.equal(got[name], value), name
    for got_state, expected_state in zip(
        _optimizer_state(resumed), _optimizer_state(straight), strict=True
    ):
        assert torch.equal(got_state, expected_state)
    assert resumed_plan.step_metrics == straight_plan.step_metrics  # the stopped run's too
    assert resumed_plan.summary == straight_plan.summary


def _answers(count: int) -> list[Trajectory]:
    return [
        Trajectory.model_validate(
            {
                "messages_and_choices": [
                    {"role": "user", "content": f"Name colour number {n}."},
                    {
                        "role": "assistant",
                        "content": f"Colour {n} is {'blue' if n % 2 else 'red'}.",
                    },
                ],
                "reward": 0,
            }
        )
        for n in range(count)
    ]


@pytest.mark.slow
def test_an_sft_job_resumed_on_another_trainer_ends_exactly_as_one_never_stopped(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """Stopped in its second epoch: the resumed run draws the epochs' shuffles, the per-step
    learning rates and the dropout masks the uninterrupted one drew."""
    model_config = ModelConfig(lora_dropout=0.2)
    trajectories = _answers(5)
    # 3 batches per epoch (2 + 2 + 1) x 3 epochs, one learning rate per step.
    learning_rates = [1e-2 * (1 + step % 4) for step in range(9)]
    config = SFTTrainConfig(learning_rate=learning_rates, batch_size=2, num_epochs=3, seed=7)

    def prepare(trainer: Trainer, resume_from: Path | None) -> Plan:
        return trainer.prepare_sft(trajectories, config, resume_from=resume_from)

    straight = _load(tiny_model_path, model_config)
    straight_plan = prepare(straight, None)
    list(straight.run(straight_plan))

    resumed, resumed_plan = _run_stopped_and_resumed(
        tiny_model_path, model_config, prepare, stop_after=4, tmp=tmp_path
    )
    _assert_same_run(resumed, resumed_plan, straight, straight_plan)
    assert [m["learning_rate"] for m in resumed_plan.step_metrics] == learning_rates


# A question of its own for each of a job's (at most four) groups.
QUESTIONS = [f"Say something about {index}." for index in range(4)]


@pytest.mark.parametrize(
    ("lora_dropout", "stop_after"),
    [
        # The first step read its own rows' old logprobs; the later steps' were read before it.
        (0.0, 1),
        # Dropout: every row read before the first step, and masks drawn in every step.
        (0.2, 2),
    ],
)
@pytest.mark.slow
def test_a_multi_step_rl_job_resumed_on_another_trainer_ends_exactly_as_one_never_stopped(
    tiny_model_path: Path, tmp_path: Path, lora_dropout: float, stop_after: int
) -> None:
    """The old logprobs of the steps after the stop were read from the policy before any
    update; the resumed run uses those, not the moved policy's, as the uninterrupted run
    does."""
    model_config = ModelConfig(lora_dropout=lora_dropout)
    sampler = _load(tiny_model_path, ModelConfig())
    # Missing sampler logprobs are filled in by the trainer's read: the saved state carries
    # them, and only them could make a resumed step's ratios match.
    groups = sampled_groups(
        sampler, [[0.0, 1.0, 0.5], [1.0, 0.0], [0.2, 0.9, 0.4], [0.7, 0.1]], questions=QUESTIONS
    )
    config = RLTrainConfig(
        learning_rate=2e-2, num_gradient_steps=4, precalculate_logprobs=True, seed=3
    )

    def prepare(trainer: Trainer, resume_from: Path | None) -> Plan:
        return trainer.prepare_rl(groups, config, resume_from=resume_from)

    straight = _load(tiny_model_path, model_config)
    straight_plan = prepare(straight, None)
    assert straight_plan.num_gradient_steps == 4
    list(straight.run(straight_plan))

    resumed, resumed_plan = _run_stopped_and_resumed(
        tiny_model_path, model_config, prepare, stop_after=stop_after, tmp=tmp_path
    )
    _assert_same_run(resumed, resumed_plan, straight, straight_plan)
    assert resumed_plan.step_metrics[-1]["ratio/mean"] != pytest.approx(1.0, abs=1e-6)


def test_a_saved_state_resumes_only_the_job_that_saved_it(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    trainer = _load(tiny_model_path, ModelConfig())
    trajectories = _answers(4)
    config = SFTTrainConfig(learning_rate=1e-2, batch_size=1, num_epochs=2)
    plan = trainer.prepare_sft(trajectories, config)
    with pytest.raises(RuntimeError, match="between two of its steps, not after 0 of 8"):
        trainer.save_progress(plan, tmp_path / "too-early")
    steps = trainer.run(plan)
    next(steps)
    trainer.save_progress(plan, tmp_path / "saved")

    resumed = _load(tiny_model_path, ModelConfig(), adapter_dir=tmp_path / "saved")
    longer = config.model_copy(update={"num_epochs": 3})
    with pytest.raises(TrainingError, match=r"sft job of 8 steps .* not of this sft job of 12"):
        resumed.prepare_sft(trajectories, longer, resume_from=tmp_path / "saved")
    with pytest.raises(TrainingError, match="not of this rl job"):
        resumed.prepare_rl(
            sampled_groups(resumed, [[0.0, 1.0]], questions=QUESTIONS),
            RLTrainConfig(),
            resume_from=tmp_path / "saved",
        )
    with pytest.raises(TrainingError, match=r"holds no progress\.pt"):
        resumed.prepare_sft(trajectories, config, resume_from=tmp_path / "too-early")

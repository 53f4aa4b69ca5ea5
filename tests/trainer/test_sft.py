"""Supervised fine-tuning on trajectories."""

from __future__ import annotations

import tracemalloc
from pathlib import Path

import pytest

from skytrain_backend import trainer as trainer_package
from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import ModelConfig, SFTTrainConfig, Trajectory
from skytrain_backend.trainer import Trainer

_TRAINER_CODE = str(Path(trainer_package.__file__).parent / "*")
_TRACED_FRAMES = 256


def _conversation(answer: str) -> Trajectory:
    return Trajectory.model_validate(
        {
            "messages_and_choices": [
                {"role": "user", "content": "Name a color."},
                {"role": "assistant", "content": "Let me think."},
                {"role": "user", "content": "Just one word."},
                {"role": "assistant", "content": answer},
            ],
            "reward": 0,
        }
    )


def test_sft_lowers_the_loss_on_its_data_with_one_learning_rate_per_step(
    tiny_model_path: Path,
) -> None:
    # The random model's output layer is adapted too, so it can learn a new answer quickly.
    model_config = ModelConfig(lora_target_modules=["q_proj", "v_proj", "lm_head"])
    tiny_trainer = Trainer.load(str(tiny_model_path), model_config=model_config, device="cpu")
    trajectories = [_conversation(answer) for answer in ("Blue.", "Red.", "Green.", "Blue.")]
    learning_rates = [3e-2] * 3 + [1e-2] * 3
    plan = tiny_trainer.prepare_sft(
        trajectories,
        SFTTrainConfig(learning_rate=learning_rates, batch_size=2, num_epochs=3),
    )
    assert plan.num_gradient_steps == 6
    steps = list(tiny_trainer.run(plan))
    assert [m["learning_rate"] for m in steps] == learning_rates
    # Every epoch sees the same data: the loss of the last epoch is well below the first.
    first_epoch = sum(m["loss"] for m in steps[:2]) / 2
    last_epoch = sum(m["loss"] for m in steps[-2:]) / 2
    assert last_epoch < first_epoch - 1
    assert tiny_trainer.step == 1


def test_sft_last_turn_only_trains_fewer_tokens(tiny_trainer: Trainer) -> None:
    trajectories = [_conversation("Blue.")]
    every = tiny_trainer.prepare_sft(trajectories, SFTTrainConfig(assistant_turns="all"))
    last = tiny_trainer.prepare_sft(trajectories, SFTTrainConfig(assistant_turns="last"))
    # "Let me think." + end-of-turn is 5 tokens; "Blue." + end-of-turn is 3.
    assert every.summary["tokens/trainable"] == 8
    assert last.summary["tokens/trainable"] == 3


def test_sft_refuses_learning_rates_that_do_not_match_the_steps(tiny_trainer: Trainer) -> None:
    with pytest.raises(TrainingError, match="learning_rate has 2 values but the job has 3"):
        tiny_trainer.prepare_sft(
            [_conversation("Blue.")] * 5,
            SFTTrainConfig(learning_rate=[1e-3, 1e-3], batch_size=2),
        )


def test_an_sft_run_of_many_epochs_holds_no_more_than_a_run_of_one(
    tiny_trainer: Trainer,
) -> None:
    """Epochs are batched as they come: 100 epochs (the most a job may ask) hold what one does.
    A run used to build every epoch's batches and packings up front: a job asking for 10^9
    epochs took its shared worker down (15.5 GB)."""
    # 8 trajectories: 800 steps' batches and packings built up front would hold far more
    # than twice what one epoch's 8 do (64 took 17 s under the tracing, 8 a few).
    trajectories = [_conversation(f"Answer {n}.") for n in range(8)]

    def prepared(epochs: int) -> tuple[int, int]:
        # Only what the trainer's code allocated counts: tracemalloc sees every thread of the
        # process, and a session's control plane beside this test allocates too (CI once
        # measured 562 kB against 206 kB that way).
        tracemalloc.start(_TRACED_FRAMES)
        try:
            plan = tiny_trainer.prepare_sft(
                trajectories, SFTTrainConfig(num_epochs=epochs, batch_size=1)
            )
            snapshot = tracemalloc.take_snapshot()
        finally:
            tracemalloc.stop()
        by_trainer = snapshot.filter_traces(
            [tracemalloc.Filter(True, _TRAINER_CODE, all_frames=True)]
        )
        held = sum(stat.size for stat in by_trainer.statistics("filename"))
        return plan.num_gradient_steps, held

    one_steps, one_held = prepared(1)
    many_steps, many_held = prepared(100)
    assert (one_steps, many_steps) == (8, 800)
    assert many_held < 2 * one_held, f"{many_held} bytes held for 100 epochs, {one_held} for 1"

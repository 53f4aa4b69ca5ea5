"""The trainer's side of the memory plan, on the tiny model on CPU: rows never longer than
the plan's longest row nor than what the model takes whole (Unsloth's max_seq_length, which
Unsloth would cut silently), gradient checkpointing on by default with CUDA, and weights loaded
straight onto the device."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from skytrain_backend.errors import TrainingError
from skytrain_backend.protocol import ModelConfig, RLTrainConfig
from skytrain_backend.trainer import Trainer
from skytrain_backend.trainer.model import Policy, load_device_map
from skytrain_backend.trainer.trainer import resolve_gradient_checkpointing, row_length_limit
from tests.trainer.test_trainer import _groups


def test_a_row_is_cut_to_every_limit_that_is_set() -> None:
    assert row_length_limit(8192) == 8192
    assert row_length_limit(8192, None, 4096) == 4096  # Unsloth loaded at 4096
    assert row_length_limit(8192, 1792, 4096) == 1792  # the plan's longest row
    assert row_length_limit(1024, 1792, None) == 1024


@pytest.mark.slow
def test_rows_longer_than_the_plans_longest_are_cut_and_counted(tiny_model_path: Path) -> None:
    cut = Trainer.load(
        str(tiny_model_path), model_config=ModelConfig(), device="cpu", max_row_tokens=56
    )
    groups = _groups(cut, [[0.0, 1.0, 0.5]], max_new_tokens=32)
    plan = cut.prepare_rl(groups, RLTrainConfig(packed_sequence_length=4096))
    assert max(len(row) for step in plan.steps for row in step.rows) <= 56
    assert plan.summary["tokens/truncated"] > 0
    whole = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    assert whole.prepare_rl(groups, RLTrainConfig()).summary["tokens/truncated"] == 0
    # Cut to nothing, the job says the worker's limit is why, not the job's own settings.
    cut.max_row_tokens = 16
    with pytest.raises(TrainingError, match="this worker trains rows of at most 16 tokens"):
        cut.prepare_rl(groups, RLTrainConfig())


@pytest.mark.slow
def test_rows_never_exceed_what_the_model_takes_whole(tiny_model_path: Path) -> None:
    """Unsloth's loader records the max_seq_length it was loaded with as the policy's longest
    row; a job asking for longer packed rows gets rows of that length, cut in the open."""
    loaded = Trainer.load(str(tiny_model_path), model_config=ModelConfig(), device="cpu")
    policy = Policy(
        loaded.policy.model,
        loaded.policy.tokenizer,
        device=torch.device("cpu"),
        unsloth=False,
        max_row_tokens=56,
    )
    trainer = Trainer(policy, base_model=str(tiny_model_path), model_config=ModelConfig())
    assert trainer.row_length(4096) == 56
    groups = _groups(trainer, [[0.0, 1.0]], max_new_tokens=32)
    plan = trainer.prepare_rl(groups, RLTrainConfig(packed_sequence_length=4096))
    assert max(len(row) for step in plan.steps for row in step.rows) <= 56
    assert plan.summary["tokens/truncated"] > 0


@pytest.mark.parametrize(
    ("requested", "worker", "device", "expected"),
    [
        (None, None, "cuda", True),  # on by default with CUDA
        (None, None, "cpu", False),
        (None, False, "cuda", False),  # the worker's plan: the row fits without
        (False, True, "cuda", False),  # the model's config wins
        (True, None, "cpu", True),
    ],
)
def test_gradient_checkpointing_is_the_configs_else_the_workers_else_on_with_cuda(
    requested: bool | None, worker: bool | None, device: str, expected: bool
) -> None:
    assert (
        resolve_gradient_checkpointing(requested, default=worker, device=torch.device(device))
        is expected
    )


def test_the_workers_default_turns_gradient_checkpointing_on(tiny_model_path: Path) -> None:
    trainer = Trainer.load(
        str(tiny_model_path),
        model_config=ModelConfig(),
        device="cpu",
        gradient_checkpointing=True,
    )
    assert trainer.model_config.gradient_checkpointing is True
    assert trainer.policy.model.get_base_model().is_gradient_checkpointing


def test_weights_go_straight_onto_the_gpu_or_spread_over_the_node() -> None:
    assert load_device_map(torch.device("cpu"), spread=False) is None
    assert load_device_map(torch.device("cuda"), spread=False) == {"": 0}
    assert load_device_map(torch.device("cuda:1"), spread=False) == {"": 1}
    assert load_device_map(torch.device("cuda"), spread=True) == "auto"

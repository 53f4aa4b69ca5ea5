"""What the job kinds' steps (``rl``, ``sft``) use of a ``Trainer``, as a ``Protocol``: the
steps are functions over a trainer and the loop in ``trainer`` calls them, so they name the
trainer by this interface rather than import the module that imports them (no import circle).
``Trainer`` is the one class that has it; it does not inherit from it."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence
from typing import Protocol

import torch

from skytrain_backend.protocol import ModelConfig
from skytrain_backend.trainer.distributed import Shards
from skytrain_backend.trainer.model import Policy
from skytrain_backend.trainer.packing import Packing
from skytrain_backend.trainer.tokenize import TokenizedSequence


class TrainerState(Protocol):
    """A policy, its optimizer and the checkpoint step it is at (``trainer.Trainer``)."""

    policy: Policy
    model_config: ModelConfig
    shards: Shards
    step: int

    @property
    def optimizer(self) -> torch.optim.Optimizer: ...

    def check_not_released(self) -> None: ...

    def check_vocabulary(self, sequences: Sequence[TokenizedSequence]) -> None: ...

    def row_length(self, requested: int) -> int: ...

    def shorter_rows_advice(self, requested: int, row_length: int) -> str: ...

    def pack(self, sequences: Sequence[TokenizedSequence], row_length: int) -> Packing: ...

    def row_masks(
        self, seed: int, index: int, position: int, *, stream: str = "policy"
    ) -> contextlib.AbstractContextManager[None]: ...

    def optimizer_step(
        self,
        *,
        learning_rate: float,
        weight_decay: float,
        max_grad_norm: float,
        adam_beta2: float = 0.999,
    ) -> float: ...

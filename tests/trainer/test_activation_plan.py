"""The memory plan's activation figure against what autograd really keeps.

A tiny random-weight Llama (no download) gets the trainer's own LoRA (``trainer.model``'s
peft config) and runs a forward and backward pass under ``saved_tensors_hooks`` that count
every tensor kept for the backward pass (once per storage, weights left out) and the peak of
those alive at once. Two row lengths give the bytes per token; the plan's formula
(``planning.shapes.activation_bytes``) on the same config must be within 10% of it.

With gradient checkpointing the hooks of transformers' non-reentrant checkpointing (the
trainer's) hide the recomputed layer from outer hooks, so the measurement uses reentrant
checkpointing: the same tensors (every layer's input, one layer recomputed at a time), kept
by ``save_for_backward`` where the hooks see them.
"""

from __future__ import annotations

import weakref
from typing import Any

import pytest
import torch

from skytrain_backend.planning import ModelShape, activation_bytes
from skytrain_backend.protocol import ModelConfig

TINY = {
    "vocab_size": 512,
    "hidden_size": 128,
    "intermediate_size": 352,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 4096,
}
SHORT, LONG = 256, 512


class _Saved:
    """A saved tensor's holder: when autograd drops it, the tensor is no longer kept."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor


class SavedBytes:
    """The peak bytes of the tensors autograd keeps alive at once, each storage counted once."""

    def __init__(self, weights: set[int]) -> None:
        self.weights = weights
        self.alive: dict[int, list[int]] = {}
        self.current = 0
        self.peak = 0

    def pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        storage = tensor.untyped_storage()
        key = storage.data_ptr()
        if key in self.weights or storage.nbytes() == 0:
            return saved
        if key in self.alive:
            self.alive[key][1] += 1
        else:
            self.alive[key] = [storage.nbytes(), 1]
            self.current += storage.nbytes()
            self.peak = max(self.peak, self.current)
        weakref.finalize(saved, self._drop, key)
        return saved

    def _drop(self, key: int) -> None:
        entry = self.alive[key]
        entry[1] -= 1
        if entry[1] == 0:
            self.current -= entry[0]
            del self.alive[key]

    @staticmethod
    def unpack(saved: _Saved) -> torch.Tensor:
        return saved.tensor


def _measured_peak(dtype: torch.dtype, *, checkpointing: bool, tokens: int) -> int:
    from peft import get_peft_model
    from transformers import AutoModelForCausalLM, LlamaConfig

    from skytrain_backend.trainer.model import _lora_config

    torch.manual_seed(0)
    model: Any = AutoModelForCausalLM.from_config(
        LlamaConfig(**TINY), dtype=dtype, attn_implementation="sdpa"
    )
    if checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})
    model = get_peft_model(model, _lora_config(ModelConfig()))
    model.train()
    saved = SavedBytes({parameter.untyped_storage().data_ptr() for parameter in model.parameters()})
    input_ids = torch.randint(0, TINY["vocab_size"], (1, tokens))
    with torch.autograd.graph.saved_tensors_hooks(saved.pack, saved.unpack):
        # The decoder alone: the output layer's chunked logits are counted apart (a constant
        # per row once it is longer than a chunk).
        hidden = model.base_model.model.model(input_ids=input_ids).last_hidden_state
        hidden.float().sum().backward()
    return saved.peak


def _planned(dtype_bytes: int, *, checkpointing: bool, tokens: int) -> int:
    return activation_bytes(
        ModelShape.from_config(TINY),
        row_tokens=tokens,
        chunk_size=SHORT,
        dtype_bytes=dtype_bytes,
        gradient_checkpointing=checkpointing,
        lora_rank=ModelConfig().lora_rank,
        packed=False,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("checkpointing", [False, True], ids=["all-layers", "checkpointing"])
def test_the_plans_activations_per_token_are_what_autograd_keeps(
    dtype: torch.dtype, checkpointing: bool
) -> None:
    measured = (
        _measured_peak(dtype, checkpointing=checkpointing, tokens=LONG)
        - _measured_peak(dtype, checkpointing=checkpointing, tokens=SHORT)
    ) / (LONG - SHORT)
    dtype_bytes = torch.empty((), dtype=dtype).element_size()
    planned = (
        _planned(dtype_bytes, checkpointing=checkpointing, tokens=LONG)
        - _planned(dtype_bytes, checkpointing=checkpointing, tokens=SHORT)
    ) / (LONG - SHORT)
    assert planned == pytest.approx(measured, rel=0.10)


def test_the_trainers_budget_counts_the_adapters_rank() -> None:
    """ActivationBudget shares the plan's formula: a row that fits a limit at rank 8 is
    refused at rank 64, whose LoRA layers keep more, with the sizes in the message."""
    from skytrain_backend.errors import OutOfMemory
    from skytrain_backend.trainer.memory import ActivationBudget

    shape = ModelShape.from_config(TINY)

    def budget(rank: int, limit: int) -> ActivationBudget:
        return ActivationBudget(
            shape,
            device=torch.device("cpu"),
            dtype_bytes=4,
            gradient_checkpointing=False,
            limit_bytes=limit,
            lora_rank=rank,
        )

    at_8 = activation_bytes(
        shape,
        row_tokens=LONG,
        chunk_size=SHORT,
        dtype_bytes=4,
        gradient_checkpointing=False,
        lora_rank=8,
    )
    budget(8, at_8).check(row_tokens=LONG, chunk_size=SHORT)
    with pytest.raises(OutOfMemory, match=f"a row of {LONG} tokens needs about"):
        budget(64, at_8).check(row_tokens=LONG, chunk_size=SHORT)

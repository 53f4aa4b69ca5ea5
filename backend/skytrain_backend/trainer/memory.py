"""The trainer's memory: what a step will need, what there is, and what to do when it runs out.

A training step's activation memory grows with the length of the packed rows it runs; a job
whose rows are too long for the device fails at its first such row. Two things make that a
clean failure instead of a dead worker:

- ``ActivationBudget`` estimates a row's activation memory before its forward pass and
  refuses a row that would not fit the limit (the worker's ``SKYTRAIN_TRAINER_MEMORY_LIMIT_MB``,
  or on CUDA the memory free at that moment), raising ``OutOfMemory`` with the sizes;
- ``out_of_memory_as_error`` turns CUDA's own out-of-memory error, where the estimate fell
  short, into the same ``OutOfMemory`` after freeing what the failed step held.

The estimate is the memory plan's (``planning.shapes.activation_bytes``: one formula for the
plan and the trainer): the tensors kept for the backward pass per layer (norms with their
fp32 upcasts, attention's q, k, v and output, the SwiGLU intermediates, and peft's fp32 copy
of each LoRA layer's input with its A's output, at the adapter's own rank), one layer's worth
plus each layer's input with gradient checkpointing, every layer's without; the output
layer's fp32 logits for one chunk of tokens; and a packed row's attention mask.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Iterator

import torch

from skytrain_backend.errors import OutOfMemory
from skytrain_backend.planning.shapes import ModelShape, activation_bytes

__all__ = [
    "MIB",
    "ActivationBudget",
    "ModelShape",
    "activation_bytes",
    "out_of_memory_as_error",
    "release_device_memory",
]

MIB = 1024 * 1024


class ActivationBudget:
    """Refuses rows whose activations would not fit; see the module docstring."""

    def __init__(
        self,
        shape: ModelShape,
        *,
        device: torch.device,
        dtype_bytes: int,
        gradient_checkpointing: bool,
        limit_bytes: int | None,
        lora_rank: int,
        lora_modules: tuple[str, ...] | None = None,
        devices: tuple[torch.device, ...] = (),
    ) -> None:
        self.shape = shape
        self.lora_rank, self.lora_modules = lora_rank, lora_modules
        self.device = device
        # Every GPU the model is spread over (device_map "auto"); default: ``device`` alone.
        self.devices = devices or (device,)
        self.dtype_bytes = dtype_bytes
        self.gradient_checkpointing = gradient_checkpointing
        self.limit_bytes = limit_bytes

    def available(self) -> tuple[int, str] | None:
        """The bytes a step may use and where that number comes from; None: no limit."""
        if self.limit_bytes is not None:
            return self.limit_bytes, "the worker's limit (SKYTRAIN_TRAINER_MEMORY_LIMIT_MB)"
        if self.device.type != "cuda":
            return None
        total = 0
        for device in self.devices:
            free, _ = torch.cuda.mem_get_info(device)
            # Memory torch's allocator holds but does not use is free for this step too.
            total += free + torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        where = ", ".join(str(device) for device in self.devices)
        return total, f"free on {where}"

    def check(self, *, row_tokens: int, chunk_size: int, packed: bool = True) -> None:
        """Raise OutOfMemory if a row of ``row_tokens`` would not fit."""
        available = self.available()
        if available is None:
            return
        limit, source = available
        needed = activation_bytes(
            self.shape,
            row_tokens=row_tokens,
            chunk_size=chunk_size,
            dtype_bytes=self.dtype_bytes,
            gradient_checkpointing=self.gradient_checkpointing,
            lora_rank=self.lora_rank,
            lora_modules=self.lora_modules,
            packed=packed,
        )
        if needed > limit:
            raise OutOfMemory(
                f"out of memory: a training step over a row of {row_tokens} tokens needs about "
                f"{needed / MIB:.1f} MiB of activations, more than the {limit / MIB:.1f} MiB "
                f"{source}: lower packed_sequence_length (or the model's max_seq_length), "
                "turn on gradient_checkpointing, or train on a GPU with more memory"
            )


def release_device_memory(device: torch.device) -> None:
    """Return what freed tensors held to the device (CUDA's cache included)."""
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


@contextlib.contextmanager
def out_of_memory_as_error(what: str, device: torch.device) -> Iterator[None]:
    """CUDA's out-of-memory error in ``what`` as OutOfMemory, after freeing its leftovers."""
    detail: str | None = None
    try:
        yield
    except torch.OutOfMemoryError as exc:
        detail = str(exc).splitlines()[0] if str(exc) else "no detail"
    if detail is not None:
        # Out of the except block: the failed step's frames, and the tensors they held, are gone.
        release_device_memory(device)
        raise OutOfMemory(
            f"out of memory while {what} on {device} ({detail}): lower packed_sequence_length "
            "(or the model's max_seq_length), turn on gradient_checkpointing, or train on a "
            "GPU with more memory"
        ) from None

"""One trainer as N processes: the frozen base sharded with FSDP2, the LoRA adapter replicated.

Started by ``torchrun`` (``worker.sharded`` builds its command line), each process is a rank
of a process group: NCCL on CUDA (one GPU a rank, ``LOCAL_RANK``), gloo on CPU (the tests).
What each rank does:

- **loads** the model once: rank 0 reads the base model and makes the seeded adapter in host
  memory, the others build the same model on the meta device (no storage); every decoder
  layer's frozen weights are then sharded over the ranks with
  ``torch.distributed.fsdp.fully_shard`` (FSDP2), and rank 0's weights reach every rank's
  shard (``set_model_state_dict(..., broadcast_from_rank0=True)``; buffers by broadcast).
  The LoRA parameters, the embeddings, the final norm and the output layer stay whole on
  every rank (``ignored_params``): the adapter and Adam's state are replicated, so the
  optimizer step, ``save`` and ``optimizer.pt`` are exactly those of one process.
- **prepares** the same plan from the same input (packing and steps are deterministic), and
  **takes its share of each step's rows**: row ``i`` belongs to rank ``i % N``. FSDP gathers
  a layer's weights from every rank at each forward and backward, so every rank runs the
  same number of rows a step: a rank short of a row runs the step's first row again with
  its loss and metrics multiplied by zero (``Shards.rows``).
- **sums the adapter's gradients** over the ranks (``all_reduce``) before clipping: each
  row's loss is already divided by the step's total token count, so the sum is the gradient
  one process accumulates over every row, and the update equals its update up to the order
  of floating-point additions. Metrics and the sampler-agreement differences are summed and
  gathered the same way.
- **saves once**: rank 0 writes the checkpoint (and a stopped job's progress, with the old
  logprobs gathered from every rank); the others wait at a barrier.

One process (no ``torchrun``, or a world of one) is ``SINGLE``: every method is then the
identity, and the trainer runs exactly as it did before.

Dropout: each row draws its masks from a generator of its own (``TrainerCore._row_masks``,
seeded by the job, the step and the row), so a row draws the same masks on whichever rank
runs it, and N processes make one process's update with LoRA dropout too.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

T = TypeVar("T")
# How long a rank waits for the others at a collective before failing (loading the base
# model on a slow disk is the longest wait).
COLLECTIVE_TIMEOUT = datetime.timedelta(minutes=30)
# Files rank 0 sends to other nodes go in pieces of this size (``Shards.share``).
SHARE_CHUNK_BYTES = 64 * 1024 * 1024


@dataclass(frozen=True)
class Shards:
    """This process's rank among ``world`` trainer processes."""

    rank: int = 0
    world: int = 1

    @property
    def sharded(self) -> bool:
        return self.world > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @classmethod
    def from_environment(cls) -> Shards:
        """The process group ``torchrun`` describes (``WORLD_SIZE``, ``RANK``...), joined
        now; ``SINGLE`` outside torchrun."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return SINGLE
        if not dist.is_initialized():
            backend = "nccl" if torch.cuda.is_available() else "gloo"
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            dist.init_process_group(backend, timeout=COLLECTIVE_TIMEOUT)
        return cls(rank=dist.get_rank(), world=dist.get_world_size())

    def device(self) -> torch.device | None:
        """This rank's device (its local GPU), None for the trainer's default."""
        if self.sharded and torch.cuda.is_available():
            return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        return None

    # --- the model ---------------------------------------------------------------------------

    def shard(self, model: Any, device: torch.device) -> None:
        """Shard ``model``'s (a peft model's) decoder layers over the ranks, keeping what
        trains and what runs outside the layers whole on every rank. Rank 0's ``model`` has
        the weights; the others' is on the meta device and gets them from rank 0."""
        if not self.sharded:
            return
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
        )
        from torch.distributed.fsdp import fully_shard

        # Rank 0's whole weights, taken before sharding moves them (the one host copy).
        full = model.state_dict() if self.is_main else {}
        base = model.get_base_model()
        decoder = base.get_decoder()
        whole = {p for p in model.parameters() if p.requires_grad}
        for module in (decoder.embed_tokens, getattr(decoder, "norm", None), base.lm_head):
            if module is not None:
                whole |= set(module.parameters())
        for layer in decoder.layers:
            fully_shard(layer, ignored_params=whole)
        fully_shard(decoder, ignored_params=whole)
        if self.is_main:
            # FSDP moves what it shards to the device; the rest goes there by hand.
            for parameter in whole:
                parameter.data = parameter.data.to(device)
        else:
            model.to_empty(device=device)
        set_model_state_dict(
            model,
            full,
            options=StateDictOptions(full_state_dict=True, broadcast_from_rank0=True),
        )
        del full
        # Buffers (rotary frequencies...) are not all in the state dict: rank 0's, as they are.
        for owner in model.modules():
            for name, buffer in list(owner.named_buffers(recurse=False)):
                moved = (
                    buffer.to(device) if self.is_main else torch.empty_like(buffer, device=device)
                )
                dist.broadcast(moved, src=0)
                owner._buffers[name] = moved

    # --- rows --------------------------------------------------------------------------------

    def rows(self, rows: Sequence[T]) -> Iterator[tuple[int, T, float]]:
        """This rank's share of a step's rows as ``(position, row, scale)``: rows ``rank``,
        ``rank + world``...; then, for each round it has no row of, the first row again with
        ``scale`` 0 (every rank runs as many forward and backward passes)."""
        if not self.sharded:
            for position, row in enumerate(rows):
                yield position, row, 1.0
            return
        rounds = -(-len(rows) // self.world)
        for round_ in range(rounds):
            position = round_ * self.world + self.rank
            if position < len(rows):
                yield position, rows[position], 1.0
            elif rows:
                yield 0, rows[0], 0.0

    # --- collectives -------------------------------------------------------------------------

    def sum_gradients(self, parameters: Sequence[torch.nn.Parameter]) -> None:
        """Every rank's gradients summed into each rank's (a parameter no row of a rank
        reached counts as zero there)."""
        if not self.sharded:
            return
        for parameter in parameters:
            if parameter.grad is None:
                parameter.grad = torch.zeros_like(parameter)
            dist.all_reduce(parameter.grad, op=dist.ReduceOp.SUM)

    def sum(self, values: dict[str, float]) -> dict[str, float]:
        """``values`` summed over the ranks (every rank must pass the same keys)."""
        if not self.sharded or not values:
            return values
        keys = sorted(values)
        totals = torch.tensor([values[key] for key in keys], dtype=torch.float64)
        dist.all_reduce(totals, op=dist.ReduceOp.SUM)
        return dict(zip(keys, totals.tolist(), strict=True))

    def any(self, flag: bool) -> bool:
        """Whether ``flag`` is true on any rank (every rank learns the same answer)."""
        if not self.sharded:
            return flag
        value = torch.tensor([1 if flag else 0])
        dist.all_reduce(value, op=dist.ReduceOp.MAX)
        return bool(value.item())

    def gather(self, value: T) -> list[T]:
        """Every rank's ``value``, in rank order (picklable objects: small data only)."""
        if not self.sharded:
            return [value]
        gathered: list[Any] = [None] * self.world
        dist.all_gather_object(gathered, value)
        return gathered

    def broadcast(self, value: T | None) -> T:
        """Rank 0's ``value`` on every rank (a picklable object: small data only)."""
        if not self.sharded:
            assert value is not None
            return value
        box: list[Any] = [value if self.is_main else None]
        dist.broadcast_object_list(box, src=0)
        return box[0]

    def share(
        self, sources: Mapping[str, Path | None], into: Path | None
    ) -> dict[str, Path | None]:
        """Rank 0's files and directories (``sources``, by name) copied to ``into`` on every
        rank that passes one (a rank on another node than rank 0: it cannot read the worker's
        disk), in pieces over the process group; what each rank reads instead of
        ``sources``. Nothing moves when no rank passes ``into``."""
        if not self.sharded or not self.any(into is not None):
            return dict(sources)
        listings = self.broadcast(
            {name: _listing(path) for name, path in sources.items()} if self.is_main else None
        )
        device = self.device() or torch.device("cpu")
        found: dict[str, Path | None] = {}
        for name, listing in listings.items():
            if listing is None:
                found[name] = None
                continue
            is_dir, files = listing
            source = sources.get(name) if self.is_main else None
            target = into / name if into is not None else None
            if target is not None and is_dir:
                target.mkdir(parents=True, exist_ok=True)
            for relative, size in files:
                self._send_file(
                    (source / relative if is_dir else source) if source else None,
                    target / relative if target else None,
                    size,
                    device,
                )
            if target is not None:
                found[name] = target if is_dir else target / files[0][0]
            else:
                found[name] = sources.get(name)
        return found

    def _send_file(
        self, source: Path | None, target: Path | None, size: int, device: torch.device
    ) -> None:
        """Rank 0's ``source`` (``size`` bytes) written to ``target`` where a rank has one."""
        if target is not None:
            target.parent.mkdir(parents=True, exist_ok=True)
        with contextlib.ExitStack() as stack:
            reader = stack.enter_context(source.open("rb")) if source is not None else None
            writer = stack.enter_context(target.open("wb")) if target is not None else None
            done = 0
            while done < size:
                length = min(SHARE_CHUNK_BYTES, size - done)
                if reader is not None:
                    piece = torch.frombuffer(bytearray(reader.read(length)), dtype=torch.uint8)
                    piece = piece.to(device)
                else:
                    piece = torch.empty(length, dtype=torch.uint8, device=device)
                dist.broadcast(piece, src=0)
                if writer is not None:
                    writer.write(piece.cpu().numpy().tobytes())
                done += length

    def barrier(self) -> None:
        if self.sharded:
            dist.barrier()

    def close(self) -> None:
        if self.sharded and dist.is_initialized():
            dist.destroy_process_group()


SINGLE = Shards()


def _listing(path: Path | None) -> tuple[bool, list[tuple[str, int]]] | None:
    """Whether ``path`` is a directory, and its files (relative names and sizes)."""
    if path is None:
        return None
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file())
        return True, [(str(p.relative_to(path)), p.stat().st_size) for p in files]
    return False, [(path.name, path.stat().st_size)]

"""What a worker needs of its host beside the GPUs: memory and disk.

Host memory holds, at its peak (a training job running while Tinker runs wait):

- vLLM's weights and LoRA slots, pinned there while it sleeps (level 1) for a job;
- each Tinker run's trainer parked between its operations (``Trainer.offload`` moves the
  whole trainer: its bf16 base weights, and the LoRA weights, gradients and Adam's moments),
  at most ``SKYTRAIN_WORKER_TINKER_MAX_RUNS`` of them; a sharded trainer runs no Tinker runs;
- a sharded trainer's first process reading the whole base before FSDP spreads it;
- the processes themselves: vLLM's API server and engine core, the worker and the trainer
  (torch, CUDA libraries, tokenizers), and each further tensor-parallel process.

Disk is the checkpoint plus the image, packages and scratch. A worker without a GPU has no
plan; ``cpu_worker_host_bytes`` is the host memory it cannot do without. Pure arithmetic.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from skytrain_backend.planning.gpus import GIB, gib
from skytrain_backend.planning.shapes import ModelShape

HOST_BASE_GIB = 10.0
HOST_PER_GPU_PROCESS_GIB = 2.0
# Disk beside the checkpoint: the vLLM image unpacked, packages, adapters, logs.
DISK_BASE_GB = 60
GB = 1000**3


@dataclass(frozen=True)
class HostNeeds:
    memory_gb: int
    memory_how: str
    disk_gb: int
    disk_how: str


def host_needs(
    shape: ModelShape,
    *,
    pinned_bytes: float,
    vllm_gpus: int,
    trainer_shards: int,
    trainer_bytes: float,
    parked_trainers: int,
) -> HostNeeds:
    """Host memory and disk for a worker whose vLLM pins ``pinned_bytes`` while asleep, over
    ``vllm_gpus`` GPUs, whose trainer (``trainer_bytes``: bf16 base and LoRA states) runs as
    ``trainer_shards`` processes, and which parks up to ``parked_trainers`` Tinker runs."""
    weights = shape.parameters() * 2
    loading = weights if trainer_shards > 1 else 0
    parked = parked_trainers * trainer_bytes if trainer_shards == 1 else 0
    processes = (HOST_BASE_GIB + HOST_PER_GPU_PROCESS_GIB * vllm_gpus) * GIB
    memory_gb = math.ceil((pinned_bytes + parked + loading + processes) / GB)
    memory_how = (
        f"vLLM's weights and LoRA slots pinned while asleep {gib(pinned_bytes)}"
        + (
            f" + {parked_trainers} Tinker runs' trainers parked between operations "
            f"({gib(trainer_bytes)} each: bf16 base and LoRA states) {gib(parked)}"
            if parked
            else ""
        )
        + (
            f" + the base as the first of {trainer_shards} trainer processes loads it "
            f"{gib(loading)}"
            if loading
            else ""
        )
        + f" + processes {HOST_BASE_GIB:g} GiB + {HOST_PER_GPU_PROCESS_GIB:g} GiB per vLLM GPU"
    )
    checkpoint = shape.parameters() * shape.checkpoint_dtype_bytes
    disk_gb = math.ceil((checkpoint / GB + DISK_BASE_GB) / 10) * 10
    disk_how = (
        f"checkpoint {checkpoint / GB:.1f} GB ({shape.checkpoint_dtype_bytes} B a parameter) "
        f"+ image, packages and scratch {DISK_BASE_GB} GB, to the next 10"
    )
    return HostNeeds(memory_gb, memory_how, disk_gb, disk_how)


def cpu_worker_host_bytes(shape: ModelShape, *, lora_rank: int, tinker_runs: int) -> int:
    """The least host memory a worker without a GPU needs: the built-in engine's copy of the
    weights (at the checkpoint's dtype), and an fp32 trainer (weights and LoRA states) for a
    job and for each Tinker run it holds (on a CPU, nothing is parked: each keeps its own).
    A floor: the processes' own memory comes on top."""
    trainers = (1 + tinker_runs) * (
        shape.parameters() * 4 + shape.lora_parameters(rank=lora_rank) * 16
    )
    return shape.parameters() * shape.checkpoint_dtype_bytes + trainers

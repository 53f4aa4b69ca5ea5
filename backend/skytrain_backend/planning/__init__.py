"""The GPU memory plan: how a base model is served and trained on a worker's GPUs.

One answer shared by everything that sizes a worker: ``skytrain workers plan`` prints it, the
SkyPilot provider asks for the GPUs, host memory and disk it names, model creation refuses a
base model that fits none of the configured GPUs, and a worker starts vLLM and loads the
trainer with its numbers. Pure arithmetic on a model's ``config.json`` and a table of GPUs:
no torch, no transformers (the control plane imports it).

- ``gpus``: the GPU table and ``L4:1``-style specs;
- ``shapes``: a model's sizes from its config, parameter and KV-cache counts, and the
  trainer's activation estimate (``trainer.memory`` uses it);
- ``plan``: ``plan_worker``, the plan for one model on ``GPU:N``;
- ``host``: the host memory and disk a worker needs beside its GPUs;
- ``choice``: ``choose_gpu``, the cheapest of the configured GPUs that fits;
- ``configs``: a model's ``config.json`` from this machine's copies;
- ``experts``: mixtures of experts, refused everywhere with the reason.
"""

from skytrain_backend.planning.choice import FitsNoGpu, GpuChoice, choose_gpu, choose_worker_gpu
from skytrain_backend.planning.configs import find_model_config
from skytrain_backend.planning.gpus import GPU_TYPES, GpuSpec, GpuType, gpu_from_device, parse_gpu
from skytrain_backend.planning.plan import (
    LORA_RANKS,
    PlanRow,
    WorkerPlan,
    lora_rank_slot,
    plan_worker,
)
from skytrain_backend.planning.shapes import ModelShape, UnplannableModel, activation_bytes

__all__ = [
    "GPU_TYPES",
    "LORA_RANKS",
    "FitsNoGpu",
    "GpuChoice",
    "GpuSpec",
    "GpuType",
    "ModelShape",
    "PlanRow",
    "UnplannableModel",
    "WorkerPlan",
    "activation_bytes",
    "choose_gpu",
    "choose_worker_gpu",
    "find_model_config",
    "gpu_from_device",
    "lora_rank_slot",
    "parse_gpu",
    "plan_worker",
]

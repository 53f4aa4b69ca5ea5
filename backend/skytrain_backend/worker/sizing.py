"""A worker's memory plan on its own GPUs: the numbers vLLM and the trainer start with.

A worker the SkyPilot provider launched is told the plan's numbers (``SKYTRAIN_ENGINE_*`` and
``SKYTRAIN_TRAINER_*``, made for the GPU it asked for). A worker started any other way on
CUDA (by hand, or for a base model whose config the control plane did not have) makes the
plan itself, for the GPUs it finds, and fills in whatever it was not told; a setting that
is given always wins. A plan that says the model does not fit stops the worker before vLLM
starts, with the plan's reason; a config it cannot read or count leaves vLLM and the trainer
to their own defaults.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.planning import (
    GpuType,
    ModelShape,
    UnplannableModel,
    WorkerPlan,
    gpu_from_device,
    plan_worker,
)

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class Sizing:
    """What the worker starts vLLM and loads trainers with."""

    # EngineOptions fields (None: vLLM's or the engine's own default).
    engine: dict[str, Any] = field(default_factory=dict)
    # Trainer.load keywords.
    trainer: dict[str, Any] = field(default_factory=dict)
    plan: WorkerPlan | None = None
    # Trainer processes: more than 1 runs jobs under torchrun (``worker.sharded``).
    trainer_shards: int = 1


def _told(settings: Settings) -> dict[str, Any]:
    """The settings the plan may fill in (None: not given)."""
    return {
        "max_model_len": settings.engine_max_model_len,
        "gpu_memory_utilization": settings.engine_gpu_memory_utilization,
        "tensor_parallel_size": settings.engine_tensor_parallel_size,
        "gradient_checkpointing": settings.trainer_gradient_checkpointing,
        "max_row_tokens": settings.trainer_max_row_tokens,
        "device_map": settings.trainer_device_map,
        "shards": settings.trainer_shards,
    }


def _planned(plan: WorkerPlan) -> dict[str, Any]:
    return {
        "max_model_len": plan.max_model_len,
        "gpu_memory_utilization": plan.gpu_memory_utilization,
        "tensor_parallel_size": plan.tensor_parallel_size,
        "gradient_checkpointing": plan.gradient_checkpointing,
        "max_row_tokens": plan.max_row_tokens,
        "device_map": plan.trainer_device_map,
        "shards": plan.trainer_shards,
    }


def _sizing(values: dict[str, Any], plan: WorkerPlan | None = None) -> Sizing:
    return Sizing(
        engine={
            key: values[key]
            for key in ("max_model_len", "gpu_memory_utilization", "tensor_parallel_size")
        },
        trainer={
            "gradient_checkpointing": values["gradient_checkpointing"],
            "max_row_tokens": values["max_row_tokens"],
            # The in-process trainer spreads a model it cannot hold on one GPU; a sharded
            # one (trainer_shards > 1) runs under torchrun instead (worker.sharded).
            "spread": values["device_map"] in ("auto", "fsdp"),
        },
        plan=plan,
        trainer_shards=values["shards"] or 1,
    )


def size_worker(
    settings: Settings,
    *,
    base_model: str,
    config: dict[str, Any] | None,
    gpu: GpuType | None,
    gpu_count: int = 1,
) -> Sizing:
    """The settings, with the plan for ``gpu_count`` x ``gpu`` filling in the unset ones.

    ``gpu`` None (no CUDA) or a ``config`` None (not found): the settings alone.
    ConfigurationError when the plan says the model does not fit.
    """
    told = _told(settings)
    if gpu is None or None not in told.values():
        return _sizing(told)
    if config is None:
        logger.warning("no config.json for %s: vLLM and the trainer use their defaults", base_model)
        return _sizing(told)
    try:
        shape = ModelShape.from_config(config)
    except UnplannableModel as exc:
        logger.warning(
            "no memory plan for %s (%s): vLLM and the trainer use their defaults", base_model, exc
        )
        return _sizing(told)
    plan = plan_worker(
        shape,
        gpu,
        model=base_model,
        gpu_count=gpu_count,
        lora_rank=settings.engine_max_lora_rank,
        max_loras=settings.engine_max_loras,
        context=settings.engine_max_model_len,
        row_tokens=settings.trainer_max_row_tokens,
        tinker_runs=settings.worker_tinker_max_runs,
    )
    if not plan.fits:
        raise ConfigurationError(f"this worker cannot serve and train {base_model}: {plan.reason}")
    logger.info("memory plan: %s", plan.reason)
    planned = _planned(plan)
    return _sizing(
        {key: value if value is not None else planned[key] for key, value in told.items()}, plan
    )


def size_this_worker(settings: Settings, *, base_model: str) -> Sizing:
    """``size_worker`` for the GPUs this machine has (none without CUDA), reading the base
    model's config only when a setting is left to the plan."""
    if None not in _told(settings).values():
        return _sizing(_told(settings))
    found = cuda_gpus()
    if found is None:
        return _sizing(_told(settings))
    from skytrain_backend import hub

    gpu, count = found
    return size_worker(
        settings,
        base_model=base_model,
        config=hub.model_config(base_model),
        gpu=gpu,
        gpu_count=count,
    )


def cuda_gpus() -> tuple[GpuType, int] | None:
    """The GPU this worker runs on (CUDA's name and total memory of device 0) and how many
    the node has; None without CUDA. Device properties need no CUDA context, so the worker
    holds no GPU memory before vLLM starts."""
    import torch

    if not torch.cuda.is_available():
        return None
    properties = torch.cuda.get_device_properties(0)
    return gpu_from_device(properties.name, properties.total_memory), torch.cuda.device_count()

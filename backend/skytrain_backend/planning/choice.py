"""Which of the GPUs workers may get a base model goes on: the cheapest that fits.

Used where a worker is asked for (the SkyPilot provider) and where a model is created (a
base model that fits none of them is refused there, with each GPU's reason). A GPU the table
does not know cannot be judged: when one is configured and no known GPU fits, the choice is
left to SkyPilot and the worker.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from skytrain_backend.config import Settings
from skytrain_backend.errors import FitsNoGpu
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning.configs import find_model_config
from skytrain_backend.planning.gpus import GpuSpec, parse_gpu
from skytrain_backend.planning.plan import WorkerPlan, plan_worker
from skytrain_backend.planning.shapes import ModelShape, UnplannableModel


@dataclass(frozen=True)
class GpuChoice:
    """The cheapest configured GPU that fits and its plan; both None when only GPUs the
    table does not know might (SkyPilot and the worker decide)."""

    spec: GpuSpec | None
    plan: WorkerPlan | None
    # Every known GPU's plan, cheapest first.
    plans: tuple[WorkerPlan, ...]


def _spec(accelerator: str) -> GpuSpec:
    """A configured accelerator; one of a shape the table cannot read counts as unknown."""
    try:
        return parse_gpu(accelerator)
    except ValueError:
        return GpuSpec(accelerator, 1, None)


def choose_gpu(
    shape: ModelShape, accelerators: Sequence[str], *, model: str, **options: Any
) -> GpuChoice:
    """Plan ``model`` on each of ``accelerators`` (``'L4:1'``...) and take the cheapest that
    fits (ties: the first listed); FitsNoGpu, with each one's reason, when none does.

    ``options`` are ``plan_worker``'s (lora_rank, max_loras, context...).
    """
    specs = [_spec(accelerator) for accelerator in accelerators]
    known = sorted(
        (spec for spec in specs if spec.gpu is not None),
        key=lambda spec: spec.usd_per_hour or 0.0,
    )
    plans = tuple(
        plan_worker(shape, spec.gpu, model=model, gpu_count=spec.count, **options)
        for spec in known
        if spec.gpu is not None
    )
    for spec, plan in zip(known, plans, strict=True):
        if plan.fits:
            return GpuChoice(spec, plan, plans)
    if len(known) < len(specs):
        return GpuChoice(None, None, plans)
    reasons = "; ".join(f"{plan.gpu}: {plan.reason}" for plan in plans)
    raise FitsNoGpu(
        f"base model {model} fits none of the GPUs workers may get ({', '.join(accelerators)}). "
        f"{reasons}. Choose a smaller base model, or ask the operator for larger GPUs "
        "(SKYTRAIN_SKYPILOT_ACCELERATORS)"
    )


def choose_worker_gpu(
    base_model: str,
    accelerators: Sequence[str],
    *,
    settings: Settings,
    lora_rank: int,
    config: JSONObject | None = None,
) -> GpuChoice | None:
    """``choose_gpu`` for a worker of ``base_model`` serving and training adapters of up to
    ``lora_rank`` (the rank in use: a model's own at its creation, the largest of the models
    a worker is launched for; never above ``SKYTRAIN_ENGINE_MAX_LORA_RANK``), with the engine
    settings (LoRA slots, context, row length, parked Tinker runs, nodes a worker), from its
    ``config``
    (default: this machine's copy), or None when there is none (or it cannot be counted):
    the worker, which downloads the model, plans for itself."""
    if config is None:
        config = find_model_config(base_model, cache_dir=settings.storage.resolved_model_cache_dir)
    if config is None:
        return None
    try:
        shape = ModelShape.from_config(config)
    except UnplannableModel:
        return None
    return choose_gpu(
        shape,
        accelerators,
        model=base_model,
        lora_rank=min(lora_rank, settings.engine.max_lora_rank),
        max_loras=settings.engine.max_loras,
        context=settings.engine.max_model_len,
        row_tokens=settings.trainer.max_row_tokens,
        tinker_runs=settings.worker.tinker_max_runs,
        nodes=settings.skypilot.num_nodes,
    )

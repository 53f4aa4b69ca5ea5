"""A worker's memory plan on its own GPUs: the numbers vLLM and the trainer start with.

A worker the SkyPilot provider launched is told the plan's numbers (``SKYTRAIN_ENGINE_*`` and
``SKYTRAIN_TRAINER_*``, made for the GPU it asked for). A worker started any other way on
CUDA (by hand, or for a base model whose config the control plane did not have) makes the
plan itself, for the GPUs it finds, and fills in whatever it was not told; a setting that
is given always wins. A plan that says the model does not fit stops the worker before vLLM
starts, with the plan's reason; a config it cannot read or count leaves vLLM and the trainer
to their own defaults. A mixture of experts stops the worker, GPU or not, before anything
loads (``planning.experts``).

Before it loads anything, the worker checks the machine it got against what it needs
(``check_machine``): its host memory (psutil's, or a container's cgroup memory limit
when lower: ``host_memory_bytes``) against the plan's, or, without a GPU, against
the copies of the weights it will hold (``planning.host.cpu_worker_host_bytes``); and on CUDA
each GPU vLLM uses must have vLLM's share free (``torch.cuda.mem_get_info``), which vLLM
itself refuses to start without. A machine short of either stops the worker with
``MachineTooSmall``, naming both figures.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypedDict

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError, MachineTooSmall
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning import (
    GpuType,
    ModelShape,
    UnplannableModel,
    WorkerPlan,
    experts,
    find_model_config,
    gpu_from_device,
    plan_worker,
)
from skytrain_backend.planning.gpus import GIB
from skytrain_backend.planning.host import GB, cpu_worker_host_bytes

logger = logging.getLogger(__name__)


class EngineSizing(TypedDict):
    """EngineOptions fields the plan sets (None: vLLM's or the engine's own default)."""

    max_model_len: int | None
    gpu_memory_utilization: float | None
    tensor_parallel_size: int | None


class TrainerSizing(TypedDict, total=False):
    """Trainer.load's memory-plan keywords."""

    gradient_checkpointing: bool | None
    max_row_tokens: int | None
    # The in-process trainer spreads a model it cannot hold on one GPU.
    spread: bool


@dataclass(frozen=True)
class Sizing:
    """What the worker starts vLLM and loads trainers with."""

    engine: EngineSizing = field(
        default_factory=lambda: EngineSizing(
            max_model_len=None, gpu_memory_utilization=None, tensor_parallel_size=None
        )
    )
    trainer: TrainerSizing = field(default_factory=TrainerSizing)
    plan: WorkerPlan | None = None
    # Trainer processes: more than 1 runs jobs under torchrun (``worker.sharded``).
    trainer_shards: int = 1
    # The host memory the worker needs (None: unknown, not checked).
    host_memory_bytes: int | None = None


@dataclass(frozen=True)
class _Knobs:
    """The numbers a setting or the plan gives (None: not given), named as the plan's
    fields (``WorkerPlan``)."""

    max_model_len: int | None
    gpu_memory_utilization: float | None
    tensor_parallel_size: int | None
    gradient_checkpointing: bool | None
    max_row_tokens: int | None
    trainer_device_map: str | None
    trainer_shards: int | None

    def given(self) -> bool:
        return None not in dataclasses.astuple(self)

    def filled_from(self, other: _Knobs) -> _Knobs:
        """These knobs, with ``other``'s where these are None."""
        return dataclasses.replace(
            self,
            **{
                knob.name: getattr(other, knob.name)
                for knob in dataclasses.fields(self)
                if getattr(self, knob.name) is None
            },
        )


def _told(settings: Settings) -> _Knobs:
    """The settings the plan may fill in (None: not given)."""
    return _Knobs(
        max_model_len=settings.engine.max_model_len,
        gpu_memory_utilization=settings.engine.gpu_memory_utilization,
        tensor_parallel_size=settings.engine.tensor_parallel_size,
        gradient_checkpointing=settings.trainer.gradient_checkpointing,
        max_row_tokens=settings.trainer.max_row_tokens,
        trainer_device_map=settings.trainer.device_map,
        trainer_shards=settings.trainer.shards,
    )


def _planned(plan: WorkerPlan) -> _Knobs:
    return _Knobs(**{knob.name: getattr(plan, knob.name) for knob in dataclasses.fields(_Knobs)})


def _sizing(values: _Knobs, plan: WorkerPlan | None = None) -> Sizing:
    host = plan.host_memory_gb if plan is not None else None
    return Sizing(
        engine=EngineSizing(
            max_model_len=values.max_model_len,
            gpu_memory_utilization=values.gpu_memory_utilization,
            tensor_parallel_size=values.tensor_parallel_size,
        ),
        trainer=TrainerSizing(
            gradient_checkpointing=values.gradient_checkpointing,
            max_row_tokens=values.max_row_tokens,
            # The in-process trainer spreads a model it cannot hold on one GPU; a sharded
            # one (trainer_shards > 1) runs under torchrun instead (worker.sharded).
            spread=values.trainer_device_map in ("auto", "fsdp"),
        ),
        plan=plan,
        trainer_shards=values.trainer_shards or 1,
        host_memory_bytes=host * GB if host is not None else None,
    )


def size_worker(
    settings: Settings,
    *,
    base_model: str,
    config: JSONObject | None,
    gpu: GpuType | None,
    gpu_count: int = 1,
    nodes: int = 1,
) -> Sizing:
    """The settings, with the plan for ``gpu_count`` x ``gpu`` (on each of ``nodes`` nodes)
    filling in the unset ones.

    ``gpu`` None (no CUDA) or a ``config`` None (not found): the settings alone.
    ConfigurationError when the plan says the model does not fit, or ``config`` is a
    mixture of experts (``planning.experts``), whatever the worker was told.
    """
    _refuse_experts(base_model, config)
    told = _told(settings)
    if gpu is None:
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
        lora_rank=settings.engine.max_lora_rank,
        max_loras=settings.engine.max_loras,
        context=settings.engine.max_model_len,
        row_tokens=settings.trainer.max_row_tokens,
        tinker_runs=settings.worker.tinker_max_runs,
        nodes=nodes,
    )
    if told.given():
        # Told everything: the plan only sizes the machine check (when it has figures).
        return _sizing(told, plan if plan.fits else None)
    if not plan.fits:
        raise ConfigurationError(f"this worker cannot serve and train {base_model}: {plan.reason}")
    logger.info("memory plan: %s", plan.reason)
    return _sizing(told.filled_from(_planned(plan)), plan)


def task_nodes(env: Mapping[str, str]) -> int:
    """The nodes of the SkyPilot task this worker runs in (``SKYPILOT_NODE_IPS``; one
    without it): a worker of several nodes plans for all of them."""
    return max(1, len([ip for ip in env.get("SKYPILOT_NODE_IPS", "").splitlines() if ip.strip()]))


def size_this_worker(settings: Settings, *, base_model: str) -> Sizing:
    """``size_worker`` for the GPUs this machine has (on each of the task's nodes); without
    CUDA, the settings and the host memory the weights need (when this machine has the base
    model's config.json)."""
    found = cuda_gpus()
    if found is None:
        return _without_gpu(settings, base_model=base_model)
    from skytrain_backend import hub

    gpu, count = found
    return size_worker(
        settings,
        base_model=base_model,
        config=hub.model_config(base_model),
        gpu=gpu,
        gpu_count=count,
        nodes=task_nodes(os.environ),
    )


def _without_gpu(settings: Settings, *, base_model: str) -> Sizing:
    sizing = _sizing(_told(settings))
    config = find_model_config(base_model, cache_dir=settings.storage.resolved_model_cache_dir)
    _refuse_experts(base_model, config)
    try:
        shape = ModelShape.from_config(config) if config is not None else None
    except UnplannableModel:
        shape = None
    if shape is None:
        return sizing
    needed = cpu_worker_host_bytes(
        shape,
        lora_rank=settings.engine.max_lora_rank,
        tinker_runs=settings.worker.tinker_max_runs,
    )
    return dataclasses.replace(sizing, host_memory_bytes=needed)


def _refuse_experts(base_model: str, config: JSONObject | None) -> None:
    reason = experts.check_config(base_model, config)
    if reason is not None:
        raise ConfigurationError(f"this worker cannot serve and train {base_model}: {reason}")


@dataclass(frozen=True)
class Machine:
    """What the worker found: the host's memory, and each GPU's free and total memory."""

    host_memory_bytes: int
    gpus: tuple[tuple[int, int], ...] = ()


CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def _cgroup_paths(cgroup_file: Path) -> dict[str, str]:
    """This process's cgroup per hierarchy, from ``/proc/self/cgroup``: ``""`` for cgroup v2's
    (``0::/path``), ``"memory"`` for v1's memory controller."""
    try:
        lines = cgroup_file.read_text().splitlines()
    except OSError:
        return {}
    paths: dict[str, str] = {}
    for line in lines:
        parts = line.split(":", 2)
        if len(parts) == 3:
            for controller in parts[1].split(","):
                paths[controller] = parts[2].strip().lstrip("/")
    return paths


def _limit(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None  # "max": none


def memory_limit_bytes(root: Path = CGROUP_ROOT, *, cgroup_file: Path = PROC_CGROUP) -> int | None:
    """The memory limit a container (or any cgroup) puts on this process, None without one:
    the lowest ``memory.max`` (cgroup v2) or ``memory.limit_in_bytes`` (v1, under
    ``memory/``) of its cgroup and each above it, under ``root``. Inside a container the
    cgroup is usually mounted as the root itself; outside, ``cgroup_file`` names it."""
    paths = _cgroup_paths(cgroup_file)
    found: list[int] = []
    for base, name, own in (
        (root, "memory.max", paths.get("")),
        (root / "memory", "memory.limit_in_bytes", paths.get("memory")),
    ):
        directory = base / own if own else base
        for folder in (directory, *directory.parents):
            if folder == base.parent:
                break
            limit = _limit(folder / name)
            if limit is not None:
                found.append(limit)
    return min(found) if found else None


def host_memory_bytes(
    total: int, *, cgroup_root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_CGROUP
) -> int:
    """The host memory this process may use: the node's ``total``, or a container's memory
    limit when it is lower (v1's "no limit" is a huge number, so it never is)."""
    limit = memory_limit_bytes(cgroup_root, cgroup_file=cgroup_file)
    return min(total, limit) if limit is not None else total


def this_machine(*, cgroup_root: Path = CGROUP_ROOT, cgroup_file: Path = PROC_CGROUP) -> Machine:
    """This machine's memory (psutil's, or the container's limit when lower), and on CUDA
    each GPU's free and total memory."""
    import psutil

    gpus: tuple[tuple[int, int], ...] = ()
    if cuda_gpus() is not None:
        gpus = _gpu_memory()
    total = psutil.virtual_memory().total
    return Machine(
        host_memory_bytes=host_memory_bytes(
            total, cgroup_root=cgroup_root, cgroup_file=cgroup_file
        ),
        gpus=gpus,
    )


# ``mem_get_info`` makes a CUDA context on every GPU it asks about; in a process of its own,
# the worker keeps none (vLLM checks the same free memory when it starts).
_GPU_MEMORY = (
    "import json, torch; print(json.dumps([torch.cuda.mem_get_info(index) "
    "for index in range(torch.cuda.device_count())]))"
)


def _gpu_memory() -> tuple[tuple[int, int], ...]:
    """(free, total) bytes of each GPU, as CUDA reports them to a short-lived process."""
    import json
    import subprocess
    import sys

    found = subprocess.run(
        [sys.executable, "-c", _GPU_MEMORY], capture_output=True, text=True, timeout=120
    )
    if found.returncode != 0:
        logger.warning("cannot read the GPUs' free memory: %s", found.stderr.strip()[-500:])
        return ()
    return tuple((int(free), int(total)) for free, total in json.loads(found.stdout))


def check_machine(sizing: Sizing, machine: Machine, *, base_model: str) -> None:
    """MachineTooSmall when the host or a GPU vLLM uses has less memory than needed."""
    needed = sizing.host_memory_bytes
    if needed is not None and machine.host_memory_bytes < needed:
        how = f"its memory plan ({sizing.plan.gpu})" if sizing.plan else "the copies of its weights"
        raise MachineTooSmall(
            f"this worker cannot serve and train {base_model}: the host has "
            f"{machine.host_memory_bytes / GIB:.1f} GiB of memory and {how} needs "
            f"{needed / GIB:.1f} GiB: use a machine with more memory, or fewer Tinker runs "
            "at once (SKYTRAIN_WORKER_TINKER_MAX_RUNS)"
        )
    share = sizing.engine.get("gpu_memory_utilization")
    if share is None or not machine.gpus:
        return
    for index, (free, total) in enumerate(
        machine.gpus[: sizing.engine["tensor_parallel_size"] or 1]
    ):
        if free < share * total:
            raise MachineTooSmall(
                f"this worker cannot start vLLM for {base_model}: GPU {index} has "
                f"{free / GIB:.2f} GiB free of {total / GIB:.2f} GiB, and vLLM's share "
                f"(gpu_memory_utilization {share}) is {share * total / GIB:.2f} GiB: another "
                "process holds GPU memory (nvidia-smi shows which), or lower "
                "SKYTRAIN_ENGINE_GPU_MEMORY_UTILIZATION"
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

"""The SkyPilot task of one worker: sky/worker.yaml with the launch's values and the memory
plan's resources (``worker_task``), as the ``skypilot`` provider launches it.

A base model that one node holds gets ``GPU:N`` of the plan (the engine's tensor parallelism
and the trainer's shards use all N); one the operator gives several nodes
(``SKYTRAIN_SKYPILOT_NUM_NODES``) gets ``num_nodes``, with vLLM's pipeline parallelism across
them (Ray, as vLLM documents multi-node serving: sky/worker.yaml starts it) and the
trainer's torchrun ranks on every node (``worker.sharded``, ``worker.follower``).
"""

from __future__ import annotations

import contextlib
import copy
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import yaml

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.json_types import JSONObject
from skytrain_backend.planning.gpus import parse_gpu
from skytrain_backend.provision.base import WorkerLaunch

_PACKAGE_DIR = Path(__file__).resolve().parents[1]
# The process's own traceback limit (None: unset), which SkyPilot's errors may leave at 0.
_TRACEBACK_LIMIT: int | None = getattr(sys, "tracebacklimit", None)
# The wheel ships sky/ as skytrain_backend/_sky; a source checkout has it at the top.
_WORKER_YAML_CANDIDATES = (
    _PACKAGE_DIR / "_sky" / "worker.yaml",
    _PACKAGE_DIR.parents[1] / "sky" / "worker.yaml",
)


def default_worker_yaml() -> Path:
    for candidate in _WORKER_YAML_CANDIDATES:
        if candidate.is_file():
            return candidate
    searched = " and ".join(str(path) for path in _WORKER_YAML_CANDIDATES)
    raise ConfigurationError(
        f"skytrain's sky/worker.yaml is missing (looked in {searched}): "
        "set SKYTRAIN_SKYPILOT_WORKER_YAML to a SkyPilot task for workers"
    )


def load_task_config(path: Path) -> JSONObject:
    try:
        config = yaml.safe_load(path.read_text())
    except (OSError, yaml.YAMLError) as exc:
        raise ConfigurationError(f"cannot read the worker task {path}: {exc}") from None
    if not isinstance(config, dict):
        raise ConfigurationError(f"the worker task {path} is not a SkyPilot task (a mapping)")
    return config


def accelerator_choices(spec: str) -> list[str] | None:
    """``'L4:1, A10G:1'`` -> ``['L4:1', 'A10G:1']``; ``'none'`` -> None (a CPU-only worker)."""
    if spec.strip().lower() == "none":
        return None
    choices = [item.strip() for item in spec.split(",") if item.strip()]
    if not choices:
        raise ConfigurationError(
            f"accelerators {spec!r} name none: list them ('L4:1,A10G:1') or say 'none'"
        )
    return choices


def task_accelerators(task_config: JSONObject) -> list[str] | None:
    """The worker task's own accelerators (``[L4:1, A10G:1]``, ``L4:1`` or ``{L4: 1}``) as
    ``NAME:COUNT`` strings; None when it names none."""
    value = (task_config.get("resources") or {}).get("accelerators")
    if isinstance(value, str):
        return accelerator_choices(value)
    if isinstance(value, dict):
        return [f"{name}:{count}" for name, count in value.items()]
    if isinstance(value, list):
        return [str(item) for item in value]
    return None


def configured_accelerators(
    launch_accelerators: str | None, *, settings: Settings, task_config: JSONObject
) -> list[str] | None:
    """The accelerators a worker may get: the launch's, the settings', else the task's; None
    for CPU-only workers."""
    spec = launch_accelerators or settings.skypilot.accelerators
    if spec:
        return accelerator_choices(spec)
    return task_accelerators(task_config)


def multi_node_envs(choices: list[str] | None, *, nodes: int) -> dict[str, str]:
    """A worker of ``nodes`` nodes of ``GPU:N`` without a plan (a base model whose config is
    unknown): vLLM's tensor parallelism over each node's N GPUs and pipeline stages across
    the nodes; the trainer's ranks on every GPU of every node (the head worker's and the
    other nodes' followers: ``worker.follower``). The accelerators offered must agree on N
    (the split is fixed before SkyPilot picks)."""
    try:
        counts = {parse_gpu(choice).count for choice in choices or []}
    except ValueError as exc:
        raise ConfigurationError(str(exc)) from None
    if len(counts) != 1:
        raise ConfigurationError(
            f"a worker of {nodes} nodes needs GPUs on each (SKYTRAIN_SKYPILOT_ACCELERATORS), all "
            f"with the same count a node, to split the model by; got {choices or 'none'}"
        )
    per_node = counts.pop()
    return {
        "SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE": str(per_node),
        "SKYTRAIN_ENGINE_PIPELINE_PARALLEL_SIZE": str(nodes),
        "SKYTRAIN_TRAINER_DEVICE_MAP": "fsdp",
        "SKYTRAIN_TRAINER_SHARDS": str(per_node * nodes),
    }


def worker_task(launch: WorkerLaunch, *, settings: Settings, task_config: JSONObject) -> Any:
    """The ``sky.Task`` for one worker, parsed and validated by SkyPilot itself.

    The launch's values go in as SkyPilot does for ``sky launch --env/--secret``: settings as
    envs, and the worker token, engine secret and HF token as secrets, which SkyPilot keeps
    out of ``sky status`` and its dashboard.

    Resources come from the memory plan (``planning``) when the base model's config is known
    (the launch's, which the control plane read from the Hub, or this machine's), at the
    launch's LoRA rank (the largest among the models it is launched for): the
    cheapest configured accelerator it fits, exactly, with the host memory
    (``memory: N+``) and disk it needs, and the plan's numbers for the worker as envs
    (``SKYTRAIN_ENGINE_MAX_MODEL_LEN``...); a base model that fits none raises FitsNoGpu.
    Otherwise every configured accelerator is offered and the worker plans for itself.

    With ``skypilot_num_nodes`` above 1 the task has ``num_nodes``, planned for that many
    nodes of each accelerator (a base model no shape fits raises FitsNoGpu before any
    launch), or, without a plan, the multi-node settings (``multi_node_envs``).
    """
    import sky

    from skytrain_backend.planning import choose_worker_gpu

    config = copy.deepcopy(task_config)
    resources = config.setdefault("resources", {})
    choices = configured_accelerators(
        launch.accelerators, settings=settings, task_config=task_config
    )
    if launch.accelerators or settings.skypilot.accelerators:
        if choices is None:
            resources.pop("accelerators", None)
        else:
            resources["accelerators"] = choices
    nodes = settings.skypilot.num_nodes
    choice = (
        choose_worker_gpu(
            launch.base_model,
            choices,
            settings=settings,
            lora_rank=launch.lora_rank or settings.engine.max_lora_rank,
            config=launch.base_model_config,
        )
        if choices
        else None
    )
    planned: dict[str, str] = {}
    if nodes > 1:
        config["num_nodes"] = nodes
        planned = multi_node_envs(choices, nodes=nodes)
    disk_gb = settings.skypilot.disk_size_gb
    if choice is not None and choice.spec is not None and choice.plan is not None:
        resources["accelerators"] = str(choice.spec)
        resources["memory"] = f"{choice.plan.host_memory_gb}+"
        disk_gb = max(disk_gb or 0, choice.plan.disk_gb or 0)
        planned = choice.plan.worker_envs()
    if settings.skypilot.infra:
        resources["infra"] = settings.skypilot.infra
    if disk_gb is not None:
        resources["disk_size"] = disk_gb
    resources["use_spot"] = settings.skypilot.use_spot
    resources["ports"] = settings.skypilot.worker_port
    envs = {
        **planned,
        **launch.envs,
        "SKYTRAIN_CONTROL_PLANE_URL": launch.control_plane_url,
        "SKYTRAIN_WORKER_BASE_MODEL": launch.base_model,
        "SKYTRAIN_WORKER_ID": launch.worker_id,  # on its log lines from the first
        "WORKER_PORT": str(settings.skypilot.worker_port),
    }
    secrets = {
        "SKYTRAIN_WORKER_TOKEN": launch.join_token,
        "SKYTRAIN_ENGINE_SECRET": launch.engine_secret,
        "HF_TOKEN": settings.hub.token.get_secret_value() if settings.hub.token else "",
    }
    with tracebacks_kept():
        return sky.Task.from_yaml_config(
            config, env_overrides=list(envs.items()), secrets_overrides=list(secrets.items())
        )


@contextlib.contextmanager
def tracebacks_kept() -> Iterator[None]:
    """Around every call into SkyPilot: its ``ux_utils.print_exception_no_traceback`` sets
    ``sys.tracebacklimit = 0`` for the error it raises and leaves it there, process-wide, so
    every traceback the control plane logs afterwards would have no frames. A 0 left behind
    is put back to what the process started with (not to what this call saw: another
    thread's SkyPilot call may have set 0 meanwhile)."""
    try:
        yield
    finally:
        if getattr(sys, "tracebacklimit", None) == 0 and _TRACEBACK_LIMIT != 0:
            if _TRACEBACK_LIMIT is None:
                del sys.tracebacklimit
            else:
                sys.tracebacklimit = _TRACEBACK_LIMIT

"""A worker checks the machine it got before loading anything (worker.sizing.check_machine):
its host memory against what it needs, and on CUDA each GPU's free memory against vLLM's
share. The start path is the real one (`skytrain worker`, psutil's figures); the GPU cases
state a machine's figures as a ``Machine`` value (no CUDA here)."""

from __future__ import annotations

import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner, Result

from skytrain_backend.cli import app
from skytrain_backend.config import Settings, get_settings
from skytrain_backend.errors import ConfigurationError, MachineTooSmall
from skytrain_backend.planning import find_model_config, parse_gpu
from skytrain_backend.worker.sizing import (
    Machine,
    check_machine,
    host_memory_bytes,
    memory_limit_bytes,
    size_worker,
    task_nodes,
    this_machine,
)

MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"
QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
GIB = 1024**3


@pytest.fixture
def settings_home(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> Iterator[Path]:
    monkeypatch.setenv("SKYTRAIN_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("SKYTRAIN_ENGINE", "hf")
    get_settings.cache_clear()
    yield tmp_path / "home"
    get_settings.cache_clear()


def _worker_on_a_config_alone(model: Path, name: str) -> tuple[Path, Result]:
    """`skytrain worker` on ``model``, a new directory holding only ``MODELS / name``'s
    config.json: the directory, and the command's result. The control plane's address is
    never reached: the checks come first."""
    model.mkdir()
    shutil.copy(MODELS / name / "config.json", model / "config.json")
    result = CliRunner().invoke(
        app,
        [
            "worker",
            "--control-plane",
            "http://127.0.0.1:9",
            "--token",
            "join-token",
            "--base-model",
            str(model),
        ],
    )
    return model, result


def test_a_worker_on_a_host_smaller_than_its_model_stops_before_loading_anything(
    settings_home: Path, tmp_path: Path
) -> None:
    """Qwen2.5-72B's config.json alone (no weights): the weights a CPU worker would hold are
    far more than this host's memory, so `skytrain worker` stops at start, saying both
    figures, before it contacts the control plane or starts an engine."""
    model, result = _worker_on_a_config_alone(tmp_path / "qwen-72b", "Qwen--Qwen2.5-72B-Instruct")
    assert result.exit_code == 1, result.output
    assert f"error: this worker cannot serve and train {model}: the host has " in result.output
    assert "GiB of memory and the copies of its weights needs " in result.output
    assert "control plane" not in result.output
    worker_dirs = settings_home / "worker"
    assert not worker_dirs.exists() or not list(worker_dirs.rglob("engine.log"))


def test_a_worker_for_a_mixture_of_experts_stops_before_loading_anything(
    settings_home: Path, tmp_path: Path
) -> None:
    """Qwen3-30B-A3B's config.json alone: `skytrain worker` (no GPU here) stops at start with
    the reason, before the machine check, the control plane or an engine; on a GPU the
    worker's plan says the same, even for a worker told every setting."""
    model, result = _worker_on_a_config_alone(tmp_path / "qwen3-moe", "Qwen--Qwen3-30B-A3B")
    assert result.exit_code == 1, result.output
    message = " ".join(result.output.split())
    assert f"error: this worker cannot serve and train {model}: base model {model} is a " in message
    assert "mixture of experts (128 experts a layer)" in message
    assert "the host has" not in message and "control plane" not in message
    config = find_model_config(str(model), cache_dir=MODELS)
    told = Settings(**told_every_setting(gpus=8, device_map="fsdp"), storage={"home": tmp_path})
    with pytest.raises(ConfigurationError, match="is a mixture of experts"):
        size_worker(
            told, base_model=str(model), config=config, gpu=parse_gpu("H100").gpu, gpu_count=8
        )


def told_every_setting(*, gpus: int, device_map: str) -> dict[str, Any]:
    """The settings of a worker told every one that its memory plan reads, on ``gpus``."""
    return {
        "engine": {
            "max_model_len": 8192,
            "gpu_memory_utilization": 0.9,
            "tensor_parallel_size": gpus,
        },
        "trainer": {
            "gradient_checkpointing": True,
            "max_row_tokens": 4096,
            "device_map": device_map,
            "shards": gpus,
        },
    }


def _sizing_7b_on_l4(tmp_path: Path, **settings: Any) -> Any:
    config = find_model_config(QWEN_7B, cache_dir=MODELS)
    sizing = size_worker(
        Settings(**settings, storage={"home": tmp_path}),
        base_model=QWEN_7B,
        config=config,
        gpu=parse_gpu("L4").gpu,
    )
    assert sizing.plan is not None and sizing.host_memory_bytes is not None
    return sizing


def test_a_host_below_the_plans_memory_stops_the_worker(tmp_path: Path) -> None:
    """A 7B on an L4 with two Tinker runs is planned at 60 GB of host memory: a 32 GiB host
    is refused; told every setting, the worker still plans for the check."""
    for sizing in (
        _sizing_7b_on_l4(tmp_path),
        _sizing_7b_on_l4(tmp_path, **told_every_setting(gpus=1, device_map="cuda:0")),
    ):
        l4 = (int(21.5 * GIB), 22_478 * 1024**2)
        with pytest.raises(MachineTooSmall) as raised:
            check_machine(sizing, Machine(32 * GIB, (l4,)), base_model=QWEN_7B)
        assert "the host has 32.0 GiB of memory and its memory plan (L4:1) needs " in str(
            raised.value
        )
        check_machine(sizing, Machine(64 * GIB, (l4,)), base_model=QWEN_7B)


def test_a_gpu_without_vllms_share_free_stops_the_worker(tmp_path: Path) -> None:
    sizing = _sizing_7b_on_l4(tmp_path)
    total = 22_478 * 1024**2
    busy = (int(total * 0.8), total)  # another process holds a fifth of it
    with pytest.raises(MachineTooSmall) as raised:
        check_machine(sizing, Machine(64 * GIB, (busy,)), base_model=QWEN_7B)
    message = str(raised.value)
    assert f"GPU 0 has {busy[0] / GIB:.2f} GiB free of {total / GIB:.2f} GiB" in message
    assert "gpu_memory_utilization 0.92" in message and "nvidia-smi" in message


def _cgroup_tree(root: Path, files: dict[str, str], own: str) -> Path:
    """A cgroup mount under ``root`` (``files``: path -> content) and the /proc/self/cgroup
    naming this process's cgroup ``own`` in it; the latter's path."""
    for name, content in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(content + "\n")
    cgroup_file = root.parent / "proc-self-cgroup"
    cgroup_file.write_text(own + "\n")
    return cgroup_file


@pytest.mark.parametrize(
    ("files", "own", "limit"),
    [
        # cgroup v2 inside a container: its cgroup is the mount's root.
        ({"memory.max": "8589934592"}, "0::/", 8 * GIB),
        ({"memory.max": "max"}, "0::/", None),
        # v2 seen from the node: the lowest of the process's cgroup and those above it.
        (
            {
                "memory.max": "max",
                "kubepods/memory.max": str(12 * GIB),
                "kubepods/pod-1/memory.max": "max",
            },
            "0::/kubepods/pod-1",
            12 * GIB,
        ),
        # cgroup v1: the memory controller's hierarchy; "no limit" is a huge number.
        ({"memory/memory.limit_in_bytes": str(6 * GIB)}, "4:memory:/", 6 * GIB),
        (
            {
                "memory/memory.limit_in_bytes": "9223372036854771712",
                "memory/docker/abc/memory.limit_in_bytes": str(5 * GIB),
            },
            "5:cpu,cpuacct:/\n4:memory:/docker/abc",
            5 * GIB,
        ),
    ],
)
def test_a_containers_memory_limit_is_the_hosts_memory(
    tmp_path: Path, files: dict[str, str], own: str, limit: int | None
) -> None:
    cgroup_file = _cgroup_tree(tmp_path / "cgroup", files, own)
    found = memory_limit_bytes(tmp_path / "cgroup", cgroup_file=cgroup_file)
    assert found == limit
    node = 64 * GIB
    seen = host_memory_bytes(node, cgroup_root=tmp_path / "cgroup", cgroup_file=cgroup_file)
    assert seen == min(node, limit or node)


def test_a_worker_in_a_container_smaller_than_its_plan_stops(tmp_path: Path) -> None:
    """A 64 GiB node whose container may use 32 GiB: the 7B's plan (60 GB) does not fit it."""
    cgroup_file = _cgroup_tree(tmp_path / "cgroup", {"memory.max": str(32 * GIB)}, "0::/")
    sizing = _sizing_7b_on_l4(tmp_path)
    host = host_memory_bytes(64 * GIB, cgroup_root=tmp_path / "cgroup", cgroup_file=cgroup_file)
    l4 = (int(21.5 * GIB), 22_478 * 1024**2)
    with pytest.raises(MachineTooSmall, match=r"the host has 32\.0 GiB of memory"):
        check_machine(sizing, Machine(host, (l4,)), base_model=QWEN_7B)


def test_this_hosts_memory_is_at_most_the_nodes() -> None:
    """The real host: psutil's figure, or this sandbox's cgroup limit when it sets one."""
    import psutil

    total = psutil.virtual_memory().total
    machine = this_machine()
    limit = memory_limit_bytes()
    assert 0 < machine.host_memory_bytes <= total
    assert machine.host_memory_bytes == (min(total, limit) if limit is not None else total)


def test_a_worker_of_two_nodes_plans_for_both_and_takes_a_model_one_node_cannot(
    tmp_path: Path,
) -> None:
    """Qwen2.5-72B on nodes of 4 x A100-40GB: the worker of one node is refused; the head of a
    two-node task (SKYPILOT_NODE_IPS names two) plans for both and shards over all 8 GPUs."""
    config = find_model_config("Qwen/Qwen2.5-72B-Instruct", cache_dir=MODELS)
    settings = Settings(storage={"home": tmp_path}, engine={"max_lora_rank": 8})
    a100 = parse_gpu("A100").gpu
    with pytest.raises(ConfigurationError, match="does not fit 4 x A100"):
        size_worker(settings, base_model="m", config=config, gpu=a100, gpu_count=4)
    nodes = task_nodes({"SKYPILOT_NODE_IPS": "10.0.0.5\n10.0.0.6\n"})
    assert nodes == 2 and task_nodes({}) == 1
    sizing = size_worker(settings, base_model="m", config=config, gpu=a100, gpu_count=4, nodes=2)
    assert sizing.trainer_shards == 8 and sizing.plan is not None and sizing.plan.nodes == 2

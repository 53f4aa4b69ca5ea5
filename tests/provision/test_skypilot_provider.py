"""The skypilot provider on its own: launches, reconciliation, failures, preemption, teardown.

Everything is real skytrain code and real SkyPilot task parsing; only the clusters live in
``FakeSky`` (see fake_sky.py), the fake cloud at the SkyPilot SDK boundary.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any

import pytest
import sky
from sky import exceptions

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.planning import FitsNoGpu, choose_worker_gpu
from skytrain_backend.provision.base import WorkerLaunch
from skytrain_backend.provision.local import worker_log_path
from skytrain_backend.provision.skypilot import SkyPilotProvider
from tests.provision.fake_sky import ENDPOINT_HOST, FakeSky

BASE_MODEL = "Qwen/Qwen2.5-7B-Instruct"


class Clock:
    """A hand-moved clock for the provider's `sky status` rate limit."""

    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def settings(tmp_path: Path) -> Settings:
    return Settings(storage={"home": tmp_path}, skypilot={"status_interval_s": 0})


@pytest.fixture
def fake() -> FakeSky:
    return FakeSky()


@pytest.fixture
def provider(settings: Settings, fake: FakeSky) -> SkyPilotProvider:
    return SkyPilotProvider(settings, sky_api=fake)


def _launch(worker_id: str = "a" * 32, **extra: object) -> WorkerLaunch:
    values: dict[str, object] = {
        "worker_id": worker_id,
        "base_model": BASE_MODEL,
        "control_plane_url": "https://skytrain.example.com",
        "join_token": "swt-token-of-this-worker",
        "engine_secret": "engine-secret-of-this-worker",
        "envs": {"SKYTRAIN_ENGINE": "vllm"},
    }
    values.update(extra)
    return WorkerLaunch(**values)  # type: ignore[arg-type]


def _launched_task(provider: SkyPilotProvider, fake: FakeSky, **launch: Any) -> Any:
    """The SkyPilot task that one launch, settled, handed to SkyPilot."""
    provider.launch(_launch(**launch))
    fake.settle()
    return fake.launches[0].task


def _launched_and_up(provider: SkyPilotProvider, fake: FakeSky) -> str:
    """A cluster launched, settled and reported up by one poll: its name."""
    name = provider.launch(_launch())
    fake.settle()
    provider.poll()
    return name


def test_launch_returns_at_once_and_reports_launching(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    fake.launch_gate.clear()  # the cloud is slow: the launch request does not finish
    try:
        name = provider.launch(_launch())
        assert name == "skytrain-" + "a" * 32
        (info,) = provider.poll()
        assert (info.worker_id, info.cluster_name, info.state) == ("a" * 32, name, "launching")
        assert info.engine_endpoint is None
    finally:
        fake.launch_gate.set()
    fake.settle()


def test_launch_passes_one_cluster_per_worker_with_autodown(
    provider: SkyPilotProvider, fake: FakeSky, settings: Settings
) -> None:
    provider.launch(_launch("a" * 32))
    provider.launch(_launch("b" * 32))
    fake.settle()
    # Each launch runs in a thread of its own: they reach SkyPilot in either order.
    assert sorted(call.cluster_name for call in fake.launches) == [
        "skytrain-" + "a" * 32,
        "skytrain-" + "b" * 32,
    ]
    for call in fake.launches:
        assert call.down is True
        assert call.idle_minutes_to_autostop == settings.skypilot.autostop_minutes


def test_generated_task_carries_the_worker_envs_and_secrets(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    task = _launched_task(provider, fake)
    assert task.envs["SKYTRAIN_CONTROL_PLANE_URL"] == "https://skytrain.example.com"
    assert task.envs["SKYTRAIN_WORKER_BASE_MODEL"] == BASE_MODEL
    assert task.envs["SKYTRAIN_ENGINE"] == "vllm"
    secrets = {key: value.get_secret_value() for key, value in task.secrets.items()}
    assert secrets["SKYTRAIN_WORKER_TOKEN"] == "swt-token-of-this-worker"
    assert secrets["SKYTRAIN_ENGINE_SECRET"] == "engine-secret-of-this-worker"
    # Secrets never travel as envs, which `sky status` and the dashboard show.
    assert "swt-token-of-this-worker" not in task.envs.values()
    assert "engine-secret-of-this-worker" not in task.envs.values()
    for resources in task.resources:
        assert resources.ports == ["8100"]


def test_settings_override_the_task_resources(tmp_path: Path, fake: FakeSky) -> None:
    settings = Settings(
        storage={"home": tmp_path},
        skypilot={
            "accelerators": "H100:1, A100-80GB:1",
            "infra": "aws/us-east-1",
            "disk_size_gb": 512,
            "use_spot": True,
            "worker_port": 9000,
        },
        hub={"token": "hf_secret_token"},
    )
    provider = SkyPilotProvider(settings, sky_api=fake)
    task = _launched_task(provider, fake)
    assert sorted(str(r.accelerators) for r in task.resources) == [
        "{'A100-80GB': 1}",
        "{'H100': 1}",
    ]
    for resources in task.resources:
        assert str(resources.cloud) == "AWS" and resources.region == "us-east-1"
        assert resources.disk_size == 512 and resources.use_spot
        assert resources.ports == ["9000"]
    assert task.envs["WORKER_PORT"] == "9000"
    assert task.secrets["HF_TOKEN"].get_secret_value() == "hf_secret_token"


def test_a_launch_can_ask_for_other_accelerators_or_none(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    gpu_name = provider.launch(_launch("a" * 32, accelerators="L40S:2"))
    cpu_name = provider.launch(_launch("b" * 32, accelerators="none"))
    fake.settle()
    # Launches run in threads of their own: find each by its cluster, not by its place.
    tasks = {call.cluster_name: call.task for call in fake.launches}
    gpu, cpu = tasks[gpu_name], tasks[cpu_name]
    assert [r.accelerators for r in gpu.resources] == [{"L40S": 2}]
    assert [r.accelerators for r in cpu.resources] == [None]


def test_up_cluster_reports_the_front_door_endpoint_over_https(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    name = provider.launch(_launch())
    fake.settle()
    (info,) = provider.poll()
    assert (info.state, info.cluster_name) == ("up", name)
    assert info.engine_endpoint == f"https://{ENDPOINT_HOST}:8100"
    assert provider.poll() == [info]


def test_endpoint_is_reported_once_the_port_is_exposed(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    fake.ports_open = False
    provider.launch(_launch())
    fake.settle()
    (info,) = provider.poll()
    assert (info.state, info.engine_endpoint) == ("up", None)
    fake.ports_open = True
    (info,) = provider.poll()
    assert info.engine_endpoint == f"https://{ENDPOINT_HOST}:8100"


def test_a_kubernetes_ingress_endpoint_is_refused_and_the_cluster_downed(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    # SkyPilot's ingress mode serves the port as plain HTTP under a path on the ingress: the
    # front door's TLS end to end (its certificate pinned) cannot go through it.
    fake.ingress = "198.51.100.20"
    name = provider.launch(_launch())
    fake.settle()
    (info,) = provider.poll()
    assert (info.state, info.engine_endpoint) == ("failed", None)
    assert info.message is not None
    assert f"http://198.51.100.20/skypilot/default/{name}/8100" in info.message
    assert "ingress" in info.message and "loadbalancer" in info.message
    assert "podip" in info.message
    fake.settle()
    assert fake.downs == [name]
    assert provider.poll() == []


@pytest.mark.parametrize(
    "error",
    [
        exceptions.ResourcesUnavailableError(
            "Failed to acquire resources in all zones in us-east-1 for {A100:1}. "
            "Try changing resource requirements or use another region."
        ),
        exceptions.ResourcesUnavailableError(
            "Failed to provision all possible launchable resources. Relax the task's resource "
            "requirements: ... Quota exceeded for quota metric 'NVIDIA A100 GPUs'."
        ),
        exceptions.NoCloudAccessError("Cloud access is not set up. Run: \x1b[1msky check\x1b[0m"),
        exceptions.InvalidCloudCredentials("AWS credentials are not set. Run: aws configure"),
    ],
    ids=["no-capacity", "quota", "no-cloud", "credentials"],
)
def test_failed_launch_reports_skypilots_message_once(
    provider: SkyPilotProvider, fake: FakeSky, error: Exception
) -> None:
    fake.fail_next_launch = error
    name = provider.launch(_launch())
    fake.settle()
    (info,) = provider.poll()
    assert info.state == "failed"
    assert info.message is not None
    assert f"sky launch of {name} failed: {type(error).__name__}: " in info.message
    expected = str(error).replace("\x1b[1m", "").replace("\x1b[0m", "")
    assert expected in info.message
    assert "\x1b" not in info.message
    assert provider.poll() == []


def test_failed_launch_tears_down_what_it_left(provider: SkyPilotProvider, fake: FakeSky) -> None:
    fake.fail_next_launch = exceptions.ResourcesUnavailableError("setup failed half-way")
    fake.leave_cluster_on_failure = True
    name = provider.launch(_launch())
    fake.settle()
    assert fake.downs == [name]
    assert fake.clusters == {}
    assert [info.state for info in provider.poll()] == ["failed"]


def test_failure_is_written_to_the_worker_log(
    provider: SkyPilotProvider, fake: FakeSky, settings: Settings
) -> None:
    fake.fail_next_launch = exceptions.NoCloudAccessError("Cloud access is not set up.")
    provider.launch(_launch())
    fake.settle()
    log = worker_log_path(settings.storage.home / "workers", "a" * 32).read_text()
    assert "[fake sky] request" in log
    assert "NoCloudAccessError: Cloud access is not set up." in log


def test_preempted_cluster_is_reported_gone_once(provider: SkyPilotProvider, fake: FakeSky) -> None:
    name = provider.launch(_launch())
    fake.settle()
    assert [info.state for info in provider.poll()] == ["up"]
    fake.preempt(name)
    (info,) = provider.poll()
    assert (info.state, info.worker_id) == ("gone", "a" * 32)
    assert info.message is not None and "no longer exists" in info.message
    assert provider.poll() == []


def test_stopped_cluster_is_reported_gone_and_torn_down(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    name = _launched_and_up(provider, fake)
    fake.add_cluster(name, sky.ClusterStatus.STOPPED)
    (info,) = provider.poll()
    assert info.state == "gone"
    assert info.message is not None and "stopped" in info.message
    fake.settle()
    assert fake.downs == [name]
    assert provider.poll() == []


def test_terminate_downs_the_cluster_in_the_background(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    name = _launched_and_up(provider, fake)
    provider.terminate(name)
    fake.settle()
    assert fake.downs == [name]
    (info,) = provider.poll()
    assert info.state == "gone"
    assert provider.poll() == []


def test_terminating_a_gone_cluster_is_not_an_error(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    provider.terminate("skytrain-" + "f" * 32)
    fake.settle()
    assert fake.downs == ["skytrain-" + "f" * 32]
    assert provider.poll() == []


def test_unknown_clusters_with_the_prefix_are_reported(
    provider: SkyPilotProvider, fake: FakeSky
) -> None:
    fake.add_cluster("skytrain-" + "c" * 32, sky.ClusterStatus.UP)
    fake.add_cluster("skytrain-" + "d" * 32, sky.ClusterStatus.INIT, reason="running setup")
    fake.add_cluster("someone-elses-cluster", sky.ClusterStatus.UP)
    infos = {info.worker_id: info for info in provider.poll()}
    assert set(infos) == {"c" * 32, "d" * 32}
    assert infos["c" * 32].state == "up"
    assert infos["c" * 32].engine_endpoint == f"https://{ENDPOINT_HOST}:8100"
    assert (infos["d" * 32].state, infos["d" * 32].message) == ("launching", "running setup")


def test_status_is_asked_at_most_once_per_interval(tmp_path: Path, fake: FakeSky) -> None:
    clock = Clock()
    settings = Settings(storage={"home": tmp_path}, skypilot={"status_interval_s": 30})
    provider = SkyPilotProvider(settings, sky_api=fake, clock=clock)
    fake.add_cluster("skytrain-" + "c" * 32, sky.ClusterStatus.UP)
    first = provider.poll()
    assert fake.status_calls == 1
    fake.preempt("skytrain-" + "c" * 32)
    clock.now += 10
    assert provider.poll() == first  # the last answer, repeated
    assert fake.status_calls == 1
    clock.now += 25
    assert [info.state for info in provider.poll()] == ["gone"]
    assert fake.status_calls == 2


def test_a_finished_launch_is_looked_at_without_waiting_for_the_interval(
    tmp_path: Path, fake: FakeSky
) -> None:
    settings = Settings(storage={"home": tmp_path}, skypilot={"status_interval_s": 3600})
    provider = SkyPilotProvider(settings, sky_api=fake, clock=Clock())
    provider.poll()
    provider.launch(_launch())
    fake.settle()
    assert [info.state for info in provider.poll()] == ["up"]


def test_a_worker_task_skypilot_rejects_fails_at_start_up(tmp_path: Path, fake: FakeSky) -> None:
    broken = tmp_path / "worker.yaml"
    broken.write_text("resources:\n  accelerators: [L4:1]\n  disk_sise: 100\nrun: echo\n")
    settings = Settings(storage={"home": tmp_path}, skypilot={"worker_yaml": broken})
    limit = getattr(sys, "tracebacklimit", None)
    with pytest.raises(ConfigurationError, match="SkyPilot rejects the worker task") as raised:
        SkyPilotProvider(settings, sky_api=fake)
    assert "disk_sise" in raised.value.message
    # SkyPilot set the process's traceback limit to 0 on the way out of its parser; the
    # provider put it back, so the control plane's later logged tracebacks keep their frames.
    assert getattr(sys, "tracebacklimit", None) == limit


def test_accelerators_setting_must_name_some(tmp_path: Path, fake: FakeSky) -> None:
    settings = Settings(storage={"home": tmp_path}, skypilot={"accelerators": " , "})
    with pytest.raises(ConfigurationError, match="list them"):
        SkyPilotProvider(settings, sky_api=fake)


def test_sky_check_runs_at_start_up_into_the_log(
    settings: Settings, fake: FakeSky, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("INFO", logger="skytrain_backend.provision.skypilot")
    provider = SkyPilotProvider(settings, sky_api=fake)
    provider.check_report.join(30)
    assert not provider.check_report.is_alive()
    [record] = [r for r in caplog.records if "sky check" in r.getMessage()]
    assert record.levelname == "INFO"
    assert "AWS: enabled" in record.getMessage() and "Kubernetes" in record.getMessage()


def test_a_failing_sky_check_is_a_warning_naming_its_reason(
    settings: Settings, fake: FakeSky, caplog: pytest.LogCaptureFixture
) -> None:
    fake.check_error = exceptions.NoCloudAccessError("Cloud access is not set up. Run: sky check")
    provider = SkyPilotProvider(settings, sky_api=fake)
    provider.check_report.join(30)
    [record] = [r for r in caplog.records if "sky check" in r.getMessage()]
    assert record.levelname == "WARNING"
    assert "NoCloudAccessError: Cloud access is not set up" in record.getMessage()


# --- the memory plan chooses the resources -------------------------------------------------

PLANNED_MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"


def _planned(tmp_path: Path, fake: FakeSky, **skypilot: object) -> SkyPilotProvider:
    """A provider on a control plane whose model cache holds real models' config.json, with
    ``skypilot`` settings of the test's."""
    settings = Settings(
        storage={"home": tmp_path, "model_cache_dir": PLANNED_MODELS},
        skypilot={"accelerators": "H100:1, A10G:1, L4:1", **skypilot},
    )
    return SkyPilotProvider(settings, sky_api=fake)  # type: ignore[arg-type]


def test_a_worker_gets_the_cheapest_gpu_the_plan_fits_with_its_host_memory_and_disk(
    tmp_path: Path, fake: FakeSky
) -> None:
    provider = _planned(tmp_path, fake)
    task = _launched_task(provider, fake)
    # A launch that names no rank is planned at the largest a worker loads.
    settings = Settings(storage={"model_cache_dir": PLANNED_MODELS})
    choice = choose_worker_gpu(
        BASE_MODEL, ["L4:1"], settings=settings, lora_rank=settings.engine.max_lora_rank
    )
    assert choice is not None and choice.plan is not None
    plan = choice.plan
    # Exactly the chosen accelerator: the plan's numbers are made for it.
    (resources,) = task.resources
    assert resources.accelerators == {"L4": 1}
    assert resources.memory == f"{plan.host_memory_gb}+" and plan.host_memory_gb > 16
    assert resources.disk_size == plan.disk_gb
    assert task.envs["SKYTRAIN_ENGINE_MAX_MODEL_LEN"] == str(plan.max_model_len)
    assert task.envs["SKYTRAIN_ENGINE_GPU_MEMORY_UTILIZATION"] == str(plan.gpu_memory_utilization)
    assert task.envs["SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE"] == "1"
    assert task.envs["SKYTRAIN_TRAINER_GRADIENT_CHECKPOINTING"] == "true"
    assert task.envs["SKYTRAIN_TRAINER_MAX_ROW_TOKENS"] == str(plan.max_row_tokens)


def test_a_model_larger_than_one_gpu_gets_a_node_and_tensor_parallelism(
    tmp_path: Path, fake: FakeSky
) -> None:
    provider = _planned(tmp_path, fake, accelerators="L4:1, H100:8, H200:1")
    task = _launched_task(provider, fake, base_model="Qwen/Qwen2.5-72B-Instruct")
    assert [r.accelerators for r in task.resources] == [{"H100": 8}]
    assert int(task.envs["SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE"]) > 1
    # The trainer too: one process a GPU, the base sharded over them (FSDP2).
    assert task.envs["SKYTRAIN_TRAINER_DEVICE_MAP"] == "fsdp"
    assert int(task.envs["SKYTRAIN_TRAINER_SHARDS"]) > 1
    for resources in task.resources:
        assert int(resources.memory.rstrip("+")) > 145  # the weights, pinned while asleep


def test_a_model_that_fits_no_configured_gpu_is_never_launched(
    tmp_path: Path, fake: FakeSky
) -> None:
    provider = _planned(tmp_path, fake)
    with pytest.raises(FitsNoGpu, match="fits none of the GPUs workers may get") as raised:
        provider.launch(_launch(base_model="Qwen/Qwen2.5-72B-Instruct"))
    assert "H100:1: Qwen/Qwen2.5-72B-Instruct does not fit 1 x H100" in raised.value.message
    fake.settle()
    assert fake.launches == []


def test_the_operators_settings_win_over_the_plan(tmp_path: Path, fake: FakeSky) -> None:
    provider = _planned(tmp_path, fake, disk_size_gb=500)
    task = _launched_task(provider, fake, envs={"SKYTRAIN_ENGINE_MAX_MODEL_LEN": "4096"})
    assert task.envs["SKYTRAIN_ENGINE_MAX_MODEL_LEN"] == "4096"
    assert [r.disk_size for r in task.resources] == [500]


def test_without_the_models_config_every_configured_gpu_is_offered(
    tmp_path: Path, fake: FakeSky
) -> None:
    provider = _planned(tmp_path, fake, accelerators="L4:1, A10G:1")
    # No copy of this model's config.json on the control plane's machine.
    task = _launched_task(provider, fake, base_model="example-org/unpublished-model")
    assert sorted(str(r.accelerators) for r in task.resources) == ["{'A10G': 1}", "{'L4': 1}"]
    assert "SKYTRAIN_ENGINE_MAX_MODEL_LEN" not in task.envs  # the worker plans for itself


def test_a_worker_of_several_nodes_gets_num_nodes_and_splits_the_model_across_them(
    tmp_path: Path, fake: FakeSky
) -> None:
    """A base model larger than a node: SkyPilot's num_nodes, planned for the nodes (vLLM's
    tensor parallelism within each node and pipeline stages across them, the trainer's ranks
    on every GPU of every node); the cheapest accelerator whose nodes fit it."""
    provider = _planned(tmp_path, fake, accelerators="L4:4, A100:4", num_nodes=2)
    task = _launched_task(provider, fake, base_model="Qwen/Qwen2.5-72B-Instruct", lora_rank=8)
    assert task.num_nodes == 2
    assert [r.accelerators for r in task.resources] == [{"A100": 4}]
    assert task.envs["SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE"] == "4"
    assert task.envs["SKYTRAIN_ENGINE_PIPELINE_PARALLEL_SIZE"] == "2"
    assert task.envs["SKYTRAIN_TRAINER_SHARDS"] == "8"
    assert task.envs["SKYTRAIN_TRAINER_DEVICE_MAP"] == "fsdp"
    # The task's run script starts Ray across the nodes, the worker on the head only and a
    # follower (its trainer ranks) on the others.
    assert "ray start --head" in task.run and "SKYPILOT_NODE_RANK" in task.run
    assert "skytrain_backend.worker.follower" in task.run


def test_a_model_no_shape_fits_on_its_nodes_is_refused_before_any_launch(
    tmp_path: Path, fake: FakeSky
) -> None:
    provider = _planned(tmp_path, fake, accelerators="L4:1, A10G:1", num_nodes=2)
    with pytest.raises(FitsNoGpu, match="does not fit 2 nodes of 1 x L4"):
        provider.launch(_launch(base_model="Qwen/Qwen2.5-72B-Instruct", lora_rank=8))
    fake.settle()
    assert fake.launches == []


def test_a_worker_of_several_nodes_needs_one_gpu_count_to_split_by(
    tmp_path: Path, fake: FakeSky
) -> None:
    """Refused when the control plane starts, before any launch."""
    with pytest.raises(ConfigurationError, match="all with the same count a node"):
        _planned(tmp_path, fake, accelerators="H100:8, H200:4", num_nodes=2)
    assert fake.launches == []

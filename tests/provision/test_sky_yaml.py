"""sky/worker.yaml and sky/control-plane.yaml, read by SkyPilot's own parser.

A task is loaded as ``sky launch --env ... --secret ...`` loads it (schema validation and
resource parsing included), and the worker tasks the provider generates make the trip the
SkyPilot SDK makes them: serialized by the client, parsed again by the API server.
"""

from __future__ import annotations

import re
import shlex
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import sky
import yaml
from sky.utils import dag_utils
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import Settings, variables
from skytrain_backend.provision.base import WorkerLaunch
from skytrain_backend.provision.skypilot import default_worker_yaml, load_task_config, worker_task
from tests.infra.test_worker_install import VLLM

ROOT = Path(__file__).resolve().parents[2]
WORKER_YAML = ROOT / "sky" / "worker.yaml"
CONTROL_PLANE_YAML = ROOT / "sky" / "control-plane.yaml"


def _config(path: Path) -> dict[str, Any]:
    return dict(yaml.safe_load(path.read_text()))


def _usage(path: Path) -> str:
    """The `# Usage:` header, as the shell command it shows (comments and breaks removed)."""
    lines = path.read_text().splitlines()
    start = lines.index("# Usage:") + 1
    command = []
    for line in lines[start:]:
        text = line.removeprefix("#").split("  #")[0].strip()
        if not text.startswith("sky launch") and not command:
            continue
        command.append(text.removesuffix("\\").strip())
        if not line.rstrip().endswith("\\"):
            break
    return " ".join(command)


def _overrides(usage: str, flag: str) -> list[tuple[str, str]]:
    words = shlex.split(usage)
    pairs = []
    for flag_at, word in enumerate(words):
        if word == flag:
            name, _, value = words[flag_at + 1].partition("=")
            pairs.append((name, value or "from-the-environment"))
    return pairs


def _launch_as_in_usage(path: Path) -> sky.Task:
    usage = _usage(path)
    assert usage.startswith("sky launch -c skytrain") and usage.split()[4] == f"sky/{path.name}"
    return sky.Task.from_yaml_config(
        _config(path),
        env_overrides=_overrides(usage, "--env"),
        secrets_overrides=_overrides(usage, "--secret"),
    )


@pytest.mark.parametrize("path", [WORKER_YAML, CONTROL_PLANE_YAML], ids=lambda p: p.name)
def test_task_loads_with_the_usage_headers_envs(path: Path) -> None:
    task = _launch_as_in_usage(path)
    assert all(value is not None for value in task.envs.values())
    assert task.run and task.setup
    for resources in task.resources:
        assert resources.ports  # the engine / the API is reachable from outside


@pytest.mark.parametrize(
    ("path", "required"),
    [
        (WORKER_YAML, "SKYTRAIN_CONTROL_PLANE_URL"),
        (CONTROL_PLANE_YAML, "SKYTRAIN_OBJECT_STORE_URL"),
    ],
    ids=["worker", "control-plane"],
)
def test_skypilot_refuses_the_task_without_its_required_envs(path: Path, required: str) -> None:
    with pytest.raises(ValueError, match=f"Environment variable '{required}' is None"):
        sky.Task.from_yaml(str(path))


def test_skypilot_rejects_a_misspelt_field() -> None:
    """The parser the tests rely on does validate: a typo in resources is refused."""
    config = _config(WORKER_YAML)
    config["resources"]["use_spott"] = config["resources"].pop("use_spot")
    with pytest.raises(ValueError, match="use_spott"):
        sky.Task.from_yaml_config(
            config,
            env_overrides=[
                ("SKYTRAIN_CONTROL_PLANE_URL", "https://cp"),
                ("SKYTRAIN_WORKER_BASE_MODEL", "m"),
            ],
        )


def test_worker_task_resources() -> None:
    task = _launch_as_in_usage(WORKER_YAML)
    accelerators = [resources.accelerators for resources in task.resources]
    assert {"L4": 1} in accelerators and {"H100": 1} in accelerators
    for resources in task.resources:
        assert resources.ports == [task.envs["WORKER_PORT"]]
        assert resources.disk_size == 256
        assert resources.memory == "32+"  # vLLM's weights wait in host memory while training
        assert resources.use_spot is False
        # The official vLLM image, at the vLLM release the `gpu` extra pins.
        assert resources.image_id == {None: "docker:vllm/vllm-openai:v0.34.0"}
    assert task.envs["SKYTRAIN_ENGINE"] == "vllm"
    # The join token travels as a secret, never as an env.
    assert "SKYTRAIN_WORKER_TOKEN" in task.secrets
    assert "SKYTRAIN_WORKER_TOKEN" not in task.envs


def test_the_worker_image_is_the_vllm_release_the_install_is_resolved_against() -> None:
    image = _config(WORKER_YAML)["resources"]["image_id"]
    version = image.rsplit(":v", 1)[1]
    # tests/infra/test_worker_install.py resolves `skytrain[worker,gpu]` with its requirements.
    assert f"vllm=={version}" == VLLM


def test_control_plane_installs_the_checkout_it_is_launched_from() -> None:
    config = _config(CONTROL_PLANE_YAML)
    assert config["workdir"] == "."
    assert '"./[server,${CLOUD_EXTRAS}]"' in config["setup"]
    clouds = config["envs"]["CLOUD_EXTRAS"].split(",")
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"
    ]
    for cloud in clouds:
        assert f"skypilot[{cloud}]>=0.14.1" in extras[cloud]


@pytest.mark.parametrize("path", [WORKER_YAML, CONTROL_PLANE_YAML], ids=lambda p: p.name)
def test_every_skytrain_variable_is_a_setting(path: Path) -> None:
    config = _config(path)
    names = set(config.get("envs", {})) | set(config.get("secrets", {}))
    unknown = {n for n in names if n.startswith("SKYTRAIN_")} - set(variables())
    assert not unknown, f"{path.name} sets variables no setting reads: {sorted(unknown)}"


def _help(*command: str) -> str:
    """`skytrain COMMAND --help`; fails when there is no such command."""
    result = CliRunner().invoke(app, [*command, "--help"], env={"COLUMNS": "200"})
    assert result.exit_code == 0, f"skytrain has no command {' '.join(command)}: {result.output}"
    return result.output


@pytest.mark.parametrize("path", [WORKER_YAML, CONTROL_PLANE_YAML], ids=lambda p: p.name)
def test_run_uses_skytrain_commands_and_flags_that_exist(path: Path) -> None:
    run = _config(path)["run"].replace("\\\n", " ")
    commands = re.findall(r"^\s*(?:exec )?skytrain ([a-z -]+?)((?: --[a-z-]+.*)?)$", run, re.M)
    assert commands
    for words, rest in commands:
        text = _help(*words.split())
        for flag in re.findall(r"--[a-z-]+", rest):
            assert flag in text, f"`skytrain {words}` has no option {flag}"


def test_generated_worker_task_survives_the_sdk_round_trip(tmp_path: Path) -> None:
    # The base model's config is known: the task carries the memory plan's resources and envs.
    settings = Settings(
        storage={"home": tmp_path, "model_cache_dir": ROOT / "tests" / "planning" / "models"},
        skypilot={"accelerators": "A100:1,L4:1", "use_spot": True},
    )
    launch = WorkerLaunch(
        worker_id="a" * 32,
        base_model="Qwen/Qwen2.5-7B-Instruct",
        control_plane_url="https://skytrain.example.com",
        join_token="swt-worker-token",
        engine_secret="engine-secret-value",
        envs={"SKYTRAIN_ENGINE": "vllm", "SKYTRAIN_WORKER_MAX_MODELS": "8"},
    )
    task = worker_task(
        launch, settings=settings, task_config=load_task_config(default_worker_yaml())
    )
    # What the SkyPilot client sends and its API server parses back.
    wire = dag_utils.dump_dag_to_yaml_str(dag_utils.convert_entrypoint_to_dag(task))
    (parsed,) = dag_utils.load_chain_dag_from_yaml_str(wire).tasks
    assert parsed.envs == task.envs
    assert {k: v.get_secret_value() for k, v in parsed.secrets.items()} == {
        "SKYTRAIN_WORKER_TOKEN": "swt-worker-token",
        "SKYTRAIN_ENGINE_SECRET": "engine-secret-value",
        "HF_TOKEN": "",
    }
    assert sorted(map(repr, parsed.resources)) == sorted(map(repr, task.resources))
    assert all(r.use_spot and r.ports == ["8100"] for r in parsed.resources)
    ((accelerators, memory),) = [(r.accelerators, r.memory) for r in parsed.resources]
    # The host holds the parked Tinker trainers too (issue 34: a 7B needs 38-58 GiB, not 30).
    assert accelerators == {"L4": 1} and memory.endswith("+") and int(memory[:-1]) >= 38
    assert (
        parsed.envs["SKYTRAIN_ENGINE_MAX_MODEL_LEN"] == task.envs["SKYTRAIN_ENGINE_MAX_MODEL_LEN"]
    )
    assert parsed.envs["WORKER_PORT"] == "8100"
    assert parsed.run == task.run and parsed.setup == task.setup


def test_the_wheel_ships_the_task_the_provider_defaults_to() -> None:
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"sky" = "skytrain_backend/_sky"' in pyproject
    assert default_worker_yaml().read_text() == WORKER_YAML.read_text()


SHELLCHECK = str(Path(sys.executable).parent / "shellcheck")


@pytest.mark.parametrize("path", [WORKER_YAML, CONTROL_PLANE_YAML], ids=lambda p: p.name)
@pytest.mark.parametrize("part", ["setup", "run"])
def test_scripts_pass_shellcheck(path: Path, part: str) -> None:
    script = "#!/usr/bin/env bash\n" + _config(path)[part]
    result = subprocess.run(
        [SHELLCHECK, "--shell=bash", "-"], input=script, capture_output=True, text=True
    )
    assert result.returncode == 0, result.stdout


def test_shellcheck_catches_a_broken_script() -> None:
    result = subprocess.run(
        [SHELLCHECK, "--shell=bash", "-"],
        input='#!/usr/bin/env bash\nif [ -z $X ]; then echo "unclosed\n',
        capture_output=True,
        text=True,
    )
    assert result.returncode != 0


@pytest.mark.parametrize("path", [WORKER_YAML, CONTROL_PLANE_YAML], ids=lambda p: p.name)
def test_scripts_read_only_variables_the_task_sets(path: Path) -> None:
    """The scripts run under `set -u`: a variable the task does not set would stop them."""
    config = _config(path)
    declared = set(config.get("envs", {})) | set(config.get("secrets", {}))
    for part in ("setup", "run"):
        references = re.findall(r"\$\{([A-Z_][A-Z0-9_]*)([^}]*)\}", config[part])
        used = {name for name, rest in references if not rest.startswith((":-", ":="))}
        used -= {"HOME", "PATH"}  # every login shell has them
        assert used <= declared, f"{path.name} {part} reads unset {sorted(used - declared)}"

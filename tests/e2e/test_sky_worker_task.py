"""sky/worker.yaml's setup and run, as SkyPilot runs them on a cluster, against a real control
plane: the worker installs the control plane's own skytrain (no index has it), joins, is
reached at the address it reported, and serves a model. With the CPU engine.

The cluster is this machine: a fresh home directory, and in it the Python environment
SkyPilot activates for user commands (``~/sky-user-env``), which stands in for the vLLM
image's Python and holds nothing but that image's torch. The task is the one the provider
builds (``worker_task``: SkyPilot's own parsing of the YAML, envs and secrets), and each
script is wrapped and run by SkyPilot's own ``make_task_bash_script``, as its backend does.
"""

from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import zipfile
from pathlib import Path
from typing import Any

import pytest
from sky.skylet import log_lib

from skytrain_backend import __version__
from skytrain_backend.config import Settings
from skytrain_backend.provision.base import WorkerLaunch
from skytrain_backend.provision.skypilot import default_worker_yaml, load_task_config, worker_task
from tests.e2e import support
from tests.fixtures.service import start_service, stop_service

# Installs a fresh environment as a cluster does (about 7 minutes on 2 cores).
pytestmark = [pytest.mark.e2e, pytest.mark.slow]

# What the vLLM image brings that matters here: its torch (the CPU build on this machine).
IMAGE_TORCH = "torch==2.13.0"
INSTALL_TIMEOUT_S = 1800


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _cluster_env(home: Path) -> dict[str, str]:
    """A login environment on the 'cluster': its own home, the system's PATH, and this
    machine's pip configuration (where its local package mirror is). pip does not byte-compile
    what it installs (most of its CPU time here; Python compiles what it imports anyway)."""
    env = {
        "HOME": str(home),
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "LANG": "C.UTF-8",
        # pip reads the variable of a --no-* option the other way round: "0" is --no-compile.
        "PIP_NO_COMPILE": "0",
    }
    env.update({k: v for k, v in os.environ.items() if k.startswith("PIP_")})
    return env


def _script(path: Path, code: str, env_vars: dict[str, str]) -> Path:
    path.write_text(log_lib.make_task_bash_script(code, env_vars=env_vars))
    return path


def _task_env(task: Any) -> dict[str, str]:
    secret_values = {
        name: value.get_secret_value() if hasattr(value, "get_secret_value") else str(value)
        for name, value in task.secrets.items()
    }
    return {
        **{name: str(value) for name, value in task.envs.items()},
        **secret_values,
        "SKYPILOT_NODE_RANK": "0",
        "SKYPILOT_NUM_NODES": "1",
        "SKYPILOT_NODE_IPS": "127.0.0.1",
    }


def _wheel_files(path: Path) -> dict[str, bytes]:
    with zipfile.ZipFile(path) as wheel:
        return {name: wheel.read(name) for name in wheel.namelist() if not name.endswith("/RECORD")}


def test_the_worker_task_installs_the_control_planes_wheel_joins_and_serves(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    service = start_service({"SKYTRAIN_PROVIDER": "none"}, tmp_path / "control-plane")
    worker: subprocess.Popen[bytes] | None = None
    try:
        join_token = service.cli("workers", "token", "create").strip().splitlines()[-1]
        port = _free_port()
        launch = WorkerLaunch(
            worker_id="0" * 32,
            base_model=str(tiny_model_path),
            control_plane_url=service.url,
            join_token=join_token,
            engine_secret=secrets.token_urlsafe(24),
            # What a control plane running the CPU engine passes its workers; a CPU
            # "cluster" without vLLM needs no `gpu` extra (vLLM's ranges).
            envs={
                "SKYTRAIN_ENGINE": "hf",
                "SKYTRAIN_ENGINE_STARTUP_TIMEOUT_S": "600",
                "WORKER_EXTRAS": "worker",
            },
        )
        settings = Settings(storage={"home": tmp_path}, skypilot={"worker_port": port})
        task = worker_task(
            launch, settings=settings, task_config=load_task_config(default_worker_yaml())
        )
        env_vars = _task_env(task)
        assert env_vars["WORKER_PORT"] == str(port)

        home = tmp_path / "cluster"
        (home / "sky_workdir").mkdir(parents=True)
        user_env = home / "sky-user-env"
        subprocess.run([sys.executable, "-m", "venv", str(user_env)], check=True)
        subprocess.run(
            [str(user_env / "bin" / "python"), "-m", "pip", "install", "-q", IMAGE_TORCH],
            check=True,
            env={**_cluster_env(home), "PATH": f"{user_env / 'bin'}:/usr/bin:/bin"},
            timeout=INSTALL_TIMEOUT_S,
        )
        # No package index has skytrain: only the control plane can give it.
        pip = [str(user_env / "bin" / "python"), "-m", "pip"]
        missing = subprocess.run(
            [
                *pip,
                "download",
                "--no-deps",
                "-q",
                "-d",
                str(tmp_path / "dl"),
                f"skytrain=={__version__}",
            ],
            env=_cluster_env(home),
            capture_output=True,
            text=True,
            timeout=300,
        )
        assert missing.returncode != 0

        setup = subprocess.run(
            ["/bin/bash", "-i", str(_script(tmp_path / "setup.sh", task.setup, env_vars))],
            env=_cluster_env(home),
            cwd=home,
            capture_output=True,
            text=True,
            timeout=INSTALL_TIMEOUT_S,
        )
        assert setup.returncode == 0, setup.stdout[-4000:] + setup.stderr[-4000:]
        installed = subprocess.run(
            [
                str(user_env / "bin" / "python"),
                "-c",
                "import skytrain_backend, torch; "
                "print(skytrain_backend.__version__, skytrain_backend.__file__, torch.__version__)",
            ],
            env=_cluster_env(home),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.split()
        assert installed[0] == __version__
        assert installed[1].startswith(str(user_env))  # from the wheel, not this checkout
        assert installed[2].startswith("2.13.0")  # the image's torch was kept

        # A control plane installed from that wheel serves the same wheel again, packed from
        # its installed files.
        (served,) = (home / "skytrain-dist").glob("skytrain-*.whl")
        repacked = subprocess.run(
            [
                str(user_env / "bin" / "python"),
                "-c",
                "import sys; from importlib import metadata; from pathlib import Path; "
                "from skytrain_backend.provision.package import repack_wheel; "
                "print(repack_wheel(metadata.distribution('skytrain'), Path(sys.argv[1])))",
                str(tmp_path),
            ],
            env=_cluster_env(home),
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        assert Path(repacked).name == served.name
        assert _wheel_files(Path(repacked)) == _wheel_files(served)

        with open(tmp_path / "worker.log", "wb") as log:
            worker = subprocess.Popen(
                ["/bin/bash", str(_script(tmp_path / "run.sh", task.run, env_vars))],
                env=_cluster_env(home),
                cwd=home,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        with service.http("alice") as http:
            model = http.post(
                "/v1/models",
                json={"project": "sky", "name": "task", "base_model": str(tiny_model_path)},
            ).json()
            serving = support.wait_until_served(http, model["id"], timeout_s=900)
        listed = service.cli("workers", "list")
        # Reached at the address it reported: where its registration came from, on its port.
        assert f"https://127.0.0.1:{port}" in listed, listed
        assert serving["worker_id"] in listed and "ready" in listed
        client = support.openai_client(service.url, service.key("alice"))
        choices, headers = support.sample(client, model["inference_name"], "Hi.", n=1)
        assert headers["x-skytrain-worker"] == serving["worker_id"]
        assert choices[0].logprobs is not None
    finally:
        if worker is not None and worker.poll() is None:
            os.killpg(worker.pid, signal.SIGTERM)
            worker.wait(timeout=60)
        stop_service(service)

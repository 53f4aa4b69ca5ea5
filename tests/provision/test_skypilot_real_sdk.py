"""The real SkyPilot SDK on a machine with no cloud credentials: no hang, SkyPilot's own error.

`skytrain serve` runs with the ``skypilot`` provider in a fresh HOME (no cloud credentials, no
SkyPilot state), with its own SkyPilot API server on a free port (started by the SDK, as it
would be on an operator's control plane) and SkyPilot's usage reporting off. A model is
registered over HTTP; the scheduler launches a worker through the real SDK, SkyPilot refuses
it, and ``GET /v1/models/{id}`` shows SkyPilot's message as the model's serving status.

Workers are CPU-only here (``SKYTRAIN_SKYPILOT_ACCELERATORS=none``): naming a GPU makes
SkyPilot fetch its accelerator catalog from the internet first, which this machine cannot
reach; with a network and no credentials the answer is the same "no cloud" error.
"""

from __future__ import annotations

import os
import random
import socket
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from sky.server.requests.queues import mp_queue

from tests.fixtures.ports import free_port

pytestmark = pytest.mark.e2e

BIN = Path(sys.executable).parent
# A bound on the wait, so a regression fails instead of hanging the suite; the launch fails
# in well under a minute on a 2-core machine.
DEADLINE_S = 300
# Only what a fresh login shell has: no cloud credentials or SkyPilot settings leak in.
KEPT_ENV = ("PATH", "LANG", "LC_ALL", "TMPDIR", "TZ")


def _is_free(port: int) -> bool:
    with socket.socket() as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def _sky_api_port() -> int:
    """A port for the SkyPilot API server whose request-queue port is free too.

    SkyPilot's server also listens on a port derived from its own (its request queue); if
    that one is taken the server exits at start. Its own port is picked below Linux's
    ephemeral range (32768 and up), where no outgoing connection of the suite can take it
    meanwhile.
    """
    for port in random.sample(range(20000, 32000), 200):
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("SKYPILOT_API_SERVER_LOCAL_PORT", str(port))
            queue_port = mp_queue.get_queue_manager_port()
        if _is_free(port) and _is_free(queue_port):
            return port
    raise AssertionError("no free port pair for the SkyPilot API server")


def _sky_server_log(env: dict[str, str]) -> str:
    path = Path(env["HOME"]) / ".sky" / "api_server" / "server.log"
    return path.read_text() if path.exists() else f"(no {path})"


@pytest.fixture
def env(tmp_path: Path) -> Iterator[dict[str, str]]:
    home = tmp_path / "home"
    home.mkdir()
    values = {key: os.environ[key] for key in KEPT_ENV if key in os.environ}
    values.update(
        HOME=str(home),
        SKYPILOT_API_SERVER_LOCAL_PORT=str(_sky_api_port()),
        SKYPILOT_DISABLE_USAGE_COLLECTION="1",
        SKYTRAIN_HOME=str(home / ".skytrain"),
        SKYTRAIN_PROVIDER="skypilot",
        SKYTRAIN_SKYPILOT_ACCELERATORS="none",
        SKYTRAIN_PUBLIC_URL="http://127.0.0.1:9",
    )
    yield values
    # The SDK started a SkyPilot API server for this HOME and port: stop exactly that one.
    stopped = subprocess.run(
        [str(BIN / "sky"), "api", "stop"],
        env=values,
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert stopped.returncode == 0, stopped.stdout + stopped.stderr


def _skytrain(env: dict[str, str], *args: str) -> str:
    result = subprocess.run(
        [str(BIN / "skytrain"), *args], env=env, capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    return result.stdout.strip()


@pytest.mark.slow
def test_no_cloud_access_fails_the_model_and_logs_skypilots_error_for_the_operator(
    env: dict[str, str],
) -> None:
    key = _skytrain(env, "keys", "create", "--tenant", "acme")
    port = free_port()
    log = open(Path(env["HOME"]) / "serve.log", "w+")  # noqa: SIM115 - read after the process
    server = subprocess.Popen(
        [str(BIN / "skytrain"), "serve", "--port", str(port)],
        env=env,
        stdout=log,
        stderr=subprocess.STDOUT,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.Client(
            base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=30
        ) as http:
            deadline = time.monotonic() + DEADLINE_S
            while True:
                assert server.poll() is None, "skytrain serve exited"
                try:
                    if http.get("/health").status_code == 200:
                        break
                except httpx.TransportError:
                    pass
                assert time.monotonic() < deadline, "skytrain serve did not answer"
                time.sleep(0.5)
            created = http.post(
                "/v1/models",
                json={"project": "p", "name": "agent", "base_model": "Qwen/Qwen2.5-0.5B"},
            )
            assert created.status_code == 201, created.text
            model_id = created.json()["id"]
            seen = []
            while True:
                serving = http.get(f"/v1/models/{model_id}").json()["serving"]
                seen.append(serving["state"])
                if serving["state"] == "failed":
                    break
                assert time.monotonic() < deadline, f"still {serving} after {DEADLINE_S}s"
                time.sleep(1)
    finally:
        server.terminate()
        server.wait(timeout=60)
        log.seek(0)
        printed = log.read()
        log.close()
    message = serving["message"]
    # The tenant is told which base model failed; SkyPilot's reason goes to the operator.
    assert "the last worker for base model 'Qwen/Qwen2.5-0.5B' failed to start" in message
    assert "NoCloudAccessError: Cloud access is not set up. Run: sky check" in printed, (
        f"{printed}\n--- SkyPilot API server log ---\n{_sky_server_log(env)}"
    )
    assert set(seen) <= {"waiting", "provisioning", "starting", "failed"}

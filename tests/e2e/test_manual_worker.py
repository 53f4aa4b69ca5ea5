"""A worker started by hand (as `sky launch sky/worker.yaml` does) joins with a join token."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from skytrain_backend.child_processes import ChildProcess
from tests.e2e import support
from tests.fixtures.service import start_service, stop_service

pytestmark = [pytest.mark.e2e]


def _cli(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "skytrain_backend", *args],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )


@pytest.mark.slow
def test_a_hand_started_worker_joins_with_a_join_token(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    service = start_service({"SKYTRAIN_PROVIDER": "none"}, tmp_path / "home")
    worker: ChildProcess | None = None
    try:
        created = _cli(
            service.env, "workers", "token", "create", "--base-model", str(tiny_model_path)
        )
        assert created.returncode == 0, created.stderr
        join_token = created.stdout.strip().splitlines()[-1]
        assert join_token.startswith("swj-")

        with service.http("alice") as http:
            response = http.post(
                "/v1/models",
                json={"project": "e2e", "name": "by-hand", "base_model": str(tiny_model_path)},
            )
            model = response.json()
            assert model["serving"]["state"] == "waiting"  # no provider: nothing starts on its own

            worker = support.start_hand_worker(
                service.env,
                tmp_path / "worker-home",
                control_plane_url=service.url,
                join_token=join_token,
                base_model=tiny_model_path,
            )
            serving = support.wait_until_served(http, model["id"])
            client = support.openai_client(service.url, service.key("alice"))
            choices, headers = support.sample(client, model["inference_name"], "Hi.", n=1)
            assert headers["x-skytrain-worker"] == serving["worker_id"]
            assert choices[0].logprobs is not None

        listed = _cli(service.env, "workers", "list")
        assert serving["worker_id"] in listed.stdout and "manual" in listed.stdout

        # A revoked join token lets no new worker in; the one that joined keeps its own token.
        prefix = join_token[: len("swj-") + 6]  # the display prefix `workers token list` shows
        revoked = _cli(service.env, "workers", "token", "revoke", prefix)
        assert revoked.returncode == 0, revoked.stdout + revoked.stderr
        refused = _cli(
            {
                **service.env,
                "SKYTRAIN_HOME": str(tmp_path / "second-worker"),
                "SKYTRAIN_CONTROL_PLANE_URL": service.url,
                "SKYTRAIN_WORKER_TOKEN": join_token,
                "SKYTRAIN_WORKER_BASE_MODEL": str(tiny_model_path),
            },
            "worker",
        )
        assert refused.returncode != 0
        assert "revoked" in refused.stdout + refused.stderr
        # Refused before it started its engine (minutes for a large model on a GPU).
        assert "starting the" not in refused.stdout + refused.stderr
        assert not (tmp_path / "second-worker" / "worker" / "engine.log").exists()
        assert worker.poll() is None
    finally:
        if worker is not None:
            worker.stop(grace_s=60)
        stop_service(service)

"""PostgreSQL restarting while a training job runs on a local worker loses nothing: requests
meanwhile are answered 503 with a reference to the control plane's log (not a 500, not the
driver's words), the worker's calls are retried through the outage, and once the database is
back the job finishes once, its checkpoint committed and served.

The database is a PostgreSQL server of the test's own (``private_postgres``), never the
machine's; ``skytrain serve`` and its worker are real processes, the model the tiny one.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import psycopg
import pytest

from tests.e2e import support
from tests.e2e.conftest import show_logs
from tests.e2e.test_rl_loop import LEARNING_RATE, _register, _wait_for_event
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.service import start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.slow]

# Long enough that the worker's calls (heartbeats, job events, its commit) meet the outage.
OUTAGE_S = 8


def _rows(server: PostgresServer, query: str, *args: object) -> list[tuple[object, ...]]:
    with psycopg.connect(
        host="127.0.0.1", port=server.port, user="postgres", dbname="postgres"
    ) as connection:
        return list(connection.execute(query, args).fetchall())


def test_a_database_restart_mid_job_is_a_503_meanwhile_and_the_job_and_its_checkpoint_survive(
    private_postgres: PostgresServer,
    tiny_model_path: Path,
    tmp_path: Path,
) -> None:
    env = {
        "SKYTRAIN_DATABASE_URL": private_postgres.url,
        # The outage is shorter than a lease and a worker's silence: nothing may be handed
        # out again because of it.
        "SKYTRAIN_JOB_LEASE_S": "60",
        "SKYTRAIN_WORKER_HEARTBEAT_TIMEOUT_S": "60",
    }
    subprocess.run(
        [sys.executable, "-m", "skytrain_backend", "db", "upgrade"],
        env={**os.environ, **env},
        check=True,
        capture_output=True,
    )
    service = start_service(env, tmp_path / "home")
    try:
        model = _register(service, "alice", "restarted", tiny_model_path)
        with service.http("alice") as http:
            worker_id = support.wait_until_served(http, model["id"])["worker_id"]
            client = support.openai_client(service.url, service.key("alice"))
            groups = support.sample_groups(client, model["inference_name"], groups=4, n=4)
            config = {"learning_rate": LEARNING_RATE, "num_gradient_steps": 4}
            queued = http.post(
                "/v1/training-jobs",
                json={"model_id": model["id"], "trajectory_groups": groups, "config": config},
            )
            assert queued.status_code == 201, queued.text
            job_id = queued.json()["id"]
            _wait_for_event(http, job_id, "training_started")

            private_postgres.stop()
            outage_ends = time.monotonic() + OUTAGE_S
            for path in ("/v1/models", f"/v1/training-jobs/{job_id}", "/v1/training-jobs"):
                during = http.get(path)
                assert during.status_code == 503, during.text
                error = during.json()["error"]
                assert error["type"] == "database_unavailable"
                assert error["message"].startswith("the database cannot be reached (reference ")
                assert int(during.headers["retry-after"]) >= 1
                assert str(private_postgres.port) not in during.text
            time.sleep(max(0.0, outage_ends - time.monotonic()))
            private_postgres.start_again()
            # The worker's own calls met the outage too (each 503 is logged with its
            # reference), and were retried: more than the three above.
            assert service.log().count("DatabaseUnavailable [") > 3, service.log()[-3000:]

            events = support.events_until_end(http, job_id, timeout_s=600)
            assert events[-1]["type"] == "training_ended", events[-3:]
            job = http.get(f"/v1/training-jobs/{job_id}").json()
            assert (job["status"], job["attempts"], job["step"]) == ("succeeded", 1, 1), job
            steps = http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
            assert [checkpoint["step"] for checkpoint in steps] == [0, 1]
            files = http.get(f"/v1/models/{model['id']}/checkpoints/1/files").json()["data"]
            assert {"adapter_config.json", "adapter_model.safetensors"} <= {
                item["name"] for item in files
            }
            assert support.wait_until_served(http, model["id"], step=1)["worker_id"] == worker_id
        # Leased once, by the worker that started it, which was never given up for lost.
        assert _rows(private_postgres, "select status, attempts, worker_id from training_jobs") == [
            ("succeeded", 1, worker_id)
        ]
        ((status,),) = _rows(private_postgres, "select status from workers")
        assert status in ("ready", "training"), status
    except BaseException:
        show_logs(service)  # the test is still running: no report to read yet
        raise
    finally:
        stop_service(service)

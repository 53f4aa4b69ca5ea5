"""What an operator sees of a real deployment (`skytrain serve` + a local worker with the tiny
model, JSON logs, the metrics listener) after one chat request, one streamed and one training
job: the skytrain_* series, the request's id in the gateway's and the worker's log lines, every
line of every log one JSON object, the model in `skytrain models list`, and no key, token or
secret in any log; and a worker that fails to start logs JSON, its error with its traceback."""

from __future__ import annotations

import json
import re
import socket
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import sqlalchemy

from tests.e2e import support
from tests.fixtures.prometheus import board_expressions, prometheus_scraping
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.fixture(scope="module")
def service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    overrides = {
        "SKYTRAIN_METRICS_PORT": str(_free_port()),
        "SKYTRAIN_LOG_FORMAT": "json",
        "SKYTRAIN_MAX_WORKERS": "1",
    }
    running = start_service(overrides, tmp_path_factory.mktemp("observability") / "home")
    yield running
    stop_service(running)


def _json_lines(text: str) -> list[dict[str, Any]]:
    lines = []
    for line in text.splitlines():
        if line.startswith("{"):
            try:
                lines.append(json.loads(line))
            except ValueError:
                continue
    return lines


def _series(text: str, name: str) -> dict[str, float]:
    """Every sample of ``name`` (its labels as written -> value)."""
    found = {}
    for line in text.splitlines():
        if line.startswith(name + "{") or line.startswith(name + " "):
            labels, _, number = line.rpartition(" ")
            found[labels.removeprefix(name)] = float(number)
    return found


# Board panels whose series exist only after what this workload does not do: a refusal, a
# refused connection or a limit hit (counted in tests/observability/test_metrics.py and
# tests/lifecycle/test_slow_clients.py), vLLM's KV cache, CUDA memory.
_NOT_IN_THIS_WORKLOAD = {
    "Refusals per second by reason",
    "Connections refused per second by reason (caps, header and body timeouts)",
    "Tenant limits hit per second",
    "KV cache use",
    "GPU memory used",
}


def test_metrics_logs_and_models_after_a_chat_and_a_training_job(
    service: Service, tiny_model_path: Path, tmp_path: Path
) -> None:
    metrics_url = f"http://127.0.0.1:{service.env['SKYTRAIN_METRICS_PORT']}/metrics"
    key = service.key("alice")
    with service.http("alice") as http:
        created = http.post(
            "/v1/models",
            json={"project": "obs", "name": "agent", "base_model": str(tiny_model_path)},
        )
        assert created.status_code == 201, created.text
        model = created.json()
        support.wait_until_served(http, model["id"])
        assert http.get("/v1/models/no-such-model").status_code == 404  # an error to count
        chat = http.post(
            "/v1/chat/completions",
            headers={"X-Request-Id": "operator-trace-1"},
            json={
                "model": model["inference_name"],
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4,
            },
        )
        assert chat.status_code == 200, chat.text
        assert chat.headers["x-request-id"] == "operator-trace-1"
        with http.stream(
            "POST",
            "/v1/chat/completions",
            json={
                "model": model["inference_name"],
                "messages": [{"role": "user", "content": "Say hi"}],
                "max_tokens": 4,
                "stream": True,
            },
        ) as streamed:
            assert streamed.status_code == 200
            assert "data: [DONE]" in streamed.read().decode()
        client = support.openai_client(service.url, key)
        groups = support.sample_groups(client, model["inference_name"], groups=2, n=2, max_tokens=6)
        http.headers["X-Request-Id"] = "operator-job-1"  # the call that creates the job
        job, events = support.train(http, model["id"], groups, learning_rate=1e-3)
        del http.headers["X-Request-Id"]
        assert events[-1]["type"] == "training_ended", events[-1]
        # Sampled from step 0, trained from step 0: each choice said so through the client.
        assert events[-1]["data"]["off_policy_steps/max"] == 0.0
        # A heartbeat after the job reports the worker's stats.
        support.wait_until_served(http, model["id"], step=1)

    # The public port never serves the metrics.
    assert httpx.get(f"{service.url}/metrics").status_code == 404
    text = httpx.get(metrics_url, timeout=30).text
    requests = _series(text, "skytrain_http_requests_total")
    assert any('route="/v1/chat/completions"' in k and 'status="200"' in k for k in requests)
    assert _series(text, "skytrain_gateway_upstream_duration_seconds_count")
    assert sum(_series(text, "skytrain_gateway_tokens_total").values()) > 0
    assert _series(text, "skytrain_training_jobs_ended_total")['{status="succeeded"}'] == 1
    off_policy = _series(text, "skytrain_training_off_policy_steps_count")
    assert off_policy == {'{stat="max"}': 1, '{stat="mean"}': 1}, off_policy
    phases = _series(text, "skytrain_training_phase_duration_seconds_count")
    assert {'{phase="download"}', '{phase="steps"}', '{phase="commit"}'} <= set(phases)
    assert _series(text, "skytrain_training_queue_wait_duration_seconds_count")[""] == 1
    workers = _series(text, "skytrain_workers")
    # The one local worker, in whatever live status its last heartbeat gave (ready, or still
    # training for a moment after the job).
    live = {k: v for k, v in workers.items() if 'status="ready"' in k or 'status="training"' in k}
    assert sum(live.values()) == 1 and all('provider="local"' in k for k in live), workers
    assert _series(text, "skytrain_worker_engine_running_requests")
    assert model["id"] not in text  # never a label
    assert str(tiny_model_path) not in text  # a base model is a tenant's string: never a label

    # Every query of the Grafana board returns data from the real Prometheus scraping this
    # listener after the workload above.
    port = service.env["SKYTRAIN_METRICS_PORT"]
    with prometheus_scraping(f"127.0.0.1:{port}", tmp_path) as prometheus:
        prometheus.wait_for("count_over_time(skytrain_metrics_database_up[5m]) >= 3")
        for title, expr in board_expressions():
            answer = prometheus.query(expr)
            assert answer["status"] == "success", (title, expr, answer)
            if title not in _NOT_IN_THIS_WORKLOAD:
                assert answer["data"]["result"], (title, expr)

    listed = service.cli("models", "list")
    assert model["id"] in listed and "obs/agent" in listed and "alice" in listed
    assert service.cli("models", "list", "--tenant", "nobody").count(model["id"]) == 0
    status = service.cli("status")
    assert "workers" in status and "queue: 0" in status

    # The gateway's line and the worker's front-door line of the chat share its id.
    gateway = [
        line
        for line in _json_lines(service.log())
        if line["request_id"] == "operator-trace-1" and line["logger"].endswith("gateway")
    ]
    assert gateway and gateway[0]["tenant_id"] and gateway[0]["model_id"] == model["id"]
    worker = [
        line
        for line in _json_lines(service.worker_logs())
        if line.get("request_id") == "operator-trace-1"
    ]
    assert worker, service.worker_logs()[-3000:]
    # The engine's line for it carries the id, made unique for the engine.
    assert any(
        str(line.get("request_id")).startswith("operator-trace-1-")
        for line in _json_lines(_all_worker_output(service))
    )
    # The worker's lines while it ran the job carry the job, the worker and the request id of
    # the call that created the job, as that call's access line on the control plane does.
    job_lines = [line for line in _json_lines(service.worker_logs()) if line["job_id"] == job["id"]]
    assert job_lines and all(line["worker_id"] for line in job_lines)
    assert {line["request_id"] for line in job_lines} == {"operator-job-1"}
    (created,) = [
        line
        for line in _json_lines(service.log())
        if line["request_id"] == "operator-job-1" and "POST /v1/training-jobs" in line["message"]
    ]
    assert created["job_id"] == job["id"]
    # The worker's calls for the job name it on the control plane too, and those made while it
    # ran the job (its input, its end) go with the same request id.
    calls = [
        line
        for line in _json_lines(service.log())
        if f"/v1/worker/jobs/{job['id']}/" in line["message"]
    ]
    assert calls and all(line["job_id"] == job["id"] for line in calls), calls
    ran = [line for line in calls if line["message"].split()[1].endswith(("/input", "/complete"))]
    assert len(ran) >= 2 and {line["request_id"] for line in ran} == {"operator-job-1"}, ran
    for line in _json_lines(service.log()):
        assert set(line) >= {"time", "level", "logger", "message", "request_id", "tenant_id"}
    # Every line of every log is one JSON object: the server's, the worker's (each after it
    # registered with its id) and its engine's, progress and library warnings included.
    for path in [service.log_path, *sorted(service.home.rglob("*.log"))]:
        lines = [line for line in path.read_text().splitlines() if line.strip()]
        assert lines, path
        for line in lines:
            assert isinstance(json.loads(line), dict), f"{path.name}: {line}"
    # Every line of the launched worker and of its engine names the worker, from the first
    # (issue 36: the lines before it registered, and the engine's, had none).
    (worker_log,) = sorted((service.home / "workers").glob("*.log"))
    (worker_id,) = {line["worker_id"] for line in _json_lines(worker_log.read_text())}
    assert worker_id == worker_log.stem and worker_id in service.cli("workers", "list")
    engine_lines = [
        line
        for path in sorted(service.home.rglob("engine*.log"))
        for line in _json_lines(path.read_text())
    ]
    assert engine_lines and {line["worker_id"] for line in engine_lines} == {worker_id}

    # No key, token or secret in any log line: the caller's key, any key or worker token
    # (by their shapes), the worker's engine secret.
    everything = service.log() + "\n" + _all_worker_output(service)
    assert key not in everything
    assert not re.findall(r"(?:sk-st-|sw[jt]-)[A-Za-z0-9_\-]{20,}", everything)
    engine = sqlalchemy.create_engine(f"sqlite:///{service.home / 'skytrain.db'}")
    with engine.connect() as connection:
        engine_secrets = connection.execute(
            sqlalchemy.text("SELECT engine_secret FROM workers")
        ).scalars()
        for secret in engine_secrets:
            assert secret not in everything
    engine.dispose()


def test_a_worker_that_fails_to_start_logs_json_and_its_error(
    service: Service, tiny_model_path: Path, tmp_path: Path
) -> None:
    """Issue 36: in JSON mode a worker that failed to start printed a boxed traceback (41 of 43
    lines) and no error line. Here its home is a file, so its work directory cannot be made."""
    token = service.cli("workers", "token", "create", "--name", "broken").strip().splitlines()[-1]
    home = tmp_path / "home"
    home.write_text("not a directory")
    env = {**service.env, "SKYTRAIN_HOME": str(home), "SKYTRAIN_LOG_FORMAT": "json"}
    env.pop("SKYTRAIN_DATABASE_URL", None)
    result = subprocess.run(
        [sys.executable, "-m", "skytrain_backend", "worker", "--control-plane", service.url,
         "--token", token, "--base-model", str(tiny_model_path), "--port", "0"],
        env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 1
    lines = [json.loads(line) for line in (result.stdout + result.stderr).splitlines() if line]
    errors = [line for line in lines if line["level"] == "error"]
    assert len(errors) == 1, lines
    assert errors[0]["message"].startswith("the worker stopped: ")
    assert "Traceback" in errors[0]["exception"] and "Error" in errors[0]["exception"]


def _all_worker_output(service: Service) -> str:
    return "\n".join(
        path.read_text(errors="replace") for path in sorted(service.home.rglob("*.log"))
    )

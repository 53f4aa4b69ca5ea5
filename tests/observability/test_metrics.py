"""The metrics listener: skytrain_* series of the real control plane on a port of its own,
never on the public port, with bounded labels."""

from __future__ import annotations

import concurrent.futures
import subprocess
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx
from prometheus_client import REGISTRY

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.observability import metrics
from skytrain_backend.observability.listener import MetricsListener, registry_for
from tests.fixtures.callers import Caller
from tests.fixtures.services import ApiKey, ControlPlane
from tests.observability.conftest import scrape, value

MODEL_ROUTE = (
    '{method="GET",route="/v1/models/{model_id}",route_class="request",status="404",'
    'tenant_class="tenant"}'
)


def test_public_port_does_not_serve_metrics(
    control_plane: ControlPlane, listener: MetricsListener
) -> None:
    assert httpx.get(f"{control_plane.url}/metrics").status_code == 404
    assert "skytrain_http_requests_total" in scrape(listener)


def test_requests_are_counted_by_route_template_never_by_id(
    control_plane: ControlPlane, listener: MetricsListener, api_key: Callable[..., ApiKey]
) -> None:
    key = api_key()
    before = value(scrape(listener), f"skytrain_http_requests_total{MODEL_ROUTE}")
    missing = f"model-{uuid.uuid4().hex}"
    response = httpx.get(f"{control_plane.url}/v1/models/{missing}", headers=key.headers)
    assert response.status_code == 404
    httpx.get(f"{control_plane.url}/no/such/{missing}")
    text = scrape(listener)
    assert value(text, f"skytrain_http_requests_total{MODEL_ROUTE}") == before + 1
    assert 'route="unmatched"' in text
    assert "skytrain_http_request_duration_seconds_bucket" in text
    # No path, model id or tenant id ever becomes a label.
    assert missing not in text and key.tenant_id not in text
    # Prometheus' conventions: no _created series; counters end _total, histograms of time
    # _duration_seconds.
    assert "_created" not in text
    for line in text.splitlines():
        if line.startswith("# TYPE skytrain_"):
            _, _, name, kind = line.split()
            assert (kind == "counter") == name.endswith("_total"), line
            if kind == "histogram" and name.endswith("_seconds"):
                assert name.endswith("_duration_seconds"), line


def test_request_id_is_echoed_when_sane_and_made_when_not(control_plane: ControlPlane) -> None:
    given = httpx.get(f"{control_plane.url}/health", headers={"X-Request-Id": "trace-42.a:b"})
    assert given.headers["x-request-id"] == "trace-42.a:b"
    for bad in ("x" * 65, "has space", 'quote"s', ""):
        made = httpx.get(f"{control_plane.url}/health", headers={"X-Request-Id": bad})
        assert made.headers["x-request-id"] != bad
        assert len(made.headers["x-request-id"]) == 32
    fresh = httpx.get(f"{control_plane.url}/health").headers["x-request-id"]
    assert fresh != httpx.get(f"{control_plane.url}/health").headers["x-request-id"]


def test_tenant_quota_hits_are_counted_by_limit(
    control_plane: ControlPlane,
    listener: MetricsListener,
    api_key: Callable[..., ApiKey],
    db_sessions: Any,
) -> None:
    key = api_key()
    with db_sessions() as session:
        tenants.set_limits(session, tenant_name=key.tenant_name, values={"max_models": 0}, reset=[])
    series = 'skytrain_tenant_limits_hit_total{limit="max_models"}'
    before = value(scrape(listener), series)
    response = httpx.post(
        f"{control_plane.url}/v1/models",
        headers=key.headers,
        json={"project": "p", "name": "m", "base_model": "tiny/llama"},
    )
    assert response.status_code == 403
    assert value(scrape(listener), series) == before + 1


def test_database_series_count_jobs_and_workers(listener: MetricsListener) -> None:
    text = scrape(listener)
    assert value(text, "skytrain_metrics_database_up") == 1
    # A gauge of what is going on now: jobs that ended are a counter's
    # (skytrain_training_jobs_ended_total), else this gauge would only grow.
    for status in ("queued", "running"):
        assert f'skytrain_training_jobs{{status="{status}"}}' in text
    for status in ("succeeded", "failed", "cancelled"):
        assert f'skytrain_training_jobs{{status="{status}"}}' not in text
    assert "skytrain_training_queue_depth " in text
    assert "skytrain_training_queue_oldest_wait_seconds " in text
    assert "skytrain_models_placed " in text
    # Storage and database latency, from the control plane's own calls.
    assert 'skytrain_db_query_duration_seconds_count{statement="select"}' in text


_CHILD = """
import sys
from skytrain_backend.config import Settings
from skytrain_backend.observability import listener, metrics
metrics.GATEWAY_TOKENS.labels(direction="in").inc(int(sys.argv[1]))
metrics.GATEWAY_STREAMS_OPEN.inc()
if sys.argv[2] == "ended":
    listener.process_ended(Settings())
"""


def test_several_processes_add_up_with_prometheus_multiproc_dir(tmp_path: Path) -> None:
    """Under uvicorn with several processes each writes to PROMETHEUS_MULTIPROC_DIR; the
    listener's registry adds them up (counters summed; a dead process's gauge left out)."""
    directory = tmp_path / "multiproc"
    directory.mkdir()
    env = {"PROMETHEUS_MULTIPROC_DIR": str(directory), "PYTHONPATH": ":".join(sys.path)}
    for tokens, end in (("3", "ended"), ("4", "running")):
        subprocess.run([sys.executable, "-c", _CHILD, tokens, end], env=env, check=True, timeout=60)
    settings = Settings.model_validate(
        {"observability": {"PROMETHEUS_MULTIPROC_DIR": str(directory)}}
    )
    registry = registry_for(settings)
    assert registry.get_sample_value("skytrain_gateway_tokens_total", {"direction": "in"}) == 7
    # The process that ended no longer counts among the live gauges.
    assert registry.get_sample_value("skytrain_gateway_streams_open") == 1


def test_refused_inference_requests_are_counted_by_reason(
    listener: MetricsListener, caller: Caller
) -> None:
    unserved = caller.create_model("unserved")
    before = _series_values(scrape(listener), "skytrain_gateway_refusals_total")
    refused = caller.http.post(
        "/v1/chat/completions",
        json={
            "model": unserved["inference_name"],
            "messages": [{"role": "user", "content": "hi"}],
        },
        timeout=120,
    )
    assert refused.status_code in (429, 503), refused.text
    after = _series_values(scrape(listener), "skytrain_gateway_refusals_total")
    reason = refused.json()["error"]["type"]
    series = f'{{reason="{reason}",status="{refused.status_code}"}}'
    assert after.get(series, 0) == before.get(series, 0) + 1, after


def _series_values(text: str, name: str) -> dict[str, float]:
    return {
        line[len(name) : line.rindex(" ")]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith(name + "{")
    }


def test_a_queued_job_cancelled_counts_as_one_ended_job(
    listener: MetricsListener, caller: Caller
) -> None:
    """Jobs are counted where they end, not only where a worker reports: a queued job the
    user cancels ends in the API, once."""
    series = 'skytrain_training_jobs_ended_total{status="cancelled"}'
    before = value(scrape(listener), series)
    job_id = caller.queue_job()
    assert caller.http.post(f"/v1/training-jobs/{job_id}/cancel").status_code == 200
    assert caller.http.post(f"/v1/training-jobs/{job_id}/cancel").status_code == 409
    assert value(scrape(listener), series) == before + 1


def test_a_long_poll_waits_outside_the_in_flight_gauge_and_the_request_latencies(
    listener: MetricsListener, caller: Caller
) -> None:
    """Issue 36: workers' long-polls (15-30 s by design) counted as requests in flight (2 with
    no traffic) and put the latency panel's p99 at 44 s on an idle system."""
    job_id = caller.queue_job()
    # A queued job has no events yet: the next page waits for its first.
    assert caller.http.get(f"/v1/training-jobs/{job_id}/events").json()["data"] == []
    before = scrape(listener)
    waiting = "skytrain_http_long_polls_waiting"
    in_flight = "skytrain_http_requests_in_flight"
    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        polled = pool.submit(
            caller.http.get,
            f"/v1/training-jobs/{job_id}/events",
            params={"wait_s": 30},
        )
        deadline = time.monotonic() + 30
        while value(scrape(listener), waiting) < value(before, waiting) + 1:
            assert time.monotonic() < deadline, "the long-poll never counted as waiting"
            time.sleep(0.1)
        assert value(scrape(listener), in_flight) == value(before, in_flight)
        # An event ends the wait: the cancel.
        assert caller.http.post(f"/v1/training-jobs/{job_id}/cancel").status_code == 200
        assert polled.result().status_code == 200
    after = scrape(listener)
    assert value(after, waiting) == value(before, waiting)
    route = (
        '{method="GET",route="/v1/training-jobs/{job_id}/events",route_class="long_poll",'
        'status="200",tenant_class="tenant"}'
    )
    assert value(after, f"skytrain_http_requests_total{route}") == 1 + value(
        before, f"skytrain_http_requests_total{route}"
    )


def test_groups_a_job_left_out_as_too_far_off_policy_are_counted() -> None:
    """What the worker reports with a job's result (``groups/refused_off_policy``: groups
    older than its max_off_policy_steps when it started) becomes a counter."""
    name = "skytrain_training_groups_refused_off_policy_total"
    before = REGISTRY.get_sample_value(name) or 0.0
    metrics.record_job_completion({"groups/refused_off_policy": 2.0, "groups/total": 3.0})
    metrics.record_job_completion({"groups/refused_off_policy": 0.0})
    assert REGISTRY.get_sample_value(name) == before + 2.0

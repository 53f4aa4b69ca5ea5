"""The RL loop end to end, real processes over real HTTP: a model registered with
``skytrain serve`` gets a local worker on demand, the official ``openai`` SDK samples from it,
a training job runs, and the next request is served by the new checkpoint. The scenarios that
stop no more than workers share one control plane, each with models of its own."""

from __future__ import annotations

import contextlib
import os
import signal
import time
from pathlib import Path

import openai
import pytest

from tests.e2e import support
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e]

LEARNING_RATE = 5e-3  # the tiny random model needs a push for its outputs to change visibly


def _register(service: Service, tenant: str, name: str, base_model: Path) -> dict:
    with service.http(tenant) as http:
        response = http.post(
            "/v1/models",
            json={"project": "e2e", "name": name, "base_model": str(base_model)},
        )
        assert response.status_code == 201, response.text
        return dict(response.json())


@pytest.mark.slow
def test_sample_train_and_serve_the_new_step_of_one_model_only(
    module_service: Service, tiny_model_path: Path
) -> None:
    """One tenant's two models of one base model share a worker; the first trains a step,
    which serves its next requests, while the second still serves its step 0 and another
    tenant reaches neither (one scenario: each worker start costs the most here)."""
    service = module_service
    model = _register(service, "alice", "agent", tiny_model_path)
    assert model["serving"]["ready"] is False  # nothing serves it yet: a worker is starting
    other = _register(service, "alice", "other", tiny_model_path)
    name, other_name = model["inference_name"], other["inference_name"]
    client = support.openai_client(service.url, service.key("alice"))
    with service.http("alice") as http:
        serving = support.wait_until_served(http, model["id"])
        assert serving["step"] == 0
        other_worker = support.wait_until_served(http, other["id"])["worker_id"]
        assert other_worker == serving["worker_id"]  # one base model, one worker

        choices, headers = support.sample(client, name, "Say hello.", n=4)
        assert headers["x-skytrain-step"] == "0"
        for choice in choices:  # trainable models always get sampled token ids
            tokens = [entry.token for entry in choice.logprobs.content]
            assert tokens and all(token.startswith("token_id:") for token in tokens)
        before = support.greedy(client, name, "Name a fruit.")
        other_before = support.greedy(client, other_name, "Name a fruit.")

        groups = support.sample_groups(client, name, groups=4, n=4)
        job, events = support.train(http, model["id"], groups, learning_rate=LEARNING_RATE)
        types = [event["type"] for event in events]
        assert types[0] == "training_started" and types[-1] == "training_ended", types
        started = events[0]["data"]
        assert types.count("gradient_step") == started["num_sequences"] >= 1
        assert events[-1]["data"]["step"] == 1

        # The next request is served by step 1: the gateway says so, and the output changed.
        _, headers = support.sample(client, name, "Say hello.", n=1)
        assert headers["x-skytrain-step"] == "1"
        after = support.greedy(client, name, "Name a fruit.")
        assert not support.same_policy(after, before)
        # Both steps stay addressable.
        assert support.same_policy(support.greedy(client, f"{name}:step0", "Name a fruit."), before)
        assert not support.same_policy(
            support.greedy(client, f"{name}:step1", "Name a fruit."), before
        )
        assert http.get(f"/v1/training-jobs/{job['id']}").json()["status"] == "succeeded"
        steps = [
            c["step"] for c in http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
        ]
        assert steps == [0, 1]

        # The first model's new adapter is not the second's: it still serves its step 0.
        assert not support.same_policy(after, other_before)
        assert support.same_policy(
            support.greedy(client, other_name, "Name a fruit."), other_before
        )
        _, headers = support.sample(client, other_name, "Say hello.", n=1)
        assert headers["x-skytrain-model-id"] == other["id"]
        assert headers["x-skytrain-step"] == "0"

    intruder = support.openai_client(service.url, service.key("mallory"))
    with pytest.raises(Exception) as caught:
        intruder.chat.completions.create(model=name, messages=[{"role": "user", "content": "hi"}])
    assert getattr(caught.value, "status_code", None) == 404
    with service.http("mallory") as http:
        response = http.post(
            "/v1/training-jobs", json={"model_id": model["id"], "trajectory_groups": groups}
        )
        assert response.status_code == 404
    with service.http("alice") as http:
        jobs = http.get("/v1/training-jobs", params={"model_id": model["id"]}).json()["data"]
        assert len(jobs) == 1  # the intruder's attempt left nothing behind


@pytest.mark.slow
def test_a_killed_worker_loses_nothing(module_service: Service, tiny_model_path: Path) -> None:
    service = module_service
    model = _register(service, "alice", "survivor", tiny_model_path)
    with service.http("alice") as http:
        serving = support.wait_until_served(http, model["id"])
        first_worker = serving["worker_id"]
        job_id = _long_job(service, http, model)
        pid = _worker_pid(service, first_worker)
        os.killpg(pid, signal.SIGKILL)  # the machine is gone: worker and engine at once

        events = support.events_until_end(http, job_id, timeout_s=600)
        job = http.get(f"/v1/training-jobs/{job_id}").json()
        assert job["status"] == "succeeded" and job["attempts"] == 2, job
        steps = [
            c["step"] for c in http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
        ]
        assert steps == [0, 1]  # exactly one checkpoint for the step

        ids = [int(event["id"]) for event in events]
        assert ids == sorted(set(ids))  # a cursor never sees an event twice or out of order
        types = [event["type"] for event in events]
        assert types.count("training_ended") == 1 and types[-1] == "training_ended"
        assert "training_failed" not in types
        last_start = max(i for i, t in enumerate(types) if t == "training_started")
        assert events[last_start]["data"]["attempt"] == 2
        assert (
            types[last_start:].count("gradient_step") == events[last_start]["data"]["num_sequences"]
        )

        serving = support.wait_until_served(http, model["id"], step=1)
        assert serving["worker_id"] != first_worker

    listed = service.cli("jobs", "list")
    row = next(line for line in listed.splitlines() if job_id in line)
    assert "succeeded" in row and "2" in row.split()


@pytest.mark.slow
def test_a_worker_told_to_stop_hands_its_job_back_between_two_steps(
    module_service: Service, tiny_model_path: Path
) -> None:
    """SIGTERM mid-job (a scale-down, a spot instance's notice): the worker trains no further
    step and hands the job back, and another worker runs it from the start."""
    service = module_service
    model = _register(service, "alice", "stopped", tiny_model_path)
    with service.http("alice") as http:
        first_worker = support.wait_until_served(http, model["id"])["worker_id"]
        job_id = _long_job(service, http, model)
        os.kill(_worker_pid(service, first_worker), signal.SIGTERM)

        events = support.events_until_end(http, job_id, timeout_s=600)
        job = http.get(f"/v1/training-jobs/{job_id}").json()
        assert job["status"] == "succeeded" and job["attempts"] == 2, job
        types = [event["type"] for event in events]
        starts = [i for i, t in enumerate(types) if t == "training_started"]
        assert [events[i]["data"]["attempt"] for i in starts] == [1, 2]
        first_attempt = types[starts[0] : starts[1]]
        # Stopped between two steps: the first attempt did not train all of them.
        assert 0 < first_attempt.count("gradient_step") < events[starts[0]]["data"]["num_sequences"]
        assert "training_failed" not in types
        assert support.wait_until_served(http, model["id"], step=1)["worker_id"] != first_worker


def _wait_for_event(http, job_id: str, event_type: str, timeout_s: float = 300) -> None:  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        events = http.get(f"/v1/training-jobs/{job_id}/events", params={"limit": 100}).json()
        if any(event["type"] == event_type for event in events["data"]):
            return
        time.sleep(0.1)
    raise AssertionError(f"no {event_type} event for job {job_id}")


def _worker_pid(service: Service, worker_id: str) -> int:
    """The worker's process id, from the hardware it reported when it registered."""
    import sqlite3

    with sqlite3.connect(service.home / "skytrain.db") as db:
        (hardware,) = db.execute(
            "select hardware from workers where id = ?", (worker_id,)
        ).fetchone()
    import json

    return int(json.loads(hardware)["pid"])


@pytest.mark.slow
def test_idle_workers_stop_and_requests_bring_them_back(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    service = start_service({"SKYTRAIN_WORKER_IDLE_TIMEOUT_S": "10"}, tmp_path / "home")
    try:
        model = _register(service, "alice", "sleepy", tiny_model_path)
        client = support.openai_client(service.url, service.key("alice"))
        with service.http("alice") as http:
            worker_id = support.wait_until_served(http, model["id"])["worker_id"]
            pid = _worker_pid(service, worker_id)
            deadline = time.monotonic() + 120
            while _process_alive(pid) and time.monotonic() < deadline:
                time.sleep(1)
            assert not _process_alive(pid), "the idle worker was not stopped"
            assert f"registered as worker {worker_id}" in service.cli("logs", worker_id)
            assert http.get(f"/v1/models/{model['id']}").json()["serving"]["ready"] is False

            # A request for the model starts a worker again; meanwhile it is told to retry.
            with pytest.raises(openai.APIStatusError) as caught:
                client.chat.completions.create(
                    model=model["inference_name"], messages=[{"role": "user", "content": "hi"}]
                )
            assert caught.value.status_code == 503
            assert "Retry-After" in caught.value.response.headers
            serving = support.wait_until_served(http, model["id"])
            assert serving["worker_id"] != worker_id
    finally:
        stop_service(service)


def _process_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead too: it only waits for its parent to read its exit code.
    with open(f"/proc/{pid}/stat") as stat:
        return stat.read().split(") ")[1][0] != "Z"


def _long_job(service: Service, http, model: dict) -> str:  # type: ignore[no-untyped-def]
    """Queue a job long enough to stop a worker or the control plane in its middle (one
    group per optimizer step, each in short rows: 16 steps of about 8 rows); return once it
    trains."""
    client = support.openai_client(service.url, service.key("alice"))
    groups = support.sample_groups(client, model["inference_name"], groups=16, n=8)
    response = http.post(
        "/v1/training-jobs",
        json={
            "model_id": model["id"],
            "trajectory_groups": groups,
            "config": {
                "learning_rate": LEARNING_RATE,
                "num_gradient_steps": 16,
                "packed_sequence_length": 64,
            },
        },
    )
    assert response.status_code == 201, response.text
    job_id: str = response.json()["id"]
    _wait_for_event(http, job_id, "gradient_step")
    return job_id


def _rows(service: Service, query: str, *args: str) -> list[tuple]:  # type: ignore[type-arg]
    import sqlite3

    with contextlib.closing(sqlite3.connect(service.home / "skytrain.db")) as db:
        return db.execute(query, args).fetchall()


@pytest.mark.slow
def test_a_stopped_control_plane_hands_its_workers_jobs_out_again(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    """Local workers end with the control plane: on the way down it records them stopped, a
    cancelled running job ends, and an interrupted one waits in the queue for the next start."""
    home = tmp_path / "home"
    service = start_service({}, home)
    try:
        model = _register(service, "alice", "restarted", tiny_model_path)
        with service.http("alice") as http:
            first_worker = support.wait_until_served(http, model["id"])["worker_id"]
            cancelled = _long_job(service, http, model)
            assert http.post(f"/v1/training-jobs/{cancelled}/cancel").status_code == 200
    finally:
        stop_service(service)
    assert _rows(service, "select status from workers where id = ?", first_worker) == [("stopped",)]
    assert _rows(service, "select status from training_jobs where id = ?", cancelled) == [
        ("cancelled",)
    ]

    service = start_service({}, home)
    try:
        with service.http("alice") as http:
            second_worker = support.wait_until_served(http, model["id"])["worker_id"]
            interrupted = _long_job(service, http, model)
    finally:
        stop_service(service)
    assert _rows(service, "select status from workers where id = ?", second_worker) == [
        ("stopped",)
    ]
    assert _rows(
        service, "select status, attempts, worker_id from training_jobs where id = ?", interrupted
    ) == [("queued", 1, None)]
    # Both workers ended on their own, mid-job and with their control plane gone, within the
    # grace the control plane gives them before it kills them.
    logs = sorted((home / "workers").glob("*.log"))
    assert len(logs) == 2
    for log in logs:
        text = log.read_text()
        assert "worker stopped" in text, log.name
        # The gateway's kept-alive connections to it were closed first: its front door did
        # not wait out its graceful-shutdown timeout for them.
        assert "timeout graceful shutdown exceeded" not in text, log.name

    service = start_service({}, home)
    try:
        with service.http("alice") as http:
            events = support.events_until_end(http, interrupted, timeout_s=600)
            assert events[-1]["type"] == "training_ended"
            job = http.get(f"/v1/training-jobs/{interrupted}").json()
            assert job["status"] == "succeeded" and job["attempts"] == 2, job
            steps = [
                c["step"] for c in http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
            ]
            assert steps == [0, 1]  # the cancelled job committed nothing
    finally:
        stop_service(service)

"""One model on two workers (issue 35), with real workers: ``skytrain serve`` with the local
provider launches both (CPU engine + trainer, the tiny model), each engine sleeping while
its worker trains as on a GPU (``SKYTRAIN_WORKER_SLEEP_ENGINE``).

A real job trains on the model's home while requests to the model keep getting 200 from the
replica; then the new step answers on both workers. tests/gateway/test_replicas.py covers the
balancing and scaling with engines behind worker rows; this is the same promise end to end.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import support
from tests.e2e.conftest import show_logs
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e]

LEARNING_RATE = 5e-3


@pytest.fixture
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    running = start_service(
        {
            "SKYTRAIN_WORKER_SLEEP_ENGINE": "true",
            "SKYTRAIN_ENGINE_SLEEP_WAIT_S": "5",
            "SKYTRAIN_MAX_WORKERS": "2",
            "SKYTRAIN_TENANT_MAX_WORKERS": "2",
        },
        tmp_path / "home",
    )
    yield running
    stop_service(running)
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        show_logs(running)


def _serving(http: httpx.Client, model_id: str) -> dict[str, str]:
    """Worker id -> role, for the workers that serve the model now."""
    replicas = http.get(f"/v1/models/{model_id}").json()["replicas"] or []
    return {item["worker_id"]: item["role"] for item in replicas if item["status"] == "serving"}


def _chat(http: httpx.Client, model: str) -> dict[str, Any]:
    sent = time.time()
    response = http.post(
        "/v1/chat/completions",
        json={"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2},
    )
    return {
        "status": response.status_code,
        "text": response.text[:300],
        "worker": response.headers.get("x-skytrain-worker"),
        "step": response.headers.get("x-skytrain-step"),
        "sent": sent,
        "answered": time.time(),
    }


@pytest.mark.slow
def test_a_job_trains_on_one_replica_while_the_other_answers_then_both_serve_its_step(
    service: Service, tiny_model_path: Path
) -> None:
    with service.http("alice") as http:
        created = http.post(
            "/v1/models",
            json={
                "project": "replicas",
                "name": "served",
                "base_model": str(tiny_model_path),
                "config": {"min_replicas": 2, "max_replicas": 2},
            },
        )
        assert created.status_code == 201, created.text
        model = created.json()
        deadline = time.monotonic() + 300
        while len(roles := _serving(http, model["id"])) < 2:
            assert time.monotonic() < deadline, f"two replicas not placed: {roles}"
            time.sleep(0.5)
        (home,) = [worker for worker, role in roles.items() if role == "home"]
        (replica,) = [worker for worker, role in roles.items() if role == "replica"]
        # A replica is placed on a worker that may still be starting: both answer first.
        _until_every_worker_answers(http, model["inference_name"], {home: "0", replica: "0"})
        client = support.openai_client(service.url, service.key("alice"))
        groups = support.sample_groups(client, model["inference_name"], groups=2, n=4)

        # Requests go on, two at a time, from before the job until after it ended.
        answers: list[dict[str, Any]] = []
        stop = threading.Event()

        def keep_asking() -> None:
            with service.http("alice") as own:
                while not stop.is_set():
                    answers.append(_chat(own, model["inference_name"]))

        askers = [threading.Thread(target=keep_asking) for _ in range(2)]
        for asker in askers:
            asker.start()
        try:
            _, events = support.train(http, model["id"], groups, learning_rate=LEARNING_RATE)
        finally:
            stop.set()
            for asker in askers:
                asker.join()

        assert events[-1]["type"] == "training_ended", events[-1]
        refused = [answer for answer in answers if answer["status"] != 200]
        assert not refused, refused  # no 503 window while the home trained
        # The home trained, its engine asleep meanwhile (the job's timeline says when): the
        # answers asked and given in that time came from the replica.
        (timeline,) = [e["data"] for e in events if e["type"] == "job_timeline"]
        engine = {call["call"]: call["at"] for call in timeline["engine"]}
        asleep = [
            answer
            for answer in answers
            if engine["sleep"] <= answer["sent"] and answer["answered"] <= engine["wake_up"]
        ]
        assert asleep, (engine, [(a["sent"], a["answered"]) for a in answers])
        assert {answer["worker"] for answer in asleep} == {replica}

        # The committed step then answers on both workers (the replica loads it at its next
        # heartbeat; until then :latest goes to its newest step).
        _until_every_worker_answers(http, model["inference_name"], {home: "1", replica: "1"})


def _until_every_worker_answers(
    http: httpx.Client, model: str, steps: dict[str, str], timeout_s: float = 180
) -> None:
    """Bursts of requests (every one answered) until one is answered by exactly these
    workers, each with its step here."""
    expected = set(steps.items())
    deadline = time.monotonic() + timeout_s
    with ThreadPoolExecutor(max_workers=4) as pool:
        while True:
            burst = list(pool.map(lambda _: _chat(http, model), range(8)))
            answered = {(answer["worker"], answer["step"]) for answer in burst}
            if answered == expected:
                return
            assert time.monotonic() < deadline, (expected, burst)
            time.sleep(0.5)

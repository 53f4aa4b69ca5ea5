"""A worker whose memory plan shards the trainer (``SKYTRAIN_TRAINER_SHARDS=2``) trains its
jobs under torchrun, as on a node of GPUs: here 2 CPU processes on gloo. Real processes over
real HTTP: the control plane, the worker with the CPU engine, the trainer's ranks."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

import tinker
from tests.e2e import support
from tests.e2e.test_preemption import (
    _adapter_and_metrics,
    _check_events,
    _finished,
    _register,
    _sft,
    _yield_to_quick_job,
)
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.distributed]


@pytest.fixture(scope="module")
def service(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    overrides = {
        "SKYTRAIN_TRAINER_SHARDS": "2",
        "SKYTRAIN_WORKER_SLEEP_ENGINE": "true",
        "SKYTRAIN_MAX_WORKERS": "1",
        "OMP_NUM_THREADS": "1",
    }
    running = start_service(overrides, tmp_path_factory.mktemp("sharded") / "home")
    yield running
    stop_service(running)


@pytest.mark.slow
def test_a_sharded_worker_trains_a_job_on_its_ranks_and_serves_the_step(
    service: Service, tiny_model_path: Path
) -> None:
    with service.http("alice") as http:
        response = http.post(
            "/v1/models",
            json={"project": "sharded", "name": "m", "base_model": str(tiny_model_path)},
        )
        assert response.status_code == 201, response.text
        model = response.json()
        support.wait_until_served(http, model["id"])
        client = support.openai_client(service.url, service.key("alice"))
        groups = support.sample_groups(client, model["inference_name"], groups=2, n=3, max_tokens=8)
        _, events = support.train(
            http, model["id"], groups, learning_rate=5e-3, num_gradient_steps=2
        )
        types = [e["type"] for e in events]
        assert types[-1] == "training_ended", events[-1]
        assert types.count("gradient_step") == 2
        started = next(e for e in events if e["type"] == "training_started")
        assert "logprob_agreement/max_abs_diff" in started["data"]
        (timeline,) = [e["data"] for e in events if e["type"] == "job_timeline"]
        trainer = timeline["trainer"]
        assert trainer[0]["event"] == "loaded" and trainer[0]["processes"] == 2
        assert [e["event"] for e in trainer[1:]] == [
            "gradient_step",
            "gradient_step",
            "saved",
            "released",
        ]
        _, headers = support.sample(client, model["inference_name"], "Say hello.", n=1)
        assert headers["x-skytrain-step"] == "1"


@pytest.mark.slow
def test_a_tinker_run_on_the_sharded_worker_is_refused_with_the_reason(
    service: Service, tiny_model_path: Path
) -> None:
    """Tinker runs train in one process on one device; this worker's plan shards training, so
    its run fails at once, saying so and what to use instead, rather than loading the whole
    model onto one device (here the control plane has no GPUs to plan with: the worker is
    the one that knows)."""
    client = tinker.ServiceClient(base_url=service.url, api_key="tml-" + service.key("bob"))
    try:
        with pytest.raises(tinker.RequestFailedError, match="sharded over 2 devices") as failed:
            client.create_lora_training_client(base_model=str(tiny_model_path), rank=8).result(
                timeout=300
            )
        assert "training jobs" in str(failed.value)
    finally:
        client.close("success").result(timeout=60)


@pytest.fixture
def sliced_sharded_service(tmp_path: Path) -> Iterator[Service]:
    """A sharded worker whose jobs yield at their next step once another tenant's job waits."""
    overrides = {
        "SKYTRAIN_TRAINER_SHARDS": "2",
        "SKYTRAIN_JOB_TIME_SLICE_S": "0",
        "OMP_NUM_THREADS": "1",
    }
    service = start_service(overrides, tmp_path / "home")
    yield service
    stop_service(service)


@pytest.mark.slow
def test_a_sharded_job_yields_at_a_step_boundary_and_resumes_exactly(
    sliced_sharded_service: Service, tiny_model_path: Path
) -> None:
    """The ranks stop where the worker says, rank 0 saves the job's state, and the resumed
    job ends with the adapter of the same job run by the ranks without a pause."""
    service = sliced_sharded_service
    with service.http("alice") as alice, service.http("bob") as bob:
        long, reference = (_register(alice, name, tiny_model_path) for name in ("long", "ref"))
        quick = _register(bob, "quick", tiny_model_path)
        for http, model in ((alice, long), (alice, reference), (bob, quick)):
            support.wait_until_served(http, model["id"])
        _finished(alice, _sft(alice, reference, trajectories=4, epochs=2))
        job = _sft(alice, long, trajectories=4, epochs=2)
    _, done = _yield_to_quick_job(service, job, quick)
    with service.http("alice") as alice:
        _check_events(alice, done)
        adapter, metrics = _adapter_and_metrics(alice, long)
        expected_adapter, expected_metrics = _adapter_and_metrics(alice, reference)
        assert adapter == expected_adapter  # the same ranks, the same sums: bit for bit
        assert metrics == expected_metrics

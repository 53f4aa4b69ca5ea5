"""Time slices end to end, real processes over real HTTP: two tenants share one local worker;
tenant A's long job yields it at a step boundary when tenant B's one-step job arrives, B's job
runs first, and A's job resumes from its saved state and ends with exactly the adapter and
metrics of the same job run without a pause, for an SFT job and a multi-step RL job."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from tests.e2e import support
from tests.fixtures.art import ArtEvent
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e]

ADAPTER = "adapter_model.safetensors"


def _register(http: httpx.Client, name: str, base_model: Path) -> dict[str, Any]:
    response = http.post(
        "/v1/models", json={"project": "slices", "name": name, "base_model": str(base_model)}
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def _answer(n: int) -> dict[str, Any]:
    return {
        "messages_and_choices": [
            {"role": "user", "content": f"Name colour number {n}."},
            {"role": "assistant", "content": f"Colour {n} is {'blue' if n % 2 else 'red'}."},
        ],
        "reward": 0,
    }


def _sft(http: httpx.Client, model: dict[str, Any], trajectories: int, epochs: int) -> str:
    response = http.post(
        "/v1/sft-training-jobs",
        json={
            "model_id": model["id"],
            "trajectories": [_answer(n) for n in range(trajectories)],
            "config": {"learning_rate": 1e-2, "batch_size": 1, "num_epochs": epochs},
        },
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _rl(http: httpx.Client, model: dict[str, Any], groups: list[dict[str, Any]]) -> str:
    response = http.post(
        "/v1/training-jobs",
        json={
            "model_id": model["id"],
            "trajectory_groups": groups,
            "config": {"learning_rate": 5e-3, "num_gradient_steps": len(groups)},
        },
    )
    assert response.status_code == 201, response.text
    return str(response.json()["id"])


def _wait_until_running(http: httpx.Client, job_id: str, timeout_s: float = 300) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if http.get(f"/v1/training-jobs/{job_id}").json()["status"] == "running":
            return
        time.sleep(0.1)
    raise AssertionError(f"job {job_id} did not start within {timeout_s}s")


def _finished(http: httpx.Client, job_id: str) -> dict[str, Any]:
    events = support.events_until_end(http, job_id, timeout_s=600)
    assert events[-1]["type"] == "training_ended", events[-3:]
    return dict(http.get(f"/v1/training-jobs/{job_id}").json())


def _adapter_and_metrics(http: httpx.Client, model: dict[str, Any]) -> tuple[bytes, dict]:  # type: ignore[type-arg]
    checkpoint = http.get(f"/v1/models/{model['id']}/checkpoints/1").json()
    adapter = http.get(f"/v1/models/{model['id']}/checkpoints/1/files/{ADAPTER}")
    assert adapter.status_code == 200, adapter.text
    # The worker's phase times differ between runs; everything the trainer measured does not.
    metrics = {k: v for k, v in checkpoint["metrics"].items() if not k.startswith("time/")}
    return adapter.content, metrics


def _yield_to_quick_job(
    service: Service, long_job: str, quick: dict[str, Any]
) -> tuple[dict[str, Any], dict[str, Any]]:
    """Tenant B sends a one-step job while tenant A's long job trains: both end, in order."""
    with service.http("alice") as alice, service.http("bob") as bob:
        _wait_until_running(alice, long_job)
        quick_job = _sft(bob, quick, trajectories=1, epochs=1)
        quick_done = _finished(bob, quick_job)
        long_done = _finished(alice, long_job)
    assert quick_done["finished_at"] < long_done["finished_at"]  # B's job did not wait for A's
    assert quick_done["preemptions"] == 0
    return quick_done, long_done


def _check_events(http: httpx.Client, job: dict[str, Any]) -> None:
    """One start, a yield, a resume where it stopped, every step once; ART sees a plain run."""
    events = http.get(f"/v1/training-jobs/{job['id']}/events", params={"limit": 100}).json()
    types = [event["type"] for event in events["data"]]
    assert types.count("training_started") == 1 and types[0] == "training_started", types
    assert job["preemptions"] >= 1 and job["attempts"] == job["preemptions"] + 1, job
    preempted = [e["data"] for e in events["data"] if e["type"] == "training_preempted"]
    resumed = [e["data"] for e in events["data"] if e["type"] == "training_resumed"]
    assert len(preempted) == len(resumed) == job["preemptions"]
    assert [p["steps_done"] for p in preempted] == [r["steps_done"] for r in resumed]
    num_steps = events["data"][0]["data"]["num_gradient_steps"]
    assert 0 < preempted[0]["steps_done"] < num_steps
    assert types.count("gradient_step") == num_steps

    art = http.get(f"/v1/preview/training-jobs/{job['id']}/events", params={"limit": 100})
    art_events = [ArtEvent.model_validate(event) for event in art.json()["data"]]
    assert [e.type for e in art_events].count("gradient_step") == (
        art_events[0].data["num_sequences"]
    )
    assert art_events[-1].type == "training_ended"


@pytest.fixture
def sliced_service(tmp_path: Path) -> Any:
    """A control plane whose jobs yield at their next step as soon as another tenant's job
    waits (a time slice of 0 s: the test never waits for a clock)."""
    service = start_service({"SKYTRAIN_JOB_TIME_SLICE_S": "0"}, tmp_path / "home")
    yield service
    stop_service(service)


@pytest.mark.slow
def test_a_long_job_yields_its_worker_to_another_tenants_job_and_resumes_exactly(
    sliced_service: Service, tiny_model_path: Path
) -> None:
    service = sliced_service
    with service.http("alice") as alice, service.http("bob") as bob:
        models = {
            name: _register(alice, name, tiny_model_path)
            for name in ("sft-long", "sft-reference", "rl-long", "rl-reference")
        }
        quick = _register(bob, "quick", tiny_model_path)
        workers = {
            support.wait_until_served(http, model["id"])["worker_id"]
            for http, model in [(alice, m) for m in models.values()] + [(bob, quick)]
        }
        assert len(workers) == 1  # one base model, one worker for both tenants

        client = support.openai_client(service.url, service.key("alice"))
        groups = support.sample_groups(client, models["rl-reference"]["inference_name"], groups=6)
        # The runs without a pause: nothing of another tenant waits meanwhile.
        _finished(alice, _sft(alice, models["sft-reference"], trajectories=6, epochs=4))
        _finished(alice, _rl(alice, models["rl-reference"], groups))

        sft_job = _sft(alice, models["sft-long"], trajectories=6, epochs=4)
    _, sft_done = _yield_to_quick_job(service, sft_job, quick)

    with service.http("alice") as alice:
        rl_job = _rl(alice, models["rl-long"], groups)
    _, rl_done = _yield_to_quick_job(service, rl_job, quick)

    with service.http("alice") as alice:
        for done, long_name, reference_name in (
            (sft_done, "sft-long", "sft-reference"),
            (rl_done, "rl-long", "rl-reference"),
        ):
            _check_events(alice, done)
            adapter, metrics = _adapter_and_metrics(alice, models[long_name])
            expected_adapter, expected_metrics = _adapter_and_metrics(alice, models[reference_name])
            assert adapter == expected_adapter, long_name  # bit for bit
            assert metrics == expected_metrics, long_name

"""A worker's jobs as on a GPU, with the CPU engine and trainer: real processes over real HTTP.

The worker runs as one whose engine shares its device with the trainer
(``SKYTRAIN_WORKER_SLEEP_ENGINE``, its sleep waiting ``SKYTRAIN_ENGINE_SLEEP_WAIT_S`` for
requests in flight), with a cap on a training step's activation memory
(``SKYTRAIN_TRAINER_MEMORY_LIMIT_MB``) and on the LoRA rank its engine loads
(``SKYTRAIN_ENGINE_MAX_LORA_RANK``). What the tests read is what the engine and the trainer
recorded themselves (the job's ``job_timeline`` event), the job's events and rows, and what
the gateway serves afterwards.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import torch

from skytrain_backend.protocol import lora_name
from skytrain_backend.trainer.memory import MIB, ModelShape, activation_bytes
from tests.e2e import support
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e]

MAX_LORA_RANK = 8
# Rows up to this many tokens fit the worker's activation memory cap; longer ones do not.
ROW_TOKENS_THAT_FIT = 192
SHORT_ROWS = 128  # a job packed into rows this long trains
LONG_ROWS = 2048  # the same kind of job packed into one long row runs out of memory
LEARNING_RATE = 5e-3
# How long the engine's sleep waits for requests in flight before it aborts them.
SLEEP_WAIT_S = 2


def _memory_limit_mb(model_path: Path) -> int:
    """The cap that ``ROW_TOKENS_THAT_FIT`` tokens just fit, by the trainer's own estimate."""
    from transformers import AutoConfig

    needed = activation_bytes(
        ModelShape.from_config(AutoConfig.from_pretrained(model_path).to_dict()),
        row_tokens=ROW_TOKENS_THAT_FIT,
        chunk_size=1024,
        dtype_bytes=4,
        gradient_checkpointing=False,
        lora_rank=8,  # the models' default rank
    )
    return math.ceil(needed / MIB)


@pytest.fixture(scope="module")
def service(tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    overrides = {
        "SKYTRAIN_WORKER_SLEEP_ENGINE": "true",
        "SKYTRAIN_TRAINER_MEMORY_LIMIT_MB": str(_memory_limit_mb(tiny_model_path)),
        "SKYTRAIN_ENGINE_MAX_LORA_RANK": str(MAX_LORA_RANK),
        "SKYTRAIN_MAX_WORKERS": "1",
        "SKYTRAIN_ENGINE_SLEEP_WAIT_S": str(SLEEP_WAIT_S),
    }
    running = start_service(overrides, tmp_path_factory.mktemp("worker-jobs") / "home")
    yield running
    stop_service(running)


def _served_model(service: Service, tiny_model_path: Path, name: str) -> dict[str, Any]:
    with service.http("alice") as http:
        response = http.post(
            "/v1/models",
            json={"project": "jobs", "name": name, "base_model": str(tiny_model_path)},
        )
        assert response.status_code == 201, response.text
        model = dict(response.json())
        support.wait_until_served(http, model["id"])
    return model


def _served_with_groups(
    service: Service, tiny_model_path: Path, name: str, *, groups: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A served model of alice's and ``groups`` groups of 4 sampled from it."""
    model = _served_model(service, tiny_model_path, name)
    client = support.openai_client(service.url, service.key("alice"))
    sampled = support.sample_groups(
        client, model["inference_name"], groups=groups, n=4, max_tokens=16
    )
    return model, sampled


def _train(
    http: httpx.Client, model: dict[str, Any], groups: list[dict[str, Any]], *, rows: int
) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A job on ``groups`` at the tests' learning rate in rows of ``rows`` tokens, followed
    to its end: the job and its events."""
    return support.train(
        http, model["id"], groups, learning_rate=LEARNING_RATE, packed_sequence_length=rows
    )


def _timeline(events: list[dict[str, Any]]) -> dict[str, Any]:
    (event,) = [e for e in events if e["type"] == "job_timeline"]
    return dict(event["data"])


def _job(http: httpx.Client, job_id: str) -> dict[str, Any]:
    return dict(http.get(f"/v1/training-jobs/{job_id}").json())


@pytest.mark.slow
def test_a_lora_rank_above_the_workers_limit_is_refused_at_creation(
    service: Service, tiny_model_path: Path
) -> None:
    _served_model(service, tiny_model_path, "within-the-limit")  # a worker has registered
    with service.http("alice") as http:
        response = http.post(
            "/v1/models",
            json={
                "project": "jobs",
                "name": "too-wide",
                "base_model": str(tiny_model_path),
                "config": {"lora_rank": 2 * MAX_LORA_RANK},
            },
        )
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert f"lora_rank {2 * MAX_LORA_RANK} is above {MAX_LORA_RANK}" in message
        assert f"the largest the workers serving {tiny_model_path} load" in message
        names = [
            m["name"] for m in http.get("/v1/models", params={"project": "jobs"}).json()["data"]
        ]
        assert "too-wide" not in names


@pytest.mark.slow
def test_a_job_sleeps_the_engine_trains_frees_wakes_then_loads_and_serves_the_step(
    service: Service, tiny_model_path: Path
) -> None:
    """... and a job queued behind it on the same groups (sampled from step 0), allowing no
    lag (max_off_policy_steps=0), is taken when queued but starts from step 1: none of its
    groups may be trained on, so it fails saying so, without a sleep of the engine for
    nothing."""
    model, groups = _served_with_groups(service, tiny_model_path, "in-order", groups=2)
    config = {"learning_rate": LEARNING_RATE, "packed_sequence_length": SHORT_ROWS}
    with service.http("alice") as http:
        posted = [
            http.post(
                "/v1/training-jobs",
                json={"model_id": model["id"], "trajectory_groups": groups, "config": limits},
            )
            for limits in (config, {**config, "max_off_policy_steps": 0})
        ]
        assert [p.status_code for p in posted] == [201, 201], [p.text for p in posted]
        job, behind = (p.json() for p in posted)
        events = support.events_until_end(http, job["id"])
        types = [e["type"] for e in events]
        assert types[-1] == "training_ended", events[-1]
        assert types.index("job_timeline") < types.index("training_ended")
        # training_started comes first, with the agreement the first step's forward pass read.
        assert types[0] == "training_started" and types[1] == "gradient_step", types
        # The same numbers in fp32 on a CPU; bf16 noise on CUDA (0.002 on an H200).
        tolerance = 0.01 if torch.cuda.is_available() else 1e-4
        assert events[0]["data"]["logprob_agreement/max_abs_diff"] < tolerance
        ended = events[-1]["data"]
        assert ended["time/prepare_s"] >= 0 and ended["time/steps_s"] >= 0

        timeline = _timeline(events)
        adapter = lora_name(model["id"], 1)
        engine = [
            c
            for c in timeline["engine"]
            if c["call"] in ("sleep", "wake_up") or c.get("lora_name") == adapter
        ]
        assert [c["call"] for c in engine] == ["sleep", "wake_up", "load_lora_adapter"]
        sleep, wake, load = (c["at"] for c in engine)
        assert engine[0]["aborted_requests"] == 0  # it waited for requests in flight
        trainer = timeline["trainer"]
        kinds = [e["event"] for e in trainer]
        assert kinds[0] == "loaded" and kinds[-2:] == ["saved", "released"]
        assert set(kinds[1:-2]) == {"gradient_step"}
        loaded, *steps, saved, released = (e["at"] for e in trainer)
        # sleep -> load the trainer -> train -> save -> free -> wake -> load the adapter
        assert sleep <= loaded <= min(steps) and max(steps) <= saved <= released <= wake <= load

        # ... and the engine serves the new step before the job says it ended.
        client = support.openai_client(service.url, service.key("alice"))
        _, headers = support.sample(client, model["inference_name"], "Say hello.", n=1)
        assert headers["x-skytrain-step"] == "1"
        assert _job(http, job["id"])["attempts"] == 1

        events = support.events_until_end(http, behind["id"])
        assert events[-1]["type"] == "training_failed", events
        assert "training_started" not in [e["type"] for e in events]
        message = events[-1]["data"]["error_message"]
        assert "max_off_policy_steps=0 steps before step 1" in message, message
        assert (_job(http, behind["id"])["status"], _job(http, behind["id"])["attempts"]) == (
            "failed",
            1,
        )
        engine = _timeline(events)["engine"]
        assert [c["call"] for c in engine if c["call"] in ("sleep", "wake_up")] == []


def test_a_job_that_runs_out_of_memory_fails_once_and_the_worker_keeps_serving(
    service: Service, tiny_model_path: Path
) -> None:
    model, groups = _served_with_groups(service, tiny_model_path, "too-long", groups=6)
    with service.http("alice") as http:
        job, events = _train(http, model, groups, rows=LONG_ROWS)
        types = [e["type"] for e in events]
        # It failed in a training step: after training started, before any step ended.
        assert types[0] == "training_started" and types[-1] == "training_failed", types
        assert "gradient_step" not in types
        message = events[-1]["data"]["error_message"]
        assert message.startswith("out of memory: a training step over a row of")
        assert "packed_sequence_length" in message
        row = _job(http, job["id"])
        # Not retried: the same job would need the same memory again.
        assert (row["status"], row["attempts"], row["error"]) == ("failed", 1, message)

        timeline = _timeline(events)
        assert [e["event"] for e in timeline["trainer"]] == ["loaded", "released"]
        engine = [c for c in timeline["engine"] if c["call"] in ("sleep", "wake_up")]
        assert [c["call"] for c in engine] == ["sleep", "wake_up"]
        assert timeline["trainer"][-1]["at"] <= engine[-1]["at"]  # freed, then woken
        # The worker freed the trainer, woke its engine and serves on.
        client = support.openai_client(service.url, service.key("alice"))
        choices, headers = support.sample(client, model["inference_name"], "Still there?", n=1)
        assert headers["x-skytrain-step"] == "0" and choices[0].logprobs is not None


def test_a_config_error_fails_the_job_once_without_a_retry(
    service: Service, tiny_model_path: Path
) -> None:
    model, groups = _served_with_groups(service, tiny_model_path, "misconfigured", groups=1)
    with service.http("alice") as http:
        # Rows of 16 tokens hold none of the sampled tokens, which all follow a longer prompt.
        job, events = support.train(http, model["id"], groups, packed_sequence_length=16)
        assert events[-1]["type"] == "training_failed"
        assert "every trained token lies beyond 16 tokens" in events[-1]["data"]["error_message"]
        row = _job(http, job["id"])
        assert (row["status"], row["attempts"]) == ("failed", 1)


@pytest.mark.slow
def test_a_job_aborts_requests_still_in_flight_after_the_sleep_timeout_and_trains(
    service: Service, tiny_model_path: Path
) -> None:
    model, groups = _served_with_groups(service, tiny_model_path, "long-request", groups=1)
    client = support.openai_client(service.url, service.key("alice"))
    started, outcome = threading.Event(), []

    def long_request() -> None:
        """Generation far longer than the sleep's wait (thousands of decode steps)."""
        try:
            stream = client.chat.completions.create(
                model=model["inference_name"],
                messages=[{"role": "user", "content": "Write forever."}],
                max_tokens=2000,
                n=4,
                stream=True,
                extra_body={"ignore_eos": True},
            )
            for _ in stream:
                started.set()
            outcome.append("finished")
        except Exception as exc:
            outcome.append(f"{type(exc).__name__}: {exc}")
        finally:
            started.set()

    with service.http("alice") as http:
        thread = threading.Thread(target=long_request, daemon=True)
        thread.start()
        assert started.wait(120)
        job, events = _train(http, model, groups, rows=SHORT_ROWS)
        thread.join(120)
        assert events[-1]["type"] == "training_ended", events[-1]
        sleep = next(c for c in _timeline(events)["engine"] if c["call"] == "sleep")
        # It waited SKYTRAIN_ENGINE_SLEEP_WAIT_S for the request, then aborted it to train.
        assert sleep["aborted_requests"] >= 1
        assert outcome and outcome[0] != "finished", outcome
        assert _job(http, job["id"])["attempts"] == 1


@pytest.mark.slow
def test_the_kl_reference_is_the_models_own_checkpoint_the_worker_fetches(
    service: Service, tiny_model_path: Path
) -> None:
    """ART's KL reference keys through the control plane and the worker: the reference is
    the model's checkpoint at the step named (by step, by lag, by checkpoint id), fetched and
    loaded beside the policy. Against the checkpoint a job starts from, its first step's KL
    (ART's, from the current learner) is 0; against an older one it is not."""
    model, groups = _served_with_groups(service, tiny_model_path, "kl-reference", groups=2)
    for sampled in groups:  # a reward signal in every group, whatever was sampled
        for index, trajectory in enumerate(sampled["trajectories"]):
            trajectory["reward"] = float(index % 2)
    with service.http("alice") as http:
        _, events = _train(http, model, groups, rows=SHORT_ROWS)
        assert events[-1]["type"] == "training_ended", events[-1]

        def first_kl(**art: Any) -> float:
            response = http.post(
                "/v1/training-jobs",
                json={
                    "model_id": model["id"],
                    "trajectory_groups": groups,
                    "experimental_config": {
                        "learning_rate": LEARNING_RATE,
                        "kl_penalty_coef": 0.5,
                        "kl_penalty_source": "current_learner",
                        "packed_sequence_length": SHORT_ROWS,  # rows within the memory cap
                        **art,
                    },
                },
            )
            assert response.status_code == 201, response.text
            events = support.events_until_end(http, response.json()["id"])
            assert events[-1]["type"] == "training_ended", events[-1]
            steps = [e["data"] for e in events if e["type"] == "gradient_step"]
            return float(steps[0]["kl/policy_ref"])

        assert abs(first_kl(kl_penalty_reference_step=1)) < 1e-6  # from step 1, against it
        assert abs(first_kl(kl_penalty_step_lag=1)) < 1e-6  # from step 2, against step 2
        (step_1,) = [
            c
            for c in http.get(f"/v1/models/{model['id']}/checkpoints").json()["data"]
            if c["step"] == 1
        ]
        assert abs(first_kl(kl_ref_adapter_path=step_1["id"])) > 1e-4  # from step 3

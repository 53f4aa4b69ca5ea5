"""A fresh control plane plans a new model from its base model's config.json on the Hub
before any launch: the real app over HTTP with the ``skypilot`` provider and its scheduler,
an empty model cache, HF_ENDPOINT pointed at the loopback Hub (tests/fixtures/hub.py, the
real models' config.json). Only SkyPilot's SDK is the fake cloud (tests/provision/fake_sky.py).

Without the plan, every configured accelerator was offered and a Qwen2.5-32B landed on an L4,
which its worker refused, launch after launch.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import pytest

from skytrain_backend.provision import skypilot
from skytrain_backend.storage import keys, open_object_store
from tests.fixtures.hub import LoopbackHub
from tests.fixtures.services import MakeSettings, create_key, running_control_plane
from tests.provision.fake_sky import FakeSky

QWEN_7B = "Qwen/Qwen2.5-7B-Instruct"
QWEN_32B = "Qwen/Qwen2.5-32B-Instruct"
LLAMA_8B = "meta-llama/Llama-3.1-8B-Instruct"
QWEN3_MOE = "Qwen/Qwen3-30B-A3B"


@dataclass
class Plane:
    http: httpx.Client
    fake: FakeSky
    settings: Any


@pytest.fixture
def start_control_plane(
    make_settings: MakeSettings, tmp_path: Path
) -> Iterator[Callable[..., Plane]]:
    """Starts the real app (its scheduler running) on a fresh home with an empty model cache
    and ``accelerators``, reading the Hub at ``hub``; more keywords are scheduler settings."""
    with ExitStack() as stack:

        def start(
            *,
            accelerators: str,
            hub: str,
            hub_timeout_s: float = 30.0,
            hf_token: str | None = None,
            **scheduler: object,
        ) -> Plane:
            settings = make_settings(
                storage={"home": tmp_path, "model_cache_dir": tmp_path / "empty-model-cache"},
                scheduler={
                    "provider": "skypilot",
                    "worker_launch_backoff_s": 0,
                    "worker_launch_max_failures": 1000,
                    **scheduler,
                },
                skypilot={"accelerators": accelerators, "status_interval_s": 0},
                hub={"endpoint": hub, "timeout_s": hub_timeout_s, "token": hf_token},
                server={"public_url": "https://skytrain.example.com"},
            )
            headers = {"Authorization": f"Bearer {create_key(settings, 'acme')}"}
            fake = FakeSky()
            patch = stack.enter_context(pytest.MonkeyPatch.context())
            patch.setattr(skypilot, "_SkyPilotSdk", lambda: fake)  # FAKE CLOUD: SkyPilot's SDK
            # Undone last to first: the server stops, then the launches held back go on.
            stack.callback(fake.settle)
            stack.callback(fake.launch_gate.set)
            plane = stack.enter_context(running_control_plane(settings))
            http = stack.enter_context(
                httpx.Client(base_url=plane.url, headers=headers, timeout=60.0)
            )
            return Plane(http, fake, plane.settings)

        yield start


def _create(
    plane: Plane, name: str, base_model: str, *, lora_rank: int | None = None
) -> httpx.Response:
    body: dict[str, Any] = {"project": "hub", "name": name, "base_model": base_model}
    if lora_rank is not None:
        body["config"] = {"lora_rank": lora_rank}
    return plane.http.post("/v1/models", json=body)


def _wait_for(what: Callable[[], Any], *, timeout_s: float = 60.0) -> Any:
    """What ``what`` returns once it is truthy: the scheduler acts in its own thread."""
    deadline = time.monotonic() + timeout_s
    while not (found := what()):
        assert time.monotonic() < deadline, "the scheduler did not get there"
        time.sleep(0.1)
    return found


def _serving(plane: Plane, model_id: str) -> dict[str, Any]:
    response = plane.http.get(f"/v1/models/{model_id}")
    assert response.status_code == 200, response.text
    serving: dict[str, Any] = response.json()["serving"]
    return serving


def _failed(plane: Plane, model_id: str, words: str) -> dict[str, Any]:
    def failed_with_words() -> dict[str, Any] | None:
        serving = _serving(plane, model_id)
        return serving if serving["state"] == "failed" and words in serving["message"] else None

    found: dict[str, Any] = _wait_for(failed_with_words)
    return found


def test_a_32b_model_launches_on_the_gpu_it_fits_at_once(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(accelerators="L4:1, A100-80GB:1", hub=loopback_hub.url)
    response = _create(plane, "big", QWEN_32B)
    assert response.status_code == 201, response.text
    (launch,) = _wait_for(lambda: list(plane.fake.launches))
    (resources,) = launch.task.resources
    assert resources.accelerators == {"A100-80GB": 1}
    assert int(resources.memory.rstrip("+")) > 32  # the plan's host memory, not the task's
    assert ("GET", f"/{QWEN_32B}/resolve/main/config.json") in loopback_hub.requests
    # Kept in the object store, for every control plane sharing it.
    store = open_object_store(plane.settings.storage.resolved_object_store_url, plane.settings)
    key = keys.hub_config_key(endpoint=loopback_hub.url, base_model=QWEN_32B)
    assert b'"hidden_size": 5120' in store.get_bytes(key)


def test_a_32b_model_is_refused_before_any_launch_when_only_l4s_are_configured(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(accelerators="L4:1", hub=loopback_hub.url)
    response = _create(plane, "big", QWEN_32B)
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert f"L4:1: {QWEN_32B} does not fit 1 x L4 for serving" in message
    assert "weights 61.03 GiB" in message
    assert plane.http.get("/v1/models", params={"project": "hub"}).json()["data"] == []
    assert plane.fake.launches == []


def test_a_model_created_while_the_hub_is_down_is_planned_once_it_answers(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    loopback_hub.online = False
    # huggingface_hub retries a 503 for about 20 s: the control plane waits 1 s of that.
    plane = start_control_plane(accelerators="L4:1", hub=loopback_hub.url, hub_timeout_s=1)
    response = _create(plane, "big", QWEN_32B)
    assert response.status_code == 201, response.text  # it cannot be planned yet
    model_id = response.json()["id"]
    down = _failed(plane, model_id, "Hugging Face Hub")
    assert f"base model {QWEN_32B}" in down["message"]
    assert loopback_hub.url.split("//")[1] not in down["message"]
    loopback_hub.online = True
    # The next launch plans first: the plan's reason, and still nothing launched.
    refused = _failed(plane, model_id, "does not fit 1 x L4")
    assert "weights 61.03 GiB" in refused["message"]
    assert plane.fake.launches == []


def test_a_gated_base_model_without_a_token_says_so_and_launches_nothing(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(accelerators="L4:1, A100-80GB:1", hub=loopback_hub.url)
    response = _create(plane, "gated", LLAMA_8B)
    assert response.status_code == 201, response.text
    serving = _failed(plane, response.json()["id"], "is gated")
    assert f"base model {LLAMA_8B} is gated" in serving["message"]
    assert "HF_TOKEN" in serving["message"]
    assert plane.fake.launches == []


def test_a_gated_base_model_is_planned_with_the_operators_token(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(
        accelerators="A100-80GB:1", hub=loopback_hub.url, hf_token="hf_llama_token"
    )
    response = _create(plane, "gated", LLAMA_8B)
    assert response.status_code == 201, response.text
    (launch,) = _wait_for(lambda: list(plane.fake.launches))
    assert [r.accelerators for r in launch.task.resources] == [{"A100-80GB": 1}]
    assert "SKYTRAIN_ENGINE_MAX_MODEL_LEN" in launch.task.envs  # planned, not left to it


def test_a_model_created_at_rank_8_is_planned_and_launched_at_rank_8(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    """At the workers' largest rank (64) a 7B's training rows on an L4 were 1,792 tokens."""
    plane = start_control_plane(accelerators="L4:1", hub=loopback_hub.url)
    response = _create(plane, "small-rank", QWEN_7B, lora_rank=8)
    assert response.status_code == 201, response.text
    (launch,) = _wait_for(lambda: list(plane.fake.launches))
    assert [r.accelerators for r in launch.task.resources] == [{"L4": 1}]
    assert launch.task.envs["SKYTRAIN_ENGINE_MAX_LORA_RANK"] == "8"  # vLLM's slots at rank 8
    assert int(launch.task.envs["SKYTRAIN_TRAINER_MAX_ROW_TOKENS"]) >= 4096


def test_a_base_model_is_refused_at_a_rank_it_does_not_fit_and_created_at_one_it_does(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(
        accelerators="L4:1", hub=loopback_hub.url, hf_token="hf_llama_token"
    )
    refused = _create(plane, "wide", LLAMA_8B, lora_rank=64)
    assert refused.status_code == 400, refused.text
    assert "L4:1: " in refused.json()["error"]["message"]
    created = _create(plane, "narrow", LLAMA_8B, lora_rank=8)
    assert created.status_code == 201, created.text
    (launch,) = _wait_for(lambda: list(plane.fake.launches))
    assert [r.accelerators for r in launch.task.resources] == [{"L4": 1}]
    assert launch.task.envs["SKYTRAIN_ENGINE_MAX_LORA_RANK"] == "8"


def test_a_model_of_a_higher_rank_gets_a_worker_launched_at_its_rank(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(accelerators="L4:1, A100-80GB:1", hub=loopback_hub.url)
    assert _create(plane, "rank8", QWEN_7B, lora_rank=8).status_code == 201
    _wait_for(lambda: list(plane.fake.launches))
    # The first worker loads rank 8 at most: the rank-32 model is not placed on it.
    wide = _create(plane, "rank32", QWEN_7B, lora_rank=32)
    assert wide.status_code == 201, wide.text
    first, second = _wait_for(lambda: len(plane.fake.launches) > 1 and plane.fake.launches)
    assert first.task.envs["SKYTRAIN_ENGINE_MAX_LORA_RANK"] == "8"
    assert second.task.envs["SKYTRAIN_ENGINE_MAX_LORA_RANK"] == "32"


def test_a_model_above_the_rank_its_workers_load_says_so_while_it_waits(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    plane = start_control_plane(accelerators="L4:1", hub=loopback_hub.url, max_workers=1)
    assert _create(plane, "rank8", QWEN_7B, lora_rank=8).status_code == 201
    _wait_for(lambda: list(plane.fake.launches))
    wide = _create(plane, "rank32", QWEN_7B, lora_rank=32)
    assert wide.status_code == 201, wide.text
    serving = _serving(plane, wide.json()["id"])
    assert serving["state"] == "waiting"
    assert "load LoRA ranks up to 8 and this model's lora_rank is 32" in serving["message"]
    assert len(plane.fake.launches) == 1  # max_workers: no second worker


@pytest.mark.parametrize("path", ["/v1/models", "/v1/preview/models"])
def test_a_mixture_of_experts_is_refused_before_any_launch_with_the_reason(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub, path: str
) -> None:
    """Qwen3-30B-A3B's weights fit a node of eight H100s: it is refused for being a mixture of
    experts (its LoRA has never been shown to load into vLLM), not for its size."""
    plane = start_control_plane(accelerators="L4:1, H100:8", hub=loopback_hub.url)
    response = plane.http.post(
        path, json={"project": "hub", "name": "moe", "base_model": QWEN3_MOE}
    )
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["message"].startswith(
        f"base model {QWEN3_MOE} is a mixture of experts (128 experts a layer)"
    )
    assert "Choose a dense base model" in error["message"]
    assert loopback_hub.url.split("//")[1] not in error["message"]
    assert plane.http.get("/v1/models", params={"project": "hub"}).json()["data"] == []
    assert plane.fake.launches == []


def test_a_mixture_of_experts_created_while_the_hub_is_down_is_never_launched(
    start_control_plane: Callable[..., Plane], loopback_hub: LoopbackHub
) -> None:
    """Created before its config.json could be read, it is refused by the plan as soon as the
    Hub answers: the model's status gives the reason, and nothing is launched."""
    loopback_hub.online = False
    plane = start_control_plane(accelerators="H100:8", hub=loopback_hub.url, hub_timeout_s=1)
    response = plane.http.post(
        "/v1/models", json={"project": "hub", "name": "moe", "base_model": QWEN3_MOE}
    )
    assert response.status_code == 201, response.text  # it cannot be read yet
    loopback_hub.online = True
    refused = _failed(plane, response.json()["id"], "is a mixture of experts")
    assert (
        f"base model {QWEN3_MOE} is a mixture of experts (128 experts a layer)"
        in (refused["message"])
    )
    assert plane.fake.launches == []

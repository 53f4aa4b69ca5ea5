"""Creating a model whose base model fits none of the GPUs workers may get is a 400 with the
memory plan's reasons, on /v1/models and ART's /v1/preview/models.

The control plane is the real app over HTTP with the ``skypilot`` provider; only SkyPilot's
SDK is the fake cloud (tests/provision/fake_sky.py), since no cloud is reachable. The model
cache holds real models' config.json (tests/planning/models).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from skytrain_backend.provision import skypilot
from tests.fixtures.services import MakeSettings, create_key, running_control_plane
from tests.provision.fake_sky import FakeSky

MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"


@pytest.fixture(scope="module")
def http(make_settings: MakeSettings) -> Iterator[httpx.Client]:
    settings = make_settings(
        # the test is about creation: no launch
        scheduler={"provider": "skypilot", "max_workers": 0},
        storage={"model_cache_dir": MODELS},
        skypilot={"accelerators": "L4:1, A10G:1"},
        server={"public_url": "https://skytrain.example.com"},
    )
    headers = {"Authorization": f"Bearer {create_key(settings, 'acme')}"}
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(skypilot, "_SkyPilotSdk", FakeSky)  # FAKE CLOUD: SkyPilot's SDK only
        with (
            running_control_plane(settings) as plane,
            httpx.Client(base_url=plane.url, headers=headers) as client,
        ):
            yield client


def _create(http: httpx.Client, path: str, name: str, base_model: str) -> httpx.Response:
    body: dict[str, Any] = {"project": "fits", "name": name, "base_model": base_model}
    return http.post(path, json=body)


@pytest.mark.parametrize("path", ["/v1/models", "/v1/preview/models"])
def test_a_base_model_that_fits_no_configured_gpu_is_refused_with_the_plans_reasons(
    http: httpx.Client, path: str
) -> None:
    name = f"too-big-{path.count('/')}"
    response = _create(http, path, name, "Qwen/Qwen2.5-32B-Instruct")
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error"
    message = error["message"]
    assert "fits none of the GPUs workers may get (L4:1, A10G:1)" in message
    assert "L4:1: Qwen/Qwen2.5-32B-Instruct does not fit 1 x L4 for serving" in message
    assert "A10G:1: Qwen/Qwen2.5-32B-Instruct does not fit 1 x A10G" in message
    assert str(MODELS) not in message  # no host path
    listed = http.get("/v1/models", params={"project": "fits"}).json()["data"]
    assert name not in [model["name"] for model in listed]


def test_a_base_model_that_fits_is_created(http: httpx.Client) -> None:
    assert _create(http, "/v1/models", "fits", "Qwen/Qwen2.5-7B-Instruct").status_code == 201


def test_a_base_model_the_hub_does_not_have_is_created_to_wait_for_its_config(
    http: httpx.Client,
) -> None:
    # The loopback Hub (make_settings' for a skypilot control plane) has no such model: the
    # plan cannot refuse it, so it is created; its status says why nothing is launched
    # (tests/api/test_model_plan_from_the_hub.py).
    response = _create(http, "/v1/models", "unknown", "example-org/unpublished-model")
    assert response.status_code == 201, response.text

"""Tinker obeys the tenant rules REST does, through the official ``tinker`` SDK: the base-model
allow-list, the model quota, the LoRA-rank limit, and the caps on waits and pending samples.

The control plane runs in this process (uvicorn on loopback, SQLite, provider ``none``): no
worker is needed to be refused, and none is started, so sampled futures stay pending for as
long as a test needs them to.
"""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

import tinker
from skytrain_backend.db import api_keys, tenants
from tests.fixtures.services import MakeSettings, ServedPlane, served_plane

HUB_MODEL = "tests-org/tiny-model"
PROMPT = {"chunks": [{"type": "encoded_text", "tokens": [1, 2, 3]}]}


@pytest.fixture(scope="module")
def plane(
    tmp_path_factory: pytest.TempPathFactory, make_settings: MakeSettings
) -> Iterator[ServedPlane]:
    home = tmp_path_factory.mktemp("tinker-rules")
    # Its own model cache, whatever SKYTRAIN_MODEL_CACHE_DIR says: the allowed directories.
    with served_plane(
        make_settings(storage={"home": home, "model_cache_dir": home / "models"})
    ) as plane:
        yield plane


@dataclass
class Tenant:
    name: str
    key: str
    service: tinker.ServiceClient
    http: httpx.Client


@pytest.fixture
def tenant(plane: ServedPlane) -> Iterator[Callable[..., Tenant]]:
    """``tenant(**limits)``: a new tenant with those limits, its ServiceClient and an HTTP
    client speaking the SDK's wire format."""
    made: list[Tenant] = []

    def make(**limits: int) -> Tenant:
        name = f"t-{uuid.uuid4().hex[:10]}"
        with plane.sessions() as session:
            _, key = api_keys.create_key(session, tenant_name=name)
            if limits:
                tenants.set_limits(session, tenant_name=name, values=limits, reset=[])
        sdk_key = "tml-" + key
        service = tinker.ServiceClient(base_url=plane.url, api_key=sdk_key)
        http = httpx.Client(base_url=plane.url, headers={"X-API-Key": sdk_key}, timeout=60)
        made.append(Tenant(name=name, key=key, service=service, http=http))
        return made[-1]

    yield make
    for who in made:
        who.service.close("success").result(timeout=60)
        who.http.close()


def _models(plane: ServedPlane, who: Tenant) -> list[str]:
    with httpx.Client(
        base_url=plane.url, headers={"Authorization": f"Bearer {who.key}"}, timeout=60
    ) as http:
        return [
            m["base_model"] for m in http.get("/v1/models", params={"limit": 100}).json()["data"]
        ]


def test_tinker_refuses_a_base_model_outside_the_allowed_directories(
    plane: ServedPlane, tenant: Callable[..., Tenant], tmp_path: Path
) -> None:
    who = tenant()
    private = tmp_path / "private-model"
    private.mkdir()
    for path in ("/etc", str(Path.home() / ".ssh"), str(private)):
        with pytest.raises(tinker.BadRequestError, match="does not load models from"):
            who.service.create_lora_training_client(base_model=path, rank=8).result(timeout=20)
        with pytest.raises(tinker.BadRequestError, match="does not load models from"):
            who.service.create_sampling_client(base_model=path).result(timeout=60)
    with pytest.raises(tinker.BadRequestError, match="not a Hugging Face model id"):
        who.service.create_sampling_client(base_model="../../etc").result(timeout=60)
    # Nothing was stored: the tenant owns no model and no run.
    assert _models(plane, who) == []
    assert who.http.get("/api/v1/training_runs").json()["training_runs"] == []


def test_tinker_models_count_against_the_tenants_model_quota(
    plane: ServedPlane, tenant: Callable[..., Tenant]
) -> None:
    who = tenant(max_models=2)
    who.service.create_sampling_client(base_model=HUB_MODEL).result(timeout=60)
    who.service.create_sampling_client(base_model=HUB_MODEL + "-b").result(timeout=60)
    # The same base model again is the model it has already, not a new one.
    who.service.create_sampling_client(base_model=HUB_MODEL).result(timeout=60)
    with pytest.raises(tinker.PermissionDeniedError, match=r"owns 2 models.*\(2\)"):
        who.service.create_sampling_client(base_model=HUB_MODEL + "-c").result(timeout=60)
    with pytest.raises(tinker.PermissionDeniedError, match=r"owns 2 models.*\(2\)"):
        who.service.create_lora_training_client(base_model=HUB_MODEL, rank=8).result(timeout=20)
    assert sorted(_models(plane, who)) == [HUB_MODEL, HUB_MODEL + "-b"]
    assert who.http.get("/api/v1/training_runs").json()["training_runs"] == []


def test_tinker_refuses_a_lora_rank_no_worker_loads(
    plane: ServedPlane, tenant: Callable[..., Tenant]
) -> None:
    who = tenant()
    limit = plane.settings.engine.max_lora_rank
    with pytest.raises(tinker.BadRequestError, match=f"lora_rank {limit * 2} is above {limit}"):
        who.service.create_lora_training_client(base_model=HUB_MODEL, rank=limit * 2).result(
            timeout=60
        )
    assert _models(plane, who) == []


def _sample(who: Tenant, sampler_id: str) -> httpx.Response:
    """An ``asample`` as the SDK sends it."""
    return who.http.post(
        "/api/v1/asample",
        json={
            "sampling_session_id": sampler_id,
            "prompt": PROMPT,
            "num_samples": 1,
            "sampling_params": {"max_tokens": 4},
        },
    )


def _sampler_id(client: tinker.SamplingClient) -> str:
    sampler_id: str = client._sampling_session_id
    return sampler_id


@pytest.mark.slow
def test_pending_samples_count_against_the_tenants_requests_in_flight(
    tenant: Callable[..., Tenant],
) -> None:
    """The tenant may have no model placed, so its samples stay pending: each holds one of
    its requests in flight until it is answered, and its future says why it waits."""
    who = tenant(max_concurrent_requests=2, max_placed_models=0)
    sampler = who.service.create_sampling_client(base_model=HUB_MODEL).result(timeout=60)
    held = [_sample(who, _sampler_id(sampler)) for _ in range(2)]
    assert [response.status_code for response in held] == [200, 200]
    refused = _sample(who, _sampler_id(sampler))
    assert refused.status_code == 429, refused.text
    assert "max_concurrent_requests" in refused.json()["error"]["message"]
    assert float(refused.headers["Retry-After"]) >= 1
    # Another tenant's samples are not counted against this one's limit.
    other = tenant(max_concurrent_requests=2)
    other_sampler = other.service.create_sampling_client(base_model=HUB_MODEL).result(timeout=60)
    assert _sample(other, _sampler_id(other_sampler)).status_code == 200

    waiting = who.http.post(
        "/api/v1/retrieve_future", json={"request_id": held[0].json()["request_id"]}
    ).json()
    assert waiting["type"] == "try_again"
    assert waiting["queue_state"] == "paused_rate_limit"
    assert "max_placed_models=0" in waiting["queue_state_reason"]


@pytest.mark.slow
def test_retrieve_future_waits_are_capped_per_tenant(tenant: Callable[..., Tenant]) -> None:
    """Past ``max_waiting_polls`` waits of a tenant, ``retrieve_future`` answers 429 at once
    (the SDK backs off and asks again); other tenants still wait."""
    who = tenant(max_waiting_polls=1)
    sampler = who.service.create_sampling_client(base_model=HUB_MODEL).result(timeout=60)
    future = _sample(who, _sampler_id(sampler)).json()["request_id"]

    def retrieve(_: int) -> httpx.Response:
        return who.http.post("/api/v1/retrieve_future", json={"request_id": future})

    with ThreadPoolExecutor(2) as pool:
        answers = list(pool.map(retrieve, range(2)))
    statuses = sorted(response.status_code for response in answers)
    assert statuses == [200, 429], [response.text for response in answers]
    refused = next(response for response in answers if response.status_code == 429)
    assert "max_waiting_polls" in refused.json()["error"]["message"]
    waited = next(response for response in answers if response.status_code == 200)
    assert waited.json()["type"] == "try_again"

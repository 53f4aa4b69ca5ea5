"""A Tinker training run on a base model whose training the memory plan shards is refused up
front, with the reason and what to do instead; REST jobs and Tinker sampling on it are not.

Tinker runs train in one process on one device; a worker whose plan shards the trainer
(Qwen2.5-32B on ``A100-80GB:2``: 2 shards) trains REST jobs under torchrun. The control
plane is the real app over HTTP with the ``skypilot`` provider and the official ``tinker``
SDK as the client; only SkyPilot's SDK is the fake cloud (tests/provision/fake_sky.py), since
no cloud is reachable. The model cache holds real models' config.json (tests/planning/models).
The worker's own refusal (when the control plane cannot plan) is in
tests/e2e/test_sharded_worker.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

import tinker
from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.provision import skypilot
from tests.fixtures.services import MakeSettings
from tests.fixtures.tinker_http import ask_for_run
from tests.gateway.conftest import serve_in_thread
from tests.provision.fake_sky import FakeSky

MODELS = Path(__file__).resolve().parents[1] / "planning" / "models"
SHARDED = "Qwen/Qwen2.5-32B-Instruct"  # 2 trainer shards on A100-80GB:2
ONE_GPU = "Qwen/Qwen2.5-7B-Instruct"  # 1 on the same GPUs


@dataclass(frozen=True)
class Client:
    service: tinker.ServiceClient
    http: httpx.Client  # skytrain's REST API, same tenant
    sdk: httpx.Client  # the Tinker wire as the SDK speaks it, same tenant
    sessions: sessionmaker[Session]


@pytest.fixture(scope="module")
def client(make_settings: MakeSettings) -> Iterator[Client]:
    settings = make_settings(
        # the test is about creation: no launch
        scheduler={"provider": "skypilot", "max_workers": 0},
        storage={"model_cache_dir": MODELS},
        skypilot={"accelerators": "A100-80GB:2"},
        server={"public_url": "https://skytrain.example.com"},
    )
    engine = create_db_engine(settings.storage.resolved_database_url)
    sessions = session_factory(engine)
    with sessions() as session:
        _, key = api_keys.create_key(session, tenant_name="acme")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(skypilot, "_SkyPilotSdk", FakeSky)  # FAKE CLOUD: SkyPilot's SDK only
        with serve_in_thread(create_app(settings)) as url:
            service = tinker.ServiceClient(base_url=url, api_key="tml-" + key)
            headers = {"Authorization": f"Bearer {key}"}
            http = httpx.Client(base_url=url, headers=headers, timeout=60)
            sdk = httpx.Client(base_url=url, headers={"X-API-Key": "tml-" + key}, timeout=60)
            with http, sdk:
                yield Client(service=service, http=http, sdk=sdk, sessions=sessions)
            service.close("success").result(timeout=60)
    engine.dispose()


def test_tinker_training_on_a_sharded_base_model_is_refused_naming_the_shards(
    client: Client,
) -> None:
    with pytest.raises(tinker.BadRequestError) as refused:
        client.service.create_lora_training_client(base_model=SHARDED, rank=8).result(timeout=60)
    message = str(refused.value)
    assert "sharded over 2 GPUs (A100-80GB:2)" in message, message
    assert "training jobs" in message, message
    # Nothing stored: no run, no model.
    assert client.sdk.get("/api/v1/training_runs").json()["training_runs"] == []
    assert client.http.get("/v1/models").json()["data"] == []


def test_rest_jobs_and_tinker_sampling_on_it_are_accepted(client: Client) -> None:
    created = client.http.post(
        "/v1/models", json={"project": "big", "name": "agent", "base_model": SHARDED}
    )
    assert created.status_code == 201, created.text
    client.service.create_sampling_client(base_model=SHARDED).result(timeout=60)
    bases = sorted(m["base_model"] for m in client.http.get("/v1/models").json()["data"])
    assert bases == [SHARDED, SHARDED]


def test_a_base_model_one_gpu_trains_is_not_refused(client: Client) -> None:
    """The rule is the plan's shard count, not the GPU: the same two GPUs train a 7B in one
    process, so its Tinker run is accepted (and waits for a worker: none is launched here)."""
    accepted = _create_model(client, ONE_GPU)
    assert accepted.status_code == 200, accepted.text
    assert "request_id" in accepted.json()


def _create_model(client: Client, base_model: str) -> httpx.Response:
    return ask_for_run(client.sdk, base_model)[1]


def test_a_base_model_a_registered_worker_serves_is_left_to_that_worker(client: Client) -> None:
    """A worker joined by hand plans for its own GPUs, which may train the model in one
    process: the control plane's plan for the provider's GPUs does not decide then."""
    joined = "Qwen/Qwen2.5-72B-Instruct"  # sharded (or too big) on the provider's GPUs
    assert _create_model(client, joined).status_code == 400
    with client.sessions() as session:
        worker_rows.create_worker(
            session, provider="manual", base_model=joined, max_models=8, status="ready"
        )
        session.commit()
    accepted = _create_model(client, joined)
    assert accepted.status_code == 200, accepted.text

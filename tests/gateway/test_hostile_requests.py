"""One tenant's bad request fails alone: the gateway refuses it (400 naming the field), the
worker's engine refuses it too if it gets there, and another tenant is served right after."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from skytrain_backend.config import Settings
from tests.gateway.conftest import Engine, Tenant


@pytest.mark.slow
def test_a_seed_past_64_bits_is_refused_and_the_worker_serves_the_next_tenant(
    tenant: Callable[[], Tenant], engine: Engine, engine_worker: str
) -> None:
    alice, bob = tenant(), tenant()
    alices = alice.create_model(worker_id=engine_worker)["inference_name"]
    bobs = bob.create_model(worker_id=engine_worker)["inference_name"]

    refused = alice.chat(alices, seed=2**64)
    assert refused.status_code == 400, refused.text
    assert refused.json()["error"]["message"].startswith("seed: Input should be less than")
    # Sent to the engine itself (past any gateway): refused there as well, not a dead thread.
    direct = engine.post(
        "/v1/chat/completions",
        {
            "model": engine.served_name,
            "messages": [{"role": "user", "content": "Hi"}],
            "seed": 2**64,
        },
    )
    assert direct.status_code == 400, direct.text

    served = bob.chat(bobs, seed=2**63 - 1)
    assert served.status_code == 200, served.text
    assert served.json()["choices"][0]["message"]["content"] is not None


@pytest.mark.slow
def test_a_request_without_max_tokens_gets_the_default_not_the_whole_context(
    tenant: Callable[[], Tenant], engine_worker: str, gateway_settings: Settings
) -> None:
    """`n=128` without `max_tokens` ran over 600 s: the engine generated until the context
    (4,096 tokens for the test model) was full, for every sequence."""
    alice = tenant()
    model = alice.create_model(worker_id=engine_worker)["inference_name"]
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "ignore_eos": True}

    response = alice.http.post("/v1/chat/completions", json=body)

    assert response.status_code == 200, response.text
    default = gateway_settings.gateway.default_max_tokens
    assert response.json()["usage"]["completion_tokens"] == default

"""Requests in flight are counted per tenant in sequences and tokens too, not only requests:
one request with a large ``n`` or a huge prompt takes its share of the tenant's allowance,
and one that could never fit is refused at once, before any engine sees it."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import tenants
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import LONG_STREAM, Tenant, wait_until

# What is counted and scheduled does not depend on the database: SQLite only.
pytestmark = pytest.mark.parametrize("gateway_settings", ["sqlite"], indirect=True)


def _limit(sessions: sessionmaker[Session], who: Tenant, **values: int) -> None:
    with sessions() as session:
        tenants.set_limits(session, tenant_name=who.name, values=values, reset=[])


def test_sequences_in_flight_are_counted_per_tenant_and_refused_with_retry_after(
    tenant: Callable[[], Tenant], engine_worker: str, gateway_plane: ServedPlane
) -> None:
    alice, bob = tenant(), tenant()
    _limit(gateway_plane.sessions, alice, max_sequences_in_flight=3)
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    bobs = bob.create_model(worker_id=engine_worker)["inference_name"]

    too_many = alice.chat(name, n=4)
    assert too_many.status_code == 400
    assert "asks for 4 sequences" in too_many.json()["error"]["message"]
    assert "max_sequences_in_flight" in too_many.json()["error"]["message"]

    with ExitStack() as streams:
        response = streams.enter_context(
            alice.http.stream(
                "POST", "/v1/chat/completions", json={**LONG_STREAM, "model": name, "n": 2}
            )
        )
        assert response.status_code == 200
        lines = response.iter_lines()
        assert next(lines).startswith("data: ")
        assert alice.chat(name, n=1).status_code == 200  # 2 + 1 fit in 3
        refused = alice.chat(name, n=2)  # 2 + 2 do not
        assert refused.status_code == 429
        assert "2 sequences of yours are being generated" in refused.json()["error"]["message"]
        assert int(refused.headers["Retry-After"]) >= 1
        assert bob.chat(bobs, n=4).status_code == 200  # another tenant's own allowance
    # The stream ended: its share is back once the server has seen the client go (a cached
    # route can admit the next request before that).
    wait_until(
        lambda: alice.chat(name, n=3).status_code == 200,
        what="a request admitted once the stream holding 2 of 3 sequences was closed",
    )


def test_a_huge_prompt_is_refused_by_the_gateway_and_the_engine_keeps_serving(
    tenant: Callable[[], Tenant], engine_worker: str, gateway_plane: ServedPlane
) -> None:
    alice, bob = tenant(), tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    bobs = bob.create_model(worker_id=engine_worker)["inference_name"]
    prompt = "lorem ipsum " * 1_750_000  # 21 MB: far beyond the context and every limit

    huge = alice.http.post(
        "/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": prompt}], "max_tokens": 1},
    )
    # Over the inference body limit: refused before the body is read to its end.
    assert huge.status_code == 413
    assert "SKYTRAIN_MAX_INFERENCE_REQUEST_BYTES" in huge.json()["error"]["message"]
    assert bob.chat(bobs).status_code == 200

    # Within the body limit but over the tenant's whole token budget: it could never fit.
    _limit(gateway_plane.sessions, alice, max_tokens_in_flight=30_000)
    too_long = alice.http.post(
        "/v1/chat/completions",
        json={"model": name, "messages": [{"role": "user", "content": "word " * 8_000}]},
    )
    assert too_long.status_code == 400
    message = too_long.json()["error"]["message"]
    assert "max_tokens_in_flight" in message and "send a shorter prompt" in message
    assert bob.chat(bobs).status_code == 200

    # A stream of 8 x 3500 tokens with top logprobs: far more than socket buffers hold while
    # its caller does not read, so it stays in flight.
    with ExitStack() as streams:
        response = streams.enter_context(
            alice.http.stream(
                "POST",
                "/v1/chat/completions",
                json={**LONG_STREAM, "model": name, "n": 8, "max_tokens": 3500},
            )
        )
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping it would close the stream
        assert next(lines).startswith("data: ")
        refused = alice.chat(name, max_tokens=2000)  # 28000 + bodies + 2000 > 30000
        assert refused.status_code == 429
        assert "over the 30000 allowed at once" in refused.json()["error"]["message"]
        assert alice.chat(name, max_tokens=100).status_code == 200

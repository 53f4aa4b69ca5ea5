"""Each tenant may have ``tenant_max_concurrent_requests`` inference requests in flight; streams
count until they end. Over the limit: 429 naming the setting; other tenants are unaffected."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack

import openai
import pytest

from tests.gateway.conftest import TENANT_LIMIT, Tenant, open_stream, wait_until


def test_requests_over_the_tenant_limit_get_429_until_a_stream_ends(
    tenant: Callable[[], Tenant], engine_worker: str
) -> None:
    alice, bob = tenant(), tenant()
    name = alice.create_model(worker_id=engine_worker)["inference_name"]
    bobs = bob.create_model(worker_id=engine_worker)["inference_name"]

    with ExitStack() as streams:
        opened = [open_stream(streams, alice, name) for _ in range(TENANT_LIMIT)]

        refused = alice.chat(name)
        assert refused.status_code == 429
        error = refused.json()["error"]
        assert error["type"] == "rate_limit_error"
        assert f"{TENANT_LIMIT} inference requests of yours are in flight" in error["message"]
        assert "SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS" in error["message"]
        assert refused.headers["Retry-After"] == "1"
        with pytest.raises(openai.RateLimitError):
            alice.openai.completions.create(model=name, prompt="Hi", max_tokens=1)
        assert bob.chat(bobs).status_code == 200  # the limit is per tenant
        assert all(next(stream.lines) is not None for stream in opened)  # still running

        opened[0].response.close()
        wait_until(
            lambda: alice.chat(name).status_code == 200,
            what="a request admitted once one of the streams was closed",
        )
        # The closed stream and the finished request gave their slots back, and no more.
        opened.append(open_stream(streams, alice, name))
        assert alice.chat(name).status_code == 429

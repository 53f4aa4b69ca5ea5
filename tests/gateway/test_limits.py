"""Each tenant may have ``tenant_max_concurrent_requests`` inference requests in flight; streams
count until they end. Over the limit: 429 naming the setting; other tenants are unaffected.
On PostgreSQL the count spans every control-plane process on the database."""

from __future__ import annotations

from collections.abc import Callable
from contextlib import ExitStack
from pathlib import Path

import openai
import pytest

from skytrain_backend.db.models import Model
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.service import start_service, stop_service
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import (
    ENGINE_BASE_MODEL,
    LONG_STREAM,
    TENANT_LIMIT,
    Engine,
    Tenant,
    add_engine_worker,
    open_stream,
    wait_until,
)


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
        # The closed stream and the finished request give their slots back, and no more.
        opened.append(open_stream(streams, alice, name, wait_for_a_slot=True))
        assert alice.chat(name).status_code == 429


@pytest.mark.postgres
@pytest.mark.slow
def test_a_tenant_at_its_limit_through_one_control_plane_is_refused_through_another(
    make_settings: MakeSettings, engine: Engine, tmp_path: Path
) -> None:
    """Two `skytrain serve` processes on one PostgreSQL count a tenant's requests together."""
    database_url = make_settings(database="postgres").storage.resolved_database_url
    env = {
        "SKYTRAIN_DATABASE_URL": database_url,
        "SKYTRAIN_PROVIDER": "none",
        "SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS": "2",
    }
    first = start_service(env, tmp_path / "first")
    second = start_service(env, tmp_path / "second")
    database = create_db_engine(database_url)
    try:
        worker_id = add_engine_worker(session_factory(database), engine)
        with first.http("alice") as through_first, second.http("alice") as through_second:
            created = through_first.post(
                "/v1/models",
                json={"project": "gw", "name": "shared", "base_model": ENGINE_BASE_MODEL},
            )
            assert created.status_code == 201, created.text
            with session_factory(database)() as session:
                session.get_one(Model, created.json()["id"]).worker_id = worker_id
                session.commit()
            body = {**LONG_STREAM, "model": created.json()["inference_name"]}
            short = {"model": body["model"], "messages": body["messages"], "max_tokens": 2}
            with ExitStack() as streams:
                opened = []
                for _ in range(2):
                    response = streams.enter_context(
                        through_first.stream("POST", "/v1/chat/completions", json=body)
                    )
                    assert response.status_code == 200
                    lines = response.iter_lines()
                    assert next(lines).startswith("data: ")
                    opened.append((response, lines))

                refused = through_second.post("/v1/chat/completions", json=short)
                assert refused.status_code == 429, refused.text
                assert (
                    "2 inference requests of yours are in flight"
                    in refused.json()["error"]["message"]
                )

                opened[0][0].close()
                wait_until(
                    lambda: (
                        through_second.post("/v1/chat/completions", json=short).status_code == 200
                    ),
                    what="a request admitted through the second control plane once a stream "
                    "through the first ended",
                )
    finally:
        database.dispose()
        stop_service(first)
        stop_service(second)

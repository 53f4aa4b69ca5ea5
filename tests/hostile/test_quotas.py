"""Quotas that cannot be raced, and bounds on what a tenant stores (issue 38, items 3 and 4).

Through the clients a tenant uses: REST over httpx, and the official ``tinker`` SDK's own
request methods (``AsyncTinker``, the client ``ServiceClient`` sends through: each call is one request, so 64 of them really are in flight
at once, and a refused one raises at once rather than waiting for a worker). The control
plane runs in this process (uvicorn on loopback, provider ``none``: no worker, so queued
operations stay queued), on SQLite and on PostgreSQL, since counting under a lock is what is
tested.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Awaitable, Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy import func, select
from sqlalchemy.orm import Session, sessionmaker
from tinker._client import AsyncTinker

import tinker
from skytrain_backend.app import create_app
from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys, tenants
from skytrain_backend.db.models import Model
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread
from tinker import types

HUB_MODEL = "tests-org/tiny-model"
CONCURRENT = 64


@dataclass(frozen=True)
class Plane:
    url: str
    settings: Settings
    sessions: sessionmaker[Session]


@pytest.fixture(
    scope="module", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def plane(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    make_settings: MakeSettings,
) -> Iterator[Plane]:
    home = tmp_path_factory.mktemp(f"quotas-{request.param}")
    settings = make_settings(database=request.param, home=home, model_cache_dir=home / "models")
    engine = create_db_engine(settings.resolved_database_url)
    with serve_in_thread(create_app(settings)) as url:
        yield Plane(url=url, settings=settings, sessions=session_factory(engine))
    engine.dispose()


@dataclass(frozen=True)
class Who:
    name: str
    key: str
    plane: Plane

    def rest(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.plane.url, headers={"Authorization": f"Bearer {self.key}"}, timeout=120
        )

    def tinker(self, *, max_retries: int = 2) -> AsyncTinker:
        return AsyncTinker(
            base_url=self.plane.url, api_key="tml-" + self.key, max_retries=max_retries
        )

    def models(self) -> int:
        with self.plane.sessions() as session:
            tenant = tenants.get_tenant_by_name(session, name=self.name)
            return int(
                session.scalar(select(func.count(Model.id)).where(Model.tenant_id == tenant.id))
                or 0
            )


@pytest.fixture
def tenant(plane: Plane) -> Callable[..., Who]:
    """``tenant(**limits)``: a new tenant with those limits (no REST admission in the way of
    the concurrent requests)."""

    def make(**limits: int) -> Who:
        name = f"q-{uuid.uuid4().hex[:10]}"
        with plane.sessions() as session:
            _, key = api_keys.create_key(session, tenant_name=name)
            values = {"max_concurrent_rest_requests": 4 * CONCURRENT, **limits}
            tenants.set_limits(session, tenant_name=name, values=values, reset=[])
        return Who(name=name, key=key, plane=plane)

    return make


async def _session(client: AsyncTinker, **fields: Any) -> str:
    request = types.CreateSessionRequest(
        tags=[], user_metadata=fields.pop("user_metadata", None), sdk_version="test", **fields
    )
    return (await client.service.create_session(request=request)).session_id


def _assert_refused_by_max_models(outcomes: list[Any]) -> None:
    for outcome in outcomes:
        assert isinstance(outcome, tinker.PermissionDeniedError), outcome
        assert "(2)" in str(outcome) and "--max-models" in str(outcome)


# --- quotas enforced atomically -----------------------------------------------------------------


def test_concurrent_rest_creates_make_exactly_max_models(tenant: Callable[..., Who]) -> None:
    who = tenant(max_models=2)
    with who.rest() as http, ThreadPoolExecutor(CONCURRENT) as pool:
        answers = list(
            pool.map(
                lambda i: http.post(
                    "/v1/models", json={"project": "race", "name": f"m{i}", "base_model": HUB_MODEL}
                ),
                range(CONCURRENT),
            )
        )
    created = [a for a in answers if a.status_code == 201]
    refused = [a for a in answers if a.status_code != 201]
    assert len(created) == 2
    for answer in refused:
        assert answer.status_code == 403, answer.text
        assert answer.json()["error"]["type"] == "quota_exceeded"
        assert "(2)" in answer.json()["error"]["message"]
    assert who.models() == 2


def test_concurrent_tinker_create_model_makes_exactly_max_models(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_models=2)

    async def race() -> list[Any]:
        async with who.tinker() as client:
            session_id = await _session(client)

            def create(i: int) -> Callable[[], Awaitable[Any]]:
                request = types.CreateModelRequest(
                    session_id=session_id,
                    model_seq_id=i,
                    base_model=HUB_MODEL,
                    lora_config=types.LoraConfig(rank=8),
                )
                return lambda: client.models.create(request=request)

            return await asyncio.gather(
                *(create(i)() for i in range(CONCURRENT)), return_exceptions=True
            )

    outcomes = asyncio.run(race())
    created = [o for o in outcomes if isinstance(o, types.UntypedAPIFuture)]
    assert len(created) == 2
    _assert_refused_by_max_models([o for o in outcomes if o not in created])
    assert who.models() == 2


def test_concurrent_tinker_sampling_sessions_make_exactly_max_models(
    tenant: Callable[..., Who],
) -> None:
    who = tenant(max_models=2)

    async def race() -> list[Any]:
        async with who.tinker() as client:
            session_id = await _session(client)
            return await asyncio.gather(
                *(
                    client.service.create_sampling_session(
                        request=types.CreateSamplingSessionRequest(
                            session_id=session_id,
                            sampling_session_seq_id=i,
                            base_model=f"{HUB_MODEL}-{i}",
                        )
                    )
                    for i in range(CONCURRENT)
                ),
                return_exceptions=True,
            )

    outcomes = asyncio.run(race())
    created = [o for o in outcomes if isinstance(o, types.CreateSamplingSessionResponse)]
    assert len(created) == 2
    _assert_refused_by_max_models([o for o in outcomes if o not in created])
    assert who.models() == 2

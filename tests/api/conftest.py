"""Callers of the real control plane: each a new tenant with its own key and HTTP client."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

from tests.api import support
from tests.fixtures.services import ApiKey, ControlPlane


@dataclass
class Caller:
    key: ApiKey
    http: httpx.Client

    def create_model(self, name: str = "agent", **extra: Any) -> dict[str, Any]:
        response = self.http.post(
            "/v1/models",
            json={"project": "tests", "name": name, "base_model": "tiny/llama", **extra},
        )
        assert response.status_code == 201, response.text
        return dict(response.json())


@pytest.fixture
def caller(control_plane: ControlPlane, api_key: Callable[..., ApiKey]) -> Iterator[Caller]:
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as http:
        yield Caller(key=key, http=http)


@pytest.fixture
def other(control_plane: ControlPlane, api_key: Callable[..., ApiKey]) -> Iterator[Caller]:
    """A second tenant, to check that tenants never see each other's rows."""
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as http:
        yield Caller(key=key, http=http)


@pytest.fixture
def stored(db_sessions: Any, object_store: Any) -> Callable[[Caller], Any]:
    """``stored(caller)``: the caller's rows and objects, to compare before and after."""
    return lambda who: support.snapshot(db_sessions, object_store, who.key.tenant_id)

"""Fixtures of the SDK tests: the real control plane (``tests/fixtures/services.py``) reached
through a fault-injecting proxy (``faults.py``), a key of a fresh tenant, and a Backend."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable, Iterator

import pytest
import pytest_asyncio

import skytrain
from skytrain import _backend, _model
from tests.client.faults import FaultProxy
from tests.fixtures.services import ApiKey, ControlPlane


@pytest.fixture(autouse=True)
def no_retry_wait(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Retries happen at once: the tests count them, they do not time them."""
    monkeypatch.setattr(_backend, "_RETRY_BASE_DELAY_S", 0.0)
    monkeypatch.setattr(_backend, "_RETRY_MAX_DELAY_S", 0.0)
    yield


@pytest.fixture(autouse=True)
def short_event_waits(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """Follow events with short long-polls: these tests write a job's events straight into the
    database from this process (``server_side``), which wakes no long-poll in the control
    plane's process, so each wait would run out in full. Waking is tested with real workers
    (tests/lifecycle/test_lease_wakeups.py) and by the SDK in the demo (tests/demo)."""
    monkeypatch.setattr(_model, "_FOLLOW_WAIT_S", 0.5)
    yield


@pytest.fixture
def proxy(control_plane: ControlPlane) -> Iterator[FaultProxy]:
    """A fault proxy in front of the session's real control plane; forwards all unless armed."""
    with FaultProxy(control_plane.url) as proxy:
        yield proxy


@pytest.fixture
def key(api_key: Callable[..., ApiKey]) -> ApiKey:
    """A key of a fresh tenant, so each test sees only its own models."""
    return api_key()


@pytest_asyncio.fixture(loop_scope="function")  # the test's loop owns the connections
async def backend(proxy: FaultProxy, key: ApiKey) -> AsyncIterator[skytrain.Backend]:
    async with skytrain.Backend(proxy.url, key.key, timeout=30.0) as backend:
        yield backend

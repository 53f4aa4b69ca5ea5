"""Fixtures for the Tinker protocol suites: ``skytrain serve`` as a real process (local provider,
CPU engine and trainer), shared by the tests of a module, and the official ``tinker`` SDK
pointed at it.

``tinker_service`` is the embedded setup (SQLite + local directory), shared by the suites
(``test_worker_loss`` kills workers, so it has its own); ``tinker_client(tenant)``
makes a ``ServiceClient`` with that tenant's key in the SDK's form (``tml-`` + the skytrain
key), closed at the end of the test so its runs free the worker.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

import tinker
from tests.fixtures.service import Service, start_service, stop_service


def run_service(
    request: pytest.FixtureRequest, home: Path, overrides: dict[str, str] | None = None
) -> Iterator[Service]:
    service = start_service(
        {
            "SKYTRAIN_WORKER_TINKER_MAX_RUNS": "3",
            # The suites share this service with two base models: the tiny model's runs may
            # fill two workers, and an idle worker keeps its place for 30 minutes.
            "SKYTRAIN_MAX_WORKERS": "3",
            "SKYTRAIN_TINKER_SESSION_TIMEOUT_S": "120",
            **(overrides or {}),
        },
        home,
    )
    yield service
    stop_service(service)
    if request.session.testsfailed:
        print(f"--- serve.log\n{service.log()[-6000:]}\n{service.worker_logs()}")


@pytest.fixture(scope="session")
def tinker_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """One service for the Tinker suites (a module that must have its own overrides this)."""
    yield from run_service(request, tmp_path_factory.mktemp("tinker-home"))


def tinker_key(service: Service, tenant: str) -> str:
    return "tml-" + service.key(tenant)


@pytest.fixture
def tinker_client(tinker_service: Service) -> Iterator[Callable[..., tinker.ServiceClient]]:
    clients: list[tinker.ServiceClient] = []

    def make(tenant: str = "alice") -> tinker.ServiceClient:
        client = tinker.ServiceClient(
            base_url=tinker_service.url, api_key=tinker_key(tinker_service, tenant)
        )
        clients.append(client)
        return client

    yield make
    for client in clients:
        client.close("success").result(timeout=60)


@pytest.fixture(scope="session")
def base_model(tiny_model_path: Path) -> str:
    return str(tiny_model_path)

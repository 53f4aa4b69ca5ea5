"""Fixtures for the end-to-end suites: ``skytrain serve`` as a real process with the local
provider (see ``tests/fixtures/service.py``).

``embedded_service`` is the embedded setup (SQLite + local directory), one per test;
``module_service`` the same, one per module. Storage is not what these scenarios test: the RL
loop on the production setup (PostgreSQL + S3 through a SeaweedFS server), a checkpoint
committed to S3 and then served, runs in ``test_replicas.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.service import Service, start_service, stop_service


@pytest.fixture
def embedded_service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """``skytrain serve`` on a free port with the local provider, on SQLite and a local
    directory."""
    service = start_service({}, tmp_path / "home")
    yield service
    stop_service(service)
    _show_logs_if_failed(request, service)


@pytest.fixture(scope="module")
def _module_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    service = start_service({}, tmp_path_factory.mktemp("service") / "home")
    yield service
    stop_service(service)


@pytest.fixture
def module_service(request: pytest.FixtureRequest, _module_service: Service) -> Iterator[Service]:
    """``embedded_service`` shared by the tests of a module that ask for it, for scenarios that
    each register models of their own and only stop workers, which the control plane replaces
    as it would for any user: starting a control plane and its first worker is most of such a
    test's time."""
    yield _module_service
    _show_logs_if_failed(request, _module_service)


def _show_logs_if_failed(request: pytest.FixtureRequest, service: Service) -> None:
    """In a fixture's teardown: the service's logs when the test failed."""
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        show_logs(service)


def show_logs(service: Service) -> None:
    """The end of the control plane's log and its workers' (in the failed test's output)."""
    print(f"--- serve.log\n{service.log()[-6000:]}\n{service.worker_logs()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]

"""Fixtures for the end-to-end suites: ``skytrain serve`` as a real process with the local
provider (see ``tests/fixtures/service.py``).

``service`` is parametrized over the embedded setup (SQLite + local directory) and the
production one (PostgreSQL + S3 through the moto server).
"""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.fixtures.service import Service, start_service, stop_service


@pytest.fixture(params=["sqlite-local", "postgres-s3"])
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """``skytrain serve`` on a free port with the local provider."""
    overrides: dict[str, str] = {}
    if request.param == "postgres-s3":
        overrides["SKYTRAIN_DATABASE_URL"] = request.getfixturevalue("make_postgres_url")()
        overrides["SKYTRAIN_OBJECT_STORE_URL"] = request.getfixturevalue("make_bucket")()
        overrides["SKYTRAIN_S3_ENDPOINT_URL"] = request.getfixturevalue("s3_endpoint")
        subprocess.run(
            [sys.executable, "-m", "skytrain_backend", "db", "upgrade"],
            env={**os.environ, **overrides},
            check=True,
            capture_output=True,
        )
    service = start_service(overrides, tmp_path / "home")
    yield service
    stop_service(service)
    _show_logs_if_failed(request, service)


@pytest.fixture
def embedded_service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    """The embedded setup only (SQLite + local directory), for the heavier scenarios."""
    service = start_service({}, tmp_path / "home")
    yield service
    stop_service(service)
    _show_logs_if_failed(request, service)


def _show_logs_if_failed(request: pytest.FixtureRequest, service: Service) -> None:
    report = getattr(request.node, "rep_call", None)
    if report is not None and report.failed:
        print(f"--- serve.log\n{service.log()[-6000:]}\n{service.worker_logs()}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()  # type: ignore[attr-defined]
    if report.when == "call":
        item.rep_call = report  # type: ignore[attr-defined]

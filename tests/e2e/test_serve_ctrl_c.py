"""Ctrl-C stops `skytrain serve` and the workers it started (issue 36), even when it was
started as a background command of a shell without job control, with SIGINT ignored."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.demo.support import assert_nothing_left, processes_of
from tests.e2e import support
from tests.fixtures.service import start_service, stop_service

pytestmark = [pytest.mark.e2e, pytest.mark.slow]


def test_ctrl_c_stops_serve_and_its_worker_even_started_in_the_background(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    home = tmp_path / "home"
    service = start_service({"SKYTRAIN_MAX_WORKERS": "1"}, home, sigint_ignored=True)
    try:
        with service.http("ctrl-c") as http:
            created = http.post(
                "/v1/models",
                json={"project": "ctrl-c", "name": "served", "base_model": str(tiny_model_path)},
            )
            assert created.status_code == 201, created.text
            support.wait_until_served(http, created.json()["id"])
        assert len(processes_of(home)) >= 3  # the server, a worker and its engine

        service.process.send_signal(signal.SIGINT)
        assert service.process.wait(timeout_s=120) == 130, service.log()[-4000:]
    finally:
        if service.process.poll() is None:  # a failed check above: stop it all the same
            stop_service(service)
    assert_nothing_left(home)

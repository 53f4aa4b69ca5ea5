"""No process outlives the control plane that started it, through crashes and restarts.

``skytrain serve`` runs as a real process with the local provider and the tiny model: its
worker gets only the environment it needs, dies with a killed control plane (and its engine
with it), and the control plane that starts next records it stopped at once.
"""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from pathlib import Path

import psutil
import pytest

from tests.e2e import support
from tests.fixtures.service import Service, start_service, stop_service
from tests.gateway.conftest import wait_until


def _register(service: Service, base_model: Path) -> dict:
    with service.http("alice") as http:
        response = http.post(
            "/v1/models", json={"project": "e2e", "name": "orphan", "base_model": str(base_model)}
        )
        assert response.status_code == 201, response.text
        return dict(response.json())


def _worker_row(service: Service, worker_id: str) -> tuple[str, str, dict]:
    with sqlite3.connect(service.home / "skytrain.db") as db:
        status, message, hardware = db.execute(
            "select status, status_message, hardware from workers where id = ?", (worker_id,)
        ).fetchone()
    return status, message, json.loads(hardware)


def _recorded_pids(service: Service) -> list[int]:
    with sqlite3.connect(service.home / "skytrain.db") as db:
        return [pid for (pid,) in db.execute("select pid from processes")]


def _alive(process: psutil.Process) -> bool:
    try:
        return process.is_running() and process.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


@pytest.mark.slow
def test_a_killed_control_plane_takes_its_worker_along_and_the_next_one_knows(
    tmp_path: Path, tiny_model_path: Path
) -> None:
    home = tmp_path / "home"
    env = {"SKYTRAIN_DATABASE_URL": f"sqlite:///{home / 'skytrain.db'}"}
    service = start_service(env, home)
    try:
        model = _register(service, tiny_model_path)
        with service.http("alice") as http:
            worker_id = support.wait_until_served(http, model["id"])["worker_id"]
        pid = int(_worker_row(service, worker_id)[2]["pid"])
        worker = psutil.Process(pid)
        family = [worker, *worker.children(recursive=True)]  # the worker and its engine
        assert len(family) >= 2

        names = {
            entry.split(b"=", 1)[0]
            for entry in Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
        }
        assert b"SKYTRAIN_DATABASE_URL" not in names  # the control plane's own settings stay
        assert b"SKYTRAIN_CONTROL_PLANE_URL" in names and b"SKYTRAIN_WORKER_TOKEN" in names

        os.kill(service.process.pid, signal.SIGKILL)  # the control plane crashes, alone
        wait_until(
            lambda: not any(_alive(process) for process in family),
            what="the worker and its engine ending with their control plane",
            timeout_s=30,
        )
        assert _recorded_pids(service) == [pid]  # the record the next control plane reads
    finally:
        stop_service(service)

    restarted = start_service(env, home)
    try:
        status, message, _ = _worker_row(restarted, worker_id)
        assert (status, message) == ("stopped", "its control plane is gone")
        assert pid not in _recorded_pids(restarted)
        with restarted.http("alice") as http:  # a new worker serves the model again
            new_worker = support.wait_until_served(http, model["id"])["worker_id"]
        assert new_worker != worker_id
        new_pid = int(_worker_row(restarted, new_worker)[2]["pid"])
        new_family = [psutil.Process(new_pid), *psutil.Process(new_pid).children(recursive=True)]
    finally:
        stop_service(restarted)
    assert not any(_alive(process) for process in new_family)
    assert _recorded_pids(restarted) == []

"""The control plane records the processes it starts, and stops those no live control plane
owns: at start-up what a dead one left, at shutdown its own (even ones it no longer knows in
memory), never another live control plane's. Real processes, a real database."""

from __future__ import annotations

import socket
import sys
from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.child_processes import ChildProcess, ProcessIdentity, stop_process
from skytrain_backend.config import Settings
from skytrain_backend.db import process_records
from skytrain_backend.db.models import Worker
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.rows import add_ready_worker
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread, wait_until

SLEEPER = [sys.executable, "-c", "import time; time.sleep(600)"]


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def local_settings(request: pytest.FixtureRequest, make_settings: MakeSettings) -> Settings:
    """A control plane with the local provider (it starts no worker: no model is active)."""
    return make_settings(database=request.param, scheduler={"provider": "local"})


@pytest.fixture
def sessions(local_settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(local_settings.storage.resolved_database_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture
def sleepers() -> Iterator[list[ChildProcess]]:
    started: list[ChildProcess] = []
    yield started
    for process in started:
        process.stop(grace_s=1)


def _sleeper(sleepers: list[ChildProcess]) -> ChildProcess:
    process = ChildProcess.start(SLEEPER, env={})
    sleepers.append(process)
    return process


def _record(
    sessions: sessionmaker[Session], process: ChildProcess, owner: ProcessIdentity, worker: str
) -> None:
    with sessions() as session:
        process_records.record(
            session,
            kind="worker",
            worker_id=worker,
            host=socket.gethostname(),
            process=process.identity,
            owner=owner,
        )


def _worker(sessions: sessionmaker[Session]) -> str:
    with sessions() as session:
        return add_ready_worker(session).id


def test_processes_no_live_control_plane_owns_are_stopped_at_start_and_shutdown(
    local_settings: Settings, sessions: sessionmaker[Session], sleepers: list[ChildProcess]
) -> None:
    dead_owner = _sleeper(sleepers)
    dead_identity = dead_owner.identity
    dead_owner.stop(grace_s=1)  # a control plane that crashed
    live_owner = _sleeper(sleepers)  # another control plane, still running

    orphan, others, mine = _sleeper(sleepers), _sleeper(sleepers), _sleeper(sleepers)
    orphan_worker = _worker(sessions)
    _record(sessions, orphan, dead_identity, orphan_worker)
    _record(sessions, others, live_owner.identity, _worker(sessions))
    # The app below runs in this process: its records are this process's.
    _record(sessions, mine, ProcessIdentity.current(), _worker(sessions))

    with serve_in_thread(create_app(local_settings)):
        wait_until(lambda: not orphan.is_alive(), what="the orphan stopped", timeout_s=30)
        assert others.is_alive() and mine.is_alive()
        with sessions() as session:
            row = session.get_one(Worker, orphan_worker)
            assert (row.status, row.status_message) == ("stopped", "its control plane is gone")
    # The app has shut down: what it owned is stopped, another control plane's is not.
    assert not mine.is_alive()
    assert others.is_alive()
    with sessions() as session:
        left = process_records.on_host(session, host=socket.gethostname())
        assert [row.pid for row in left] == [others.pid]


def test_a_pid_given_to_another_process_is_never_signalled(
    sleepers: list[ChildProcess],
) -> None:
    process = _sleeper(sleepers)
    # A record of an earlier process whose pid the system has given to this one since.
    recorded = ProcessIdentity(process.pid, process.identity.start_time - 60.0)
    assert stop_process(recorded, grace_s=1) is False
    assert process.is_alive()
    assert stop_process(process.identity, grace_s=5) is True
    wait_until(lambda: not process.is_alive(), what="the recorded process stopped")

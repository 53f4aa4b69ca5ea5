"""`skytrain logs WORKER -f` follows a worker's log as it is written, like `tail -f`, and ends
on Ctrl-C (issue 36: no command followed a log live). The installed command runs in a process
of its own on a real log file, as in an operator's terminal."""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import threading
from pathlib import Path
from typing import IO

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import Settings, get_settings
from skytrain_backend.provision.local import worker_log_path
from tests.fixtures.rows import add_ready_worker

SKYTRAIN = str(Path(sys.executable).parent / "skytrain")


class _Lines:
    """The lines a process writes to one of its pipes, read in a thread as they come."""

    def __init__(self, stream: IO[str] | None) -> None:
        assert stream is not None
        self._queue: queue.Queue[str | None] = queue.Queue()
        self._thread = threading.Thread(target=self._read, args=(stream,))
        self._thread.start()

    def _read(self, stream: IO[str]) -> None:
        for line in stream:
            self._queue.put(line.rstrip("\n"))
        self._queue.put(None)  # the process ended

    def until(self, wanted: str) -> list[str]:
        """The lines up to the first that contains ``wanted``, that one included."""
        seen: list[str] = []
        while True:
            try:
                line = self._queue.get(timeout=120)  # a bound for a stuck command, not a timing
            except queue.Empty:
                raise AssertionError(f"never printed {wanted!r}; printed {seen}") from None
            if line is None:
                raise AssertionError(f"it ended before printing {wanted!r}; printed {seen}")
            seen.append(line)
            if wanted in line:
                return seen

    def rest(self) -> list[str]:
        self._thread.join()
        return [line for line in iter(self._queue.get, None)]


def _local_worker(db_sessions: sessionmaker[Session]) -> str:
    with db_sessions() as session:
        return add_ready_worker(session, base_model="tiny/llama", max_models=1).id


def _follow(settings: Settings, worker_id: str, *args: str) -> subprocess.Popen[str]:
    env = {
        **os.environ,
        "SKYTRAIN_HOME": str(settings.storage.home),
        "SKYTRAIN_DATABASE_URL": settings.storage.resolved_database_url,
        "SKYTRAIN_OBJECT_STORE_URL": settings.storage.resolved_object_store_url,
    }
    return subprocess.Popen(
        [SKYTRAIN, "logs", worker_id, "-f", *args],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def _stop(follower: subprocess.Popen[str], errors: _Lines) -> None:
    """Ctrl-C ends it at once with exit code 0 and no traceback."""
    follower.send_signal(signal.SIGINT)
    code = follower.wait(timeout=60)
    printed = "\n".join(errors.rest())
    assert code == 0, printed
    assert "Traceback" not in printed and "Aborted" not in printed


def test_logs_follow_prints_new_lines_as_written_until_ctrl_c(
    settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    worker_id = _local_worker(db_sessions)
    log = worker_log_path(settings.storage.home / "workers", worker_id)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("old line 1\nold line 2\nold line 3\n")
    follower = _follow(settings, worker_id, "-n", "2")
    printed, errors = _Lines(follower.stdout), _Lines(follower.stderr)
    try:
        # The last two lines first, then each line as the worker appends it.
        assert printed.until("old line 3") == ["old line 2", "old line 3"]
        with log.open("a") as handle:
            handle.write("new line 4\n")
        assert printed.until("new line 4") == ["new line 4"]
        with log.open("a") as handle:
            handle.write("new line 5\nnew line 6\n")
        assert printed.until("new line 6") == ["new line 5", "new line 6"]
        # A worker started again writes its log anew: read from its start.
        log.write_text("restarted 1\n")
        assert printed.until("restarted 1") == ["restarted 1"]
        assert follower.poll() is None, "it follows until Ctrl-C"
    finally:
        _stop(follower, errors)


def test_logs_follow_waits_for_a_log_not_written_yet_and_prints_all_of_it(
    settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    """A local worker just launched has no log yet: the command says it waits, then prints
    the whole file once it appears (all of it is new, whatever -n says)."""
    worker_id = _local_worker(db_sessions)
    log = worker_log_path(settings.storage.home / "workers", worker_id)
    follower = _follow(settings, worker_id, "-n", "1")
    printed, errors = _Lines(follower.stdout), _Lines(follower.stderr)
    try:
        assert f"waiting for worker {worker_id} to write its log" in errors.until("waiting")[-1]
        log.parent.mkdir(parents=True, exist_ok=True)
        log.write_text("first 1\nfirst 2\n")
        assert printed.until("first 2") == ["first 1", "first 2"]
        assert follower.poll() is None, "it follows until Ctrl-C"
    finally:
        _stop(follower, errors)


def test_logs_follow_of_a_manual_worker_without_a_log_here_says_so(
    settings: Settings, db_sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker started by hand writes its log on its own host: nothing to wait for here."""
    with db_sessions() as session:
        worker_id = add_ready_worker(
            session, base_model="tiny/llama", max_models=1, provider="manual"
        ).id
    monkeypatch.setenv("SKYTRAIN_HOME", str(settings.storage.home))
    monkeypatch.setenv("SKYTRAIN_DATABASE_URL", settings.storage.resolved_database_url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["logs", worker_id, "-f"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1, result.output
    assert f"no log for worker {worker_id} on its own host" in result.output

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

import pytest
from sqlalchemy.orm import Session, sessionmaker
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import Settings, get_settings
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.provision.local import worker_log_path

SKYTRAIN = str(Path(sys.executable).parent / "skytrain")


def test_logs_follow_prints_new_lines_as_written_until_ctrl_c(
    settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    with db_sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider="local", base_model="tiny/llama", max_models=1, status="ready"
        )
        session.commit()
        worker_id = worker.id
    log = worker_log_path(settings.home / "workers", worker_id)
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("old line 1\nold line 2\nold line 3\n")
    env = {
        **os.environ,
        "SKYTRAIN_HOME": str(settings.home),
        "SKYTRAIN_DATABASE_URL": settings.resolved_database_url,
        "SKYTRAIN_OBJECT_STORE_URL": settings.resolved_object_store_url,
    }
    follower = subprocess.Popen(
        [SKYTRAIN, "logs", worker_id, "-f", "-n", "2"],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    lines: queue.Queue[str | None] = queue.Queue()

    def read() -> None:
        for line in follower.stdout or []:
            lines.put(line.rstrip("\n"))
        lines.put(None)  # the command ended

    reader = threading.Thread(target=read)
    reader.start()

    def read_until(wanted: str) -> list[str]:
        seen: list[str] = []
        while True:
            try:
                line = lines.get(timeout=120)  # a bound for a stuck command, not a timing
            except queue.Empty:
                raise AssertionError(f"never printed {wanted!r}; printed {seen}") from None
            if line is None:
                raise AssertionError(f"it ended before printing {wanted!r}; printed {seen}")
            seen.append(line)
            if line == wanted:
                return seen

    try:
        # The last two lines first, then each line as the worker appends it.
        assert read_until("old line 3") == ["old line 2", "old line 3"]
        with log.open("a") as handle:
            handle.write("new line 4\n")
        assert read_until("new line 4") == ["new line 4"]
        with log.open("a") as handle:
            handle.write("new line 5\nnew line 6\n")
        assert read_until("new line 6") == ["new line 5", "new line 6"]
        # A worker started again writes its log anew: read from its start.
        log.write_text("restarted 1\n")
        assert read_until("restarted 1") == ["restarted 1"]
        assert follower.poll() is None, "it follows until Ctrl-C"
    finally:
        follower.send_signal(signal.SIGINT)
        code = follower.wait(timeout=60)
        reader.join()
    errors = follower.stderr.read() if follower.stderr else ""
    assert code == 0, errors
    assert "Traceback" not in errors and "Aborted" not in errors


def test_logs_follow_of_a_manual_worker_without_a_log_here_says_so(
    settings: Settings, db_sessions: sessionmaker[Session], monkeypatch: pytest.MonkeyPatch
) -> None:
    """A worker started by hand writes its log on its own host: nothing to wait for here."""
    with db_sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider="manual", base_model="tiny/llama", max_models=1, status="ready"
        )
        session.commit()
        worker_id = worker.id
    monkeypatch.setenv("SKYTRAIN_HOME", str(settings.home))
    monkeypatch.setenv("SKYTRAIN_DATABASE_URL", settings.resolved_database_url)
    get_settings.cache_clear()
    try:
        result = CliRunner().invoke(app, ["logs", worker_id, "-f"])
    finally:
        get_settings.cache_clear()
    assert result.exit_code == 1, result.output
    assert f"no log for worker {worker_id} on its own host" in result.output

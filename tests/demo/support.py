"""``skytrain demo`` as a process, and the processes it leaves (or must not leave) behind."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from tests.fixtures.models import model_cache_dir


def start_demo(
    home: Path, *args: str, stdout: int | None = None, sigint_ignored: bool = False
) -> subprocess.Popen[str]:
    """The demo as a process; ``sigint_ignored``: started as a shell without job control
    starts a background command (``cmd &``), with SIGINT ignored, which its children inherit."""
    env = {**os.environ, "SKYTRAIN_MODEL_CACHE_DIR": str(model_cache_dir())}
    return subprocess.Popen(
        [sys.executable, "-m", "skytrain_backend", "demo", "--home", str(home), *args],
        env=env,
        stdout=stdout if stdout is not None else subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        preexec_fn=(lambda: signal.signal(signal.SIGINT, signal.SIG_IGN))
        if sigint_ignored
        else None,
    )


def wait_for_output(process: subprocess.Popen[str], log_path: Path, text: str) -> str:
    """Wait until the demo has printed ``text``; the log so far."""
    deadline = time.monotonic() + 600
    while text not in (log := log_path.read_text()):
        assert process.poll() is None, log[-4000:]
        assert time.monotonic() < deadline, log[-4000:]
        time.sleep(0.1)
    return log


def wait_until_training(process: subprocess.Popen[str], log_path: Path) -> str:
    """Wait until the demo's worker serves its model and the first training job is under way
    (the SDK's progress bar shows); the log so far."""
    return wait_for_output(process, log_path, "train:")


def processes_of(home: Path) -> list[int]:
    """Live processes started for this demo home: the server, its workers and their engines."""
    marker = f"SKYTRAIN_HOME={home}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            environ = (entry / "environ").read_bytes()
        except OSError:
            continue
        if marker in environ.split(b"\0"):
            found.append(int(entry.name))
    return found


def assert_nothing_left(home: Path) -> None:
    deadline = time.monotonic() + 10  # a killed process may take a moment to be reaped
    while processes_of(home) and time.monotonic() < deadline:
        time.sleep(0.5)
    assert processes_of(home) == [], f"processes of {home} still running"

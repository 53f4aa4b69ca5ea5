"""The embedded control plane the demo runs: ``skytrain serve`` as a child process.

It gets its own home (SQLite database, object directory, worker logs) and a free loopback
port, and the ``local`` provider, so the model the demo registers gets a worker subprocess on
this machine. A child process rather than a thread: the workers it starts read their settings
from the environment they inherit, which is the child's, so the demo's home reaches them
without touching this process's environment.

Stopping it sends SIGINT (the server stops its workers on the way out), waits, and kills
what is left. It is a ``processes.ChildProcess``: if the demo dies without stopping it, it
is killed, and its workers with it.
"""

from __future__ import annotations

import contextlib
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path

import httpx

from skytrain_backend.child_processes import ChildProcess
from skytrain_backend.config import subprocess_env
from skytrain_backend.errors import ConfigurationError

STARTUP_TIMEOUT_S = 120.0
# The server stops each worker with SIGTERM and up to 15 s of grace before SIGKILL.
SHUTDOWN_TIMEOUT_S = 90.0
DEMO_TENANT = "demo"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@dataclass
class EmbeddedService:
    """A running ``skytrain serve`` child and the API key the demo uses with it."""

    url: str
    home: Path
    api_key: str
    process: ChildProcess
    log_path: Path

    def cancel_open_jobs(self) -> int:
        """Cancel the demo's queued and running training jobs; how many were open.

        Called when the demo is interrupted: a job left open would be leased again by the
        next demo's worker and train a model nobody waits for.
        """
        headers = {"Authorization": f"Bearer {self.api_key}"}
        cancelled = 0
        with httpx.Client(base_url=self.url, headers=headers, timeout=10) as http:
            for status in ("queued", "running"):
                page = http.get("/v1/training-jobs", params={"status": status, "limit": 100})
                for job in page.raise_for_status().json()["data"]:
                    answer = http.post(f"/v1/training-jobs/{job['id']}/cancel")
                    cancelled += answer.is_success
        return cancelled

    def stop(self) -> bool:
        """Stop the server and its workers; False if it had to be killed."""
        if self.process.poll() is not None:
            return True
        self.process.send_signal(signal.SIGINT)
        try:
            self.process.wait(timeout_s=SHUTDOWN_TIMEOUT_S)
            return True
        except subprocess.TimeoutExpired:
            self.process.stop(grace_s=0)
            return False


def service_env(
    home: Path, *, port: int, model_cache_dir: Path, base_model_dirs: Sequence[Path] = ()
) -> dict[str, str]:
    """The environment of the embedded server: everything under ``home``, workers local,
    base models from the model cache and ``base_model_dirs``."""
    return subprocess_env(
        {
            "SKYTRAIN_HOME": str(home),
            "SKYTRAIN_DATABASE_URL": _database_url(home),
            "SKYTRAIN_OBJECT_STORE_URL": (home / "objects").as_uri(),
            "SKYTRAIN_MODEL_CACHE_DIR": str(model_cache_dir),
            "SKYTRAIN_BASE_MODEL_DIRS": ":".join(map(str, [model_cache_dir, *base_model_dirs])),
            "SKYTRAIN_HOST": "127.0.0.1",
            "SKYTRAIN_PORT": str(port),
            "SKYTRAIN_PUBLIC_URL": f"http://127.0.0.1:{port}",
            "SKYTRAIN_PROVIDER": "local",
            "SKYTRAIN_MAX_WORKERS": "1",
            "SKYTRAIN_AUTO_MIGRATE": "true",
            "PYTHONUNBUFFERED": "1",
        }
    )


def _database_url(home: Path) -> str:
    return f"sqlite:///{home / 'skytrain.db'}"


def _create_key(database_url: str) -> str:
    from skytrain_backend.db import api_keys, migrations
    from skytrain_backend.db.session import create_db_engine, session_factory

    engine = create_db_engine(database_url)
    try:
        migrations.prepare_schema(engine, auto_migrate=True)
        with session_factory(engine)() as session:
            _, key = api_keys.create_key(session, tenant_name=DEMO_TENANT, name="skytrain demo")
    finally:
        engine.dispose()
    return key


def _wait_for_health(url: str, process: ChildProcess, log_path: Path) -> None:
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while True:
        if process.poll() is not None:
            raise ConfigurationError(
                f"the embedded control plane exited with code {process.returncode}; "
                f"its log is {log_path}:\n{_tail(log_path)}"
            )
        with contextlib.suppress(httpx.TransportError):
            # Answered while the child still runs: not by whatever else took the port first.
            if httpx.get(f"{url}/health", timeout=2).status_code == 200 and process.poll() is None:
                return
        if time.monotonic() > deadline:
            raise ConfigurationError(
                f"the embedded control plane did not answer {url}/health within "
                f"{STARTUP_TIMEOUT_S:g} s; its log is {log_path}:\n{_tail(log_path)}"
            )
        time.sleep(0.25)


def _tail(path: Path, lines: int = 20) -> str:
    with contextlib.suppress(OSError):
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    return ""


# Tries at a port chosen here: another process may take it between the check and the bind.
PORT_TRIES = 3


class PortTaken(ConfigurationError):
    """The server could not bind its port: something took it first."""


@contextlib.contextmanager
def embedded_service(
    home: Path,
    *,
    port: int | None,
    model_cache_dir: Path,
    base_model_dirs: Sequence[Path] = (),
) -> Iterator[EmbeddedService]:
    """Start ``skytrain serve`` under ``home`` on ``port`` (None: a free one, another if it is
    taken before the server binds it); stop it (and its workers) on exit."""
    home.mkdir(parents=True, exist_ok=True)
    api_key = _create_key(_database_url(home))
    for attempt in range(1, PORT_TRIES + 1):
        try:
            service = _start(
                home,
                port=port or free_port(),
                api_key=api_key,
                model_cache_dir=model_cache_dir,
                base_model_dirs=base_model_dirs,
            )
            break
        except PortTaken:
            if port is not None or attempt == PORT_TRIES:
                raise
    try:
        yield service
    finally:
        if not service.stop():
            print(
                f"warning: the embedded control plane did not stop within "
                f"{SHUTDOWN_TIMEOUT_S:g} s and was killed; if workers are left, see "
                f"{home / 'workers'}",
                file=sys.stderr,
            )


def _start(
    home: Path,
    *,
    port: int,
    api_key: str,
    model_cache_dir: Path,
    base_model_dirs: Sequence[Path],
) -> EmbeddedService:
    env = service_env(
        home, port=port, model_cache_dir=model_cache_dir, base_model_dirs=base_model_dirs
    )
    log_path = home / "serve.log"
    with open(log_path, "ab") as log:
        start = log.tell()
        # Its own process group: a Ctrl-C in the terminal reaches the demo, which stops the
        # server in order (workers first) instead of everything dying at once.
        process = ChildProcess.start(
            [sys.executable, "-m", "skytrain_backend", "serve"], env=env, stdout=log
        )
    service = EmbeddedService(
        url=f"http://127.0.0.1:{port}",
        home=home,
        api_key=api_key,
        process=process,
        log_path=log_path,
    )
    try:
        _wait_for_health(service.url, process, log_path)
    except BaseException as exc:  # a Ctrl-C too: it runs in a process group of its own
        service.stop()
        if isinstance(exc, ConfigurationError):
            with open(log_path, "rb") as log:
                log.seek(start)
                if b"address already in use" in log.read().lower():
                    raise PortTaken(f"port {port} is taken: {exc}") from None
        raise
    return service

"""The ``local`` provider: workers as subprocesses of the control plane's host.

The embedded default. Each worker runs ``python -m skytrain_backend worker`` in its own
process group (its engine is a child of it), writing everything it prints to
``$SKYTRAIN_HOME/workers/<worker_id>.log``, the file ``skytrain logs WORKER`` shows.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
from collections import deque
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from skytrain_backend.config import subprocess_env
from skytrain_backend.provision.base import ClusterInfo, Provider, WorkerLaunch

_LOG_TAIL_LINES = 20


@dataclass
class _LocalWorker:
    worker_id: str
    process: subprocess.Popen[bytes]
    log_path: Path
    log_file: IO[bytes]
    terminated: bool = False


def worker_log_path(log_dir: Path, worker_id: str) -> Path:
    return log_dir / f"{worker_id}.log"


def log_tail(path: Path, lines: int = _LOG_TAIL_LINES) -> str:
    """The last lines of a log file ('' when there is none)."""
    try:
        with open(path, errors="replace") as handle:
            return "".join(deque(handle, maxlen=lines)).strip()
    except FileNotFoundError:
        return ""


class LocalProvider(Provider):
    """Starts each worker as a subprocess on this machine."""

    name = "local"

    def __init__(self, *, log_dir: Path, python: str = sys.executable) -> None:
        self._log_dir = log_dir
        self._python = python
        self._workers: dict[str, _LocalWorker] = {}
        self._lock = threading.Lock()

    def launch(self, launch: WorkerLaunch) -> str:
        cluster_name = f"local-{launch.worker_id}"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = worker_log_path(self._log_dir, launch.worker_id)
        log_file = open(log_path, "ab")  # noqa: SIM115 - owned by the worker record, closed on reap
        env = subprocess_env(
            {
                **launch.envs,
                "SKYTRAIN_CONTROL_PLANE_URL": launch.control_plane_url,
                "SKYTRAIN_WORKER_TOKEN": launch.join_token,
                "SKYTRAIN_WORKER_BASE_MODEL": launch.base_model,
                "SKYTRAIN_ENGINE_SECRET": launch.engine_secret,
                # The front door on loopback, on a port of its own: the control plane is here.
                "SKYTRAIN_WORKER_HOST": "127.0.0.1",
                "SKYTRAIN_WORKER_PORT": "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        process = subprocess.Popen(
            [self._python, "-m", "skytrain_backend", "worker"],
            stdout=log_file,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=env,
            start_new_session=True,  # its own process group: terminate() takes the engine too
        )
        with self._lock:
            self._workers[cluster_name] = _LocalWorker(
                worker_id=launch.worker_id, process=process, log_path=log_path, log_file=log_file
            )
        return cluster_name

    def poll(self) -> list[ClusterInfo]:
        """Live workers as ``up``; an ended one is reported once (``gone`` or ``failed``)."""
        with self._lock:
            workers = list(self._workers.items())
        infos = []
        for cluster_name, worker in workers:
            code = worker.process.poll()
            if code is None:
                infos.append(ClusterInfo(worker.worker_id, cluster_name, "up"))
                continue
            worker.log_file.close()
            with self._lock:
                self._workers.pop(cluster_name, None)
            if worker.terminated:
                infos.append(ClusterInfo(worker.worker_id, cluster_name, "gone"))
                continue
            tail = log_tail(worker.log_path)
            message = f"worker process exited with code {code}" + (
                f"; last lines of {worker.log_path}:\n{tail}" if tail else ""
            )
            infos.append(ClusterInfo(worker.worker_id, cluster_name, "failed", message=message))
        return infos

    def terminate(self, cluster_name: str) -> None:
        with self._lock:
            worker = self._workers.get(cluster_name)
        if worker is None:
            return
        worker.terminated = True
        _stop_process_group(worker.process)
        worker.log_file.close()

    def close(self) -> list[str]:
        """Stop every worker process: they are the control plane's children."""
        with self._lock:
            workers = dict(self._workers)
        for name in workers:
            self.terminate(name)
        return [worker.worker_id for worker in workers.values()]


def _stop_process_group(process: subprocess.Popen[bytes], timeout_s: float = 15.0) -> None:
    """SIGTERM the group (worker and engine), then SIGKILL what is left after ``timeout_s``.

    The group is signalled even when the worker itself has exited: its engine may not have.
    """
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        process.wait(timeout=timeout_s)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()

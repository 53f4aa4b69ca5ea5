"""The ``local`` provider: workers as subprocesses of the control plane's host.

The embedded default. Each worker runs ``python -m skytrain_backend worker`` as a
``processes.ChildProcess`` (its own process group, so its engine stops with it; killed if the
control plane dies), with only the environment it needs (``config.worker_env``: never the
control plane's database URL), writing everything it prints to
``$SKYTRAIN_HOME/workers/<worker_id>.log``, the file ``skytrain logs WORKER`` shows.

Each worker process is also recorded in SQL with this control plane as its owner
(``db.process_records``): ``stop_orphans`` stops the ones whose control plane no longer runs (at
start-up), and ``close`` stops every one this control plane owns, whether or not it still
knows it in memory.
"""

from __future__ import annotations

import logging
import socket
import sys
import threading
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO

from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.child_processes import ChildProcess, ProcessIdentity, stop_process
from skytrain_backend.config import worker_env
from skytrain_backend.db import process_records
from skytrain_backend.provision.base import ClusterInfo, Provider, StartupReport, WorkerLaunch

logger = logging.getLogger(__name__)

_LOG_TAIL_LINES = 20


@dataclass
class _LocalWorker:
    worker_id: str
    process: ChildProcess
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

    def __init__(
        self,
        *,
        log_dir: Path,
        sessions: sessionmaker[Session],
        envs: dict[str, str] | None = None,
        python: str = sys.executable,
    ) -> None:
        self._log_dir = log_dir
        self._sessions = sessions
        # Settings every worker gets (its home and model cache), on top of each launch's.
        self._envs = envs or {}
        self._python = python
        self._workers: dict[str, _LocalWorker] = {}
        self._lock = threading.Lock()
        self.host = socket.gethostname()
        self.owner = ProcessIdentity.current()

    def launch(self, launch: WorkerLaunch) -> str:
        cluster_name = f"local-{launch.worker_id}"
        self._log_dir.mkdir(parents=True, exist_ok=True)
        log_path = worker_log_path(self._log_dir, launch.worker_id)
        log_file = open(log_path, "ab")  # noqa: SIM115 - owned by the worker record, closed on reap
        env = worker_env(
            {
                **self._envs,
                **launch.envs,
                "SKYTRAIN_CONTROL_PLANE_URL": launch.control_plane_url,
                "SKYTRAIN_WORKER_TOKEN": launch.join_token,
                "SKYTRAIN_WORKER_BASE_MODEL": launch.base_model,
                "SKYTRAIN_WORKER_ID": launch.worker_id,  # on its log lines from the first
                "SKYTRAIN_ENGINE_SECRET": launch.engine_secret,
                # The front door on loopback, on a port of its own: the control plane is here.
                "SKYTRAIN_WORKER_HOST": "127.0.0.1",
                "SKYTRAIN_WORKER_PORT": "0",
                "PYTHONUNBUFFERED": "1",
            }
        )
        process = ChildProcess.start(
            [self._python, "-m", "skytrain_backend", "worker"], env=env, stdout=log_file
        )
        with self._sessions() as session:
            process_records.record(
                session,
                kind="worker",
                worker_id=launch.worker_id,
                host=self.host,
                process=process.identity,
                owner=self.owner,
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
            self._forget(worker)
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

    def startup_report(self, cluster_name: str, *, with_log: bool = False) -> StartupReport | None:
        """Its log's last lines when asked (``poll`` reports a process that ended)."""
        with self._lock:
            worker = self._workers.get(cluster_name)
        if worker is None or not with_log:
            return None
        tail = log_tail(worker.log_path)
        return StartupReport(
            ended=False,
            detail=f"its process still runs; the last lines of {worker.log_path}:\n{tail}"
            if tail
            else "its process still runs and has written nothing to its log",
        )

    def terminate(self, cluster_name: str) -> None:
        with self._lock:
            worker = self._workers.get(cluster_name)
        if worker is None:
            return
        worker.terminated = True
        # SIGTERM the group (worker and engine), then SIGKILL what is left.
        worker.process.stop(grace_s=15.0)
        worker.log_file.close()
        self._forget(worker)

    def close(self) -> list[str]:
        """Stop every worker process this control plane owns: those it knows in memory, and
        any other its SQL records name (the control plane's children never outlive it)."""
        with self._lock:
            workers = dict(self._workers)
        for name in workers:
            self.terminate(name)
        stopped = [worker.worker_id for worker in workers.values()]
        stopped += self._stop_recorded(lambda owner: owner == self.owner)
        return stopped

    def stop_orphans(self) -> list[str]:
        """Stop the worker processes on this host whose control plane no longer runs."""
        return self._stop_recorded(lambda owner: owner != self.owner and not owner.is_running())

    def _stop_recorded(self, whose: Callable[[ProcessIdentity], bool]) -> list[str]:
        stopped = []
        with self._sessions() as session:
            rows = process_records.on_host(session, host=self.host)
            chosen = [row for row in rows if whose(row.owner)]
            for row in chosen:
                if stop_process(row.process):
                    logger.warning(
                        "stopped worker process %d (worker %s): its control plane (pid %d) "
                        "no longer owns it",
                        row.process.pid,
                        row.worker_id,
                        row.owner.pid,
                    )
                if row.worker_id is not None:
                    stopped.append(row.worker_id)
                process_records.forget(session, host=self.host, process=row.process)
        return stopped

    def _forget(self, worker: _LocalWorker) -> None:
        with self._sessions() as session:
            process_records.forget(session, host=self.host, process=worker.process.identity)

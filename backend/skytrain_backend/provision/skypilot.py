"""The ``skypilot`` provider: each worker is a SkyPilot cluster launched from sky/worker.yaml.

It talks to SkyPilot through its Python SDK, which is a client of a SkyPilot API server (a
shared one named by ``SKYPILOT_API_SERVER_ENDPOINT``, or one the SDK starts on this host):
every call returns a request id at once, and ``sky.get`` / ``sky.stream_and_get`` wait for
the request's result. Launches and teardowns wait in background threads, so ``launch`` and
``terminate`` return at once; ``poll`` asks ``sky status`` (at most every
``skypilot_status_interval_s``) which clusters exist and reports:

- ``launching`` while ``sky launch`` runs (with SkyPilot's progress note when it has one);
- ``up`` with the worker's front door endpoint from ``sky endpoints`` once the cluster is UP;
  SkyPilot runs the task's setup inside the cluster's job after ``sky launch`` returned, so
  while the worker has not registered the scheduler asks ``startup_report``: the job's state
  (``sky.job_status``) and, once it ended (a failed setup: ``FAILED_SETUP``) or when the
  scheduler gives up on it, its last log lines (``sky.tail_logs``);
- ``failed`` with SkyPilot's own error message when the launch fails (no capacity, quota,
  missing credentials, no cloud enabled), once; a half-made cluster is torn down;
- ``gone`` when a cluster it launched disappears or stops (spot preemption, autostop, a
  ``sky down`` outside skytrain), once: the scheduler treats the worker as lost.

Clusters whose name carries the prefix (``skytrain-``) that the provider did not launch, e.g.
after a control plane restart, are reported too, so the scheduler adopts those of live
workers and stops the others. At start-up it runs ``sky check`` in the background and writes
what SkyPilot says (which clouds workers can launch on, or why none) to the control plane's
log. The SkyPilot SDK calls sit behind ``SkyApi``; tests put a fake cloud there and
everything else runs for real, including SkyPilot's own task parsing.
"""

from __future__ import annotations

import contextlib
import functools
import io
import logging
import re
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from typing import IO, Any, Literal, ParamSpec, Protocol, TypeVar, cast

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.provision.base import ClusterInfo, Provider, StartupReport, WorkerLaunch
from skytrain_backend.provision.local import worker_log_path
from skytrain_backend.provision.sky_task import (
    accelerator_choices,
    configured_accelerators,
    default_worker_yaml,
    load_task_config,
    task_accelerators,
    tracebacks_kept,
    worker_task,
)

__all__ = [
    "SkyPilotProvider",
    "accelerator_choices",
    "configured_accelerators",
    "default_worker_yaml",
    "describe_error",
    "load_task_config",
    "task_accelerators",
    "worker_task",
]

logger = logging.getLogger(__name__)

_ANSI_ESCAPE = re.compile(r"\x1b\[[0-9;?]*[A-Za-z]")
MAX_MESSAGE_CHARS = 4000
# `sky check` at start-up may start SkyPilot's API server and ask every cloud: give it time.
SKY_CHECK_TIMEOUT_S = 180.0
# The states of a cluster's job after which it runs no more (SkyPilot's JobStatus.is_terminal).
ENDED_JOB_STATES = frozenset({"SUCCEEDED", "FAILED", "FAILED_SETUP", "FAILED_DRIVER", "CANCELLED"})
# Lines of a job's log a startup report carries.
JOB_LOG_LINES = 20


class SkyApi(Protocol):
    """The SkyPilot SDK calls the provider makes: its boundary with the clouds.

    The ``sky`` module itself is the real implementation; tests pass a fake cloud.
    """

    def launch(
        self, task: Any, *, cluster_name: str, idle_minutes_to_autostop: int, down: bool
    ) -> Any: ...

    def status(self, cluster_names: list[str] | None = None, *, refresh: Any) -> Any: ...

    def endpoints(self, cluster: str, port: int) -> Any: ...

    def down(self, cluster_name: str) -> Any: ...

    def get(self, request_id: Any) -> Any: ...

    def stream_and_get(self, request_id: Any, *, output_stream: IO[str]) -> Any: ...

    def check(self, infra_list: tuple[str, ...] | None, verbose: bool) -> Any: ...

    def job_status(self, cluster_name: str) -> Any: ...

    def tail_logs(
        self, cluster_name: str, job_id: int | None, *, tail: int, output_stream: IO[str]
    ) -> int: ...


_P = ParamSpec("_P")
_R = TypeVar("_R")


def _keeping_tracebacks(call: Callable[_P, _R]) -> Callable[_P, _R]:
    @functools.wraps(call)
    def kept(*args: _P.args, **kwargs: _P.kwargs) -> _R:
        with tracebacks_kept():
            return call(*args, **kwargs)

    return kept


class _SkyPilotSdk:
    """The real ``SkyApi``: SkyPilot's client SDK."""

    @_keeping_tracebacks
    def launch(
        self, task: Any, *, cluster_name: str, idle_minutes_to_autostop: int, down: bool
    ) -> Any:
        import sky

        return sky.launch(
            task,
            cluster_name=cluster_name,
            idle_minutes_to_autostop=idle_minutes_to_autostop,
            down=down,
        )

    @_keeping_tracebacks
    def status(self, cluster_names: list[str] | None = None, *, refresh: Any) -> Any:
        import sky

        return sky.status(cluster_names, refresh=refresh)

    @_keeping_tracebacks
    def endpoints(self, cluster: str, port: int) -> Any:
        import sky

        return sky.endpoints(cluster, port)

    @_keeping_tracebacks
    def down(self, cluster_name: str) -> Any:
        import sky

        return sky.down(cluster_name)

    @_keeping_tracebacks
    def get(self, request_id: Any) -> Any:
        import sky

        return sky.get(request_id)

    @_keeping_tracebacks
    def stream_and_get(self, request_id: Any, *, output_stream: IO[str]) -> Any:
        import sky

        return sky.stream_and_get(request_id, output_stream=cast(io.TextIOBase, output_stream))

    @_keeping_tracebacks
    def check(self, infra_list: tuple[str, ...] | None, verbose: bool) -> Any:
        from sky.client import sdk

        return sdk.check(infra_list, verbose)

    @_keeping_tracebacks
    def job_status(self, cluster_name: str) -> Any:
        import sky

        return sky.job_status(cluster_name)

    @_keeping_tracebacks
    def tail_logs(
        self, cluster_name: str, job_id: int | None, *, tail: int, output_stream: IO[str]
    ) -> int:
        import sky

        return sky.tail_logs(
            cluster_name,
            job_id,
            follow=False,
            tail=tail,
            output_stream=cast(io.TextIOBase, output_stream),
        )


def describe_error(exc: BaseException) -> str:
    """SkyPilot's own words for a failure, without the terminal colours it adds."""
    text = _ANSI_ESCAPE.sub("", str(exc)).strip() or repr(exc)
    message = f"{type(exc).__name__}: {text}"
    if len(message) > MAX_MESSAGE_CHARS:
        message = message[: MAX_MESSAGE_CHARS - 3] + "..."
    return message


Phase = Literal["launching", "launched", "failed", "terminated"]


@dataclass
class _Cluster:
    worker_id: str
    name: str
    phase: Phase
    message: str | None = None
    endpoint: str | None = None
    # What the last poll said about a launched cluster, repeated until `sky status` is asked
    # again.
    last: ClusterInfo | None = None
    # The last startup report, repeated until its job's state is asked again.
    startup: StartupReport | None = None
    next_job_check_at: float = 0.0


class SkyPilotProvider(Provider):
    """Starts each worker as a SkyPilot cluster; see the module docstring."""

    name = "skypilot"

    def __init__(
        self,
        settings: Settings,
        *,
        sky_api: SkyApi | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._settings = settings
        self._prefix = settings.skypilot.cluster_prefix
        self._log_dir = settings.storage.home / "workers"
        self._task_path = settings.skypilot.worker_yaml or default_worker_yaml()
        self._task_config = load_task_config(self._task_path)
        self._check_task()
        self._sky: SkyApi = sky_api if sky_api is not None else _SkyPilotSdk()
        self._clock = clock
        self._lock = threading.Lock()
        self._clusters: dict[str, _Cluster] = {}
        # Clusters with a `sky down` in flight: never adopted, never reported as unknown.
        self._downing: set[str] = set()
        self._next_status_at = 0.0
        self.check_report = threading.Thread(
            target=self._report_sky_check, name="sky-check", daemon=True
        )
        self.check_report.start()

    def _report_sky_check(self) -> None:
        """``sky check`` once at start-up, into the control plane's log: which clouds workers
        can launch on, or why none. Off the request path, and given up after a while."""
        output = io.StringIO()
        outcome: list[str] = []

        def check() -> None:
            try:
                enabled = self._sky.stream_and_get(
                    self._sky.check(None, False), output_stream=output
                )
                outcome.append(f"enabled: {enabled}")
            except Exception as exc:
                outcome.append(f"failed: {describe_error(exc)}")

        running = threading.Thread(target=check, name="sky-check-request", daemon=True)
        running.start()
        running.join(SKY_CHECK_TIMEOUT_S)
        said = _ANSI_ESCAPE.sub("", output.getvalue()).strip()
        if not outcome:
            logger.warning(
                "sky check did not finish within %.0fs; its output so far:\n%s",
                SKY_CHECK_TIMEOUT_S,
                said,
            )
        elif outcome[0].startswith("failed"):
            logger.warning(
                "sky check %s: workers cannot launch until it passes. Its output:\n%s",
                outcome[0],
                said,
            )
        else:
            logger.info("sky check (%s):\n%s", outcome[0], said)

    def _check_task(self) -> None:
        """Refuse to start with a worker task SkyPilot would reject at the first launch."""
        placeholder = WorkerLaunch(
            worker_id="0" * 32,
            base_model="placeholder/model",
            control_plane_url="http://127.0.0.1:8000",
            join_token="swt-placeholder",
            engine_secret="placeholder-secret",
        )
        try:
            worker_task(placeholder, settings=self._settings, task_config=self._task_config)
        except ConfigurationError:
            raise
        except Exception as exc:
            raise ConfigurationError(
                f"SkyPilot rejects the worker task {self._task_path} with these settings: "
                f"{describe_error(exc)}"
            ) from None

    def accelerator_choices(self) -> list[str] | None:
        return configured_accelerators(None, settings=self._settings, task_config=self._task_config)

    def cluster_name(self, worker_id: str) -> str:
        return f"{self._prefix}{worker_id}"

    def _worker_id(self, cluster_name: str) -> str | None:
        if not cluster_name.startswith(self._prefix):
            return None
        return cluster_name[len(self._prefix) :] or None

    # --- launch and terminate (background threads) ----------------------------------------

    def launch(self, launch: WorkerLaunch) -> str:
        name = self.cluster_name(launch.worker_id)
        task = worker_task(launch, settings=self._settings, task_config=self._task_config)
        with self._lock:
            self._clusters[name] = _Cluster(
                launch.worker_id,
                name,
                "launching",
                message=f"launching cluster {name} with SkyPilot",
            )
        threading.Thread(
            target=self._launch_and_wait,
            args=(name, launch.worker_id, task),
            name=f"sky-launch-{name}",
            daemon=True,
        ).start()
        return name

    def _launch_and_wait(self, name: str, worker_id: str, task: Any) -> None:
        with self._log(worker_id) as log:
            try:
                request_id = self._sky.launch(
                    task,
                    cluster_name=name,
                    idle_minutes_to_autostop=self._settings.skypilot.autostop_minutes,
                    down=True,
                )
                self._sky.stream_and_get(request_id, output_stream=log)
            except Exception as exc:
                message = f"sky launch of {name} failed: {describe_error(exc)}"
                logger.warning("%s", message)
                log.write(f"\n{message}\n")
                if self._finish_launch(name, "failed", message):
                    # A launch that failed half-way may leave a cluster behind: never leak it.
                    self._down_and_wait(name, log)
                return
        self._finish_launch(name, "launched", None)

    def _finish_launch(self, name: str, phase: Phase, message: str | None) -> bool:
        """Record the launch's outcome; False if the worker was terminated meanwhile."""
        with self._lock:
            cluster = self._clusters.get(name)
            if cluster is None or cluster.phase != "launching":
                return False
            cluster.phase = phase
            cluster.message = message
            if phase == "failed":
                self._downing.add(name)
            self._next_status_at = 0.0  # look at the new cluster at the next poll
            return True

    def terminate(self, cluster_name: str) -> None:
        with self._lock:
            cluster = self._clusters.get(cluster_name)
            if cluster is not None:
                cluster.phase = "terminated"
            if cluster_name in self._downing:
                return
            self._downing.add(cluster_name)
        threading.Thread(
            target=self._terminate_in_background,
            args=(cluster_name,),
            name=f"sky-down-{cluster_name}",
            daemon=True,
        ).start()

    def _terminate_in_background(self, name: str) -> None:
        with self._log(self._worker_id(name) or name) as log:
            self._down_and_wait(name, log)

    def _down_and_wait(self, name: str, log: IO[str]) -> None:
        """``sky down``; a cluster that does not exist (any more) is already down."""
        from sky import exceptions

        try:
            self._sky.stream_and_get(self._sky.down(name), output_stream=log)
            log.write(f"\nsky down {name}: done\n")
        except exceptions.ClusterDoesNotExist:
            log.write(f"\nsky down {name}: no such cluster\n")
        except Exception as exc:
            # Left for the next poll: the cluster still exists, so it is reported as unknown
            # and the scheduler asks for it to be stopped again.
            logger.error("sky down %s failed: %s", name, describe_error(exc))
            log.write(f"\nsky down {name} failed: {describe_error(exc)}\n")
        finally:
            with self._lock:
                self._downing.discard(name)

    @contextlib.contextmanager
    def _log(self, worker_id: str) -> Iterator[IO[str]]:
        """The worker's log file, where SkyPilot's launch and teardown output goes."""
        self._log_dir.mkdir(parents=True, exist_ok=True)
        with open(worker_log_path(self._log_dir, worker_id), "a") as log:
            yield log

    # --- a worker that has not registered yet ----------------------------------------------

    def startup_report(self, cluster_name: str, *, with_log: bool = False) -> StartupReport | None:
        """The state of the cluster's job (asked at most every ``skypilot_status_interval_s``
        unless ``with_log``), with its last log lines once it ended or when ``with_log``."""
        now = self._clock()
        with self._lock:
            cluster = self._clusters.get(cluster_name)
            if cluster is None or cluster.phase != "launched":
                return None
            if not with_log and now < cluster.next_job_check_at:
                return cluster.startup
            cluster.next_job_check_at = now + self._settings.skypilot.status_interval_s
        try:
            statuses = self._sky.get(self._sky.job_status(cluster_name))
        except Exception as exc:
            logger.info("no job status for %s yet: %s", cluster_name, describe_error(exc))
            return cluster.startup
        job_id, state = _last_job(statuses)
        if job_id is None:
            report = StartupReport(ended=False, detail="SkyPilot has not submitted its job yet")
        else:
            ended = state in ENDED_JOB_STATES
            detail = f"its SkyPilot job {job_id} is {state}"
            if ended or with_log:
                tail = self._job_log(cluster_name, job_id)
                if tail:
                    detail += f"; the last lines of `sky logs {cluster_name} {job_id}`:\n{tail}"
            report = StartupReport(ended=ended, detail=detail)
        cluster.startup = report
        return report

    def _job_log(self, name: str, job_id: int) -> str:
        """The last lines of the job's log (its setup's output first), or '' if SkyPilot
        cannot tell."""
        output = io.StringIO()
        try:
            self._sky.tail_logs(name, job_id, tail=JOB_LOG_LINES, output_stream=output)
        except Exception as exc:
            logger.info("no log of job %d on %s: %s", job_id, name, describe_error(exc))
        text = _ANSI_ESCAPE.sub("", output.getvalue()).strip()
        return text[-MAX_MESSAGE_CHARS:]

    # --- poll ------------------------------------------------------------------------------

    def poll(self) -> list[ClusterInfo]:
        records = self._status_if_due()
        with self._lock:
            if records is not None:
                for name in records:
                    worker_id = self._worker_id(name)
                    if worker_id and name not in self._clusters and name not in self._downing:
                        self._clusters[name] = _Cluster(worker_id, name, "launched")
            clusters = list(self._clusters.values())
        infos = []
        for cluster in clusters:
            info = self._report(cluster, records)
            if info is not None:
                infos.append(info)
        return infos

    def _report(self, cluster: _Cluster, records: dict[str, Any] | None) -> ClusterInfo | None:
        """What to say about one cluster; ``records`` is None when status was not asked."""
        base = ClusterInfo(cluster.worker_id, cluster.name, "launching", message=cluster.message)
        if cluster.phase == "launching":
            record = (records or {}).get(cluster.name)
            reason = record.get("init_status_reason") if record is not None else None
            return replace(base, message=reason or cluster.message)
        if cluster.phase in ("failed", "terminated"):
            self._forget(cluster)
            state: Literal["failed", "gone"] = "failed" if cluster.phase == "failed" else "gone"
            return replace(base, state=state, message=cluster.message or "terminated")
        if records is None:
            return cluster.last or base
        record = records.get(cluster.name)
        status = _status_name(record)
        if record is None or status == "STOPPED":
            self._forget(cluster)
            if status == "STOPPED":
                # A stopped cluster still holds its disk; skytrain never restarts one.
                self.terminate(cluster.name)
                how = "stopped (spot preemption or autostop)"
            else:
                how = "no longer exists (spot preemption, autostop or a sky down outside skytrain)"
            return replace(base, state="gone", message=f"cluster {cluster.name} {how}")
        if status == "INIT":
            info = replace(base, message=record.get("init_status_reason") or "initializing")
        else:
            if cluster.endpoint is None:
                try:
                    cluster.endpoint = self._endpoint(cluster.name)
                except _UnusableEndpoint as exc:
                    # Every launch would end the same way: the worker fails, its cluster goes.
                    self._forget(cluster)
                    self.terminate(cluster.name)
                    return replace(base, state="failed", message=str(exc))
            info = ClusterInfo(
                cluster.worker_id, cluster.name, "up", engine_endpoint=cluster.endpoint
            )
        cluster.last = info
        return info

    def _forget(self, cluster: _Cluster) -> None:
        with self._lock:
            if self._clusters.get(cluster.name) is cluster:
                del self._clusters[cluster.name]

    def _status_if_due(self) -> dict[str, Any] | None:
        """Clusters with the prefix, by name, from ``sky status``; None when not asked now."""
        import sky

        now = self._clock()
        with self._lock:
            if now < self._next_status_at:
                return None
            self._next_status_at = now + self._settings.skypilot.status_interval_s
        try:
            records = self._sky.get(self._sky.status(refresh=sky.StatusRefreshMode.AUTO))
        except Exception as exc:
            logger.warning("sky status failed, trying again later: %s", describe_error(exc))
            return None
        return {
            record["name"]: record
            for record in records
            if str(record["name"]).startswith(self._prefix)
        }

    def _endpoint(self, name: str) -> str | None:
        """The front door's URL as SkyPilot exposes it, or None while the port is not open yet.

        The front door speaks HTTPS only, with its own certificate, so it needs the port
        itself: SkyPilot answers ``host:port`` for clouds' VMs and for Kubernetes'
        ``loadbalancer`` and ``podip`` port modes, which becomes ``https://host:port``.
        Kubernetes' ``ingress`` mode answers ``http://ingress[:port]/skypilot/<namespace>/
        <cluster>/<port>`` (a path on an HTTP ingress), which no rewrite makes reachable:
        ``_UnusableEndpoint``.
        """
        port = self._settings.skypilot.worker_port
        try:
            endpoints = self._sky.get(self._sky.endpoints(name, port))
        except Exception as exc:
            logger.info("no endpoint for %s port %d yet: %s", name, port, describe_error(exc))
            return None
        url = endpoints.get(port) or endpoints.get(str(port))
        if not url:
            return None
        url = str(url).rstrip("/")
        address = url.split("://", 1)[-1]
        if "/" in address:
            raise _UnusableEndpoint(
                f"SkyPilot exposes the worker's port {port} on {name} as {url}: a path on "
                "Kubernetes' ingress (`kubernetes: ports: ingress` in ~/.sky/config.yaml, or a "
                "local kind cluster, which always uses it). The worker's front door needs the "
                "port itself (TLS end to end, its certificate pinned by the control plane): "
                "set `kubernetes: ports: loadbalancer` (or `podip` when the control plane runs "
                "inside the cluster) and launch again"
            )
        return "https://" + address


class _UnusableEndpoint(ConfigurationError):
    """SkyPilot exposes the front door's port in a way the control plane cannot use."""


def _last_job(statuses: Any) -> tuple[int | None, str | None]:
    """The newest job and its state's name from ``sky.job_status``'s answer ({id: status};
    ``{None: None}`` before any job)."""
    jobs = {job_id: status for job_id, status in (statuses or {}).items() if job_id is not None}
    if not jobs:
        return None, None
    job_id = max(jobs, key=int)
    status = jobs[job_id]
    return int(job_id), None if status is None else str(getattr(status, "value", status))


def _status_name(record: Any) -> str | None:
    if record is None:
        return None
    status = record["status"]
    return str(getattr(status, "value", status))

"""FAKE CLOUD: a stand-in for the SkyPilot SDK's cluster calls, the one fake in these tests.

No cloud is reachable from the test machine, so ``FakeSky`` plays SkyPilot's API server and
the clouds behind it: ``launch`` / ``down`` / ``status`` / ``endpoints`` return request ids and
``get`` / ``stream_and_get`` resolve them, as in SkyPilot's client/server SDK. It returns
SkyPilot's own types (``StatusResponse`` records, ``ClusterStatus``) and raises SkyPilot's own
exceptions, so the provider code under test is exactly what runs against a real cloud. The
tasks it receives are real ``sky.Task`` objects built by the provider.

Tests steer it: hold launches to watch the ``launching`` state, make the next launch fail,
pre-seed clusters, preempt or stop one, end a cluster's job (its setup failed, say) with the
log SkyPilot would show.
"""

from __future__ import annotations

import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import IO, Any

import sky
from sky import exceptions
from sky.schemas.api.responses import StatusResponse
from sky.skylet.job_lib import JobStatus

ENDPOINT_HOST = "203.0.113.7"  # TEST-NET-3: never routed anywhere


@dataclass
class LaunchCall:
    task: Any
    cluster_name: str
    idle_minutes_to_autostop: int
    down: bool


@dataclass
class FakeJob:
    """The job SkyPilot runs on a cluster: the task's setup, then its run (the worker)."""

    status: JobStatus = JobStatus.SETTING_UP
    log: str = ""
    job_id: int = 1


@dataclass
class _Request:
    kind: str
    args: dict[str, Any] = field(default_factory=dict)


class FakeSky:
    """Implements ``skytrain_backend.provision.skypilot.SkyApi`` over in-memory clusters."""

    def __init__(self) -> None:
        self.clusters: dict[str, StatusResponse] = {}
        self.launches: list[LaunchCall] = []
        self.downs: list[str] = []
        self.status_calls = 0
        # The next launch raises this (after leaving a half-made INIT cluster, as SkyPilot does
        # when provisioning fails after the instances were created).
        self.fail_next_launch: Exception | None = None
        self.leave_cluster_on_failure = False
        # While cleared, launches wait (their cluster stays INIT): the `launching` state.
        self.launch_gate = threading.Event()
        self.launch_gate.set()
        # Ports not yet exposed: `endpoints` answers {} like SkyPilot does meanwhile.
        self.ports_open = True
        # Kubernetes with `kubernetes.ports: ingress`: the ingress controller's address, and
        # `endpoints` answers a URL with a path under it, as SkyPilot does in that mode.
        self.ingress: str | None = None
        # `sky check`: what it prints and finds, or the error it raises.
        self.enabled_clouds = ["AWS", "Kubernetes"]
        self.check_output = "Checking credentials to enable infra for SkyPilot.\n  AWS: enabled\n"
        self.check_error: Exception | None = None
        # Each launched cluster's job, by cluster name.
        self.jobs: dict[str, FakeJob] = {}
        self.job_status_calls = 0
        self._requests: dict[str, _Request] = {}
        self._lock = threading.Lock()

    # --- the SkyApi surface ------------------------------------------------------------------

    def launch(
        self, task: Any, *, cluster_name: str, idle_minutes_to_autostop: int, down: bool
    ) -> str:
        assert isinstance(task, sky.Task)
        self.launches.append(LaunchCall(task, cluster_name, idle_minutes_to_autostop, down))
        return self._request("launch", cluster_name=cluster_name)

    def down(self, cluster_name: str) -> str:
        return self._request("down", cluster_name=cluster_name)

    def status(self, cluster_names: list[str] | None = None, *, refresh: Any) -> str:
        assert refresh in tuple(sky.StatusRefreshMode)
        self.status_calls += 1
        return self._request("status", cluster_names=cluster_names)

    def endpoints(self, cluster: str, port: int) -> str:
        return self._request("endpoints", cluster=cluster, port=port)

    def check(self, infra_list: tuple[str, ...] | None, verbose: bool) -> str:
        return self._request("check")

    def job_status(self, cluster_name: str) -> str:
        self.job_status_calls += 1
        return self._request("job_status", cluster_name=cluster_name)

    def tail_logs(
        self, cluster_name: str, job_id: int | None, *, tail: int, output_stream: IO[str]
    ) -> int:
        """Like SkyPilot's (a direct call, not a request id): the job's last lines, and an exit
        code that says whether it failed (100, ``exceptions.JobExitCode.FAILED``)."""
        self._require_up(cluster_name)
        job = self.jobs[cluster_name]
        assert job_id in (None, job.job_id)
        output_stream.write("".join(job.log.splitlines(keepends=True)[-tail:]))
        return 100 if job.status in (JobStatus.FAILED, JobStatus.FAILED_SETUP) else 0

    def stream_and_get(self, request_id: str, *, output_stream: IO[str]) -> Any:
        output_stream.write(f"[fake sky] request {request_id}\n")
        with self._lock:
            kind = self._requests[request_id].kind
        if kind == "check":
            output_stream.write(self.check_output)
        return self.get(request_id)

    def get(self, request_id: str) -> Any:
        with self._lock:
            request = self._requests.pop(request_id)
        return getattr(self, f"_run_{request.kind}")(**request.args)

    # --- what the cloud does -----------------------------------------------------------------

    def _run_launch(self, cluster_name: str) -> tuple[int, None]:
        self.add_cluster(cluster_name, sky.ClusterStatus.INIT, reason="provisioning")
        self.launch_gate.wait(timeout=60)
        error, self.fail_next_launch = self.fail_next_launch, None
        if error is not None:
            if not self.leave_cluster_on_failure:
                self.clusters.pop(cluster_name, None)
            raise error
        self.add_cluster(cluster_name, sky.ClusterStatus.UP)
        # `launch` returns once the job is submitted: its setup runs after (detached).
        self.jobs[cluster_name] = FakeJob()
        return 1, None

    def _run_down(self, cluster_name: str) -> None:
        self.downs.append(cluster_name)
        if self.clusters.pop(cluster_name, None) is None:
            raise exceptions.ClusterDoesNotExist(f"Cluster {cluster_name!r} does not exist.")

    def _run_status(self, cluster_names: list[str] | None) -> list[StatusResponse]:
        return [
            record
            for name, record in list(self.clusters.items())
            if cluster_names is None or name in cluster_names
        ]

    def _run_check(self) -> dict[str, dict[str, list[str]]]:
        """What `sky check` finds: the clouds whose credentials the fake cloud has."""
        if self.check_error is not None:
            raise self.check_error
        return {"default": {cloud: ["compute"] for cloud in self.enabled_clouds}}

    def _run_endpoints(self, cluster: str, port: int) -> dict[int, str]:
        self._require_up(cluster)
        if not self.ports_open:
            return {}
        if self.ingress is not None:
            return {port: f"http://{self.ingress}/skypilot/default/{cluster}/{port}"}
        return {port: f"{ENDPOINT_HOST}:{port}"}

    def _run_job_status(self, cluster_name: str) -> dict[int | None, JobStatus | None]:
        """The last job's status, as `sky.job_status(cluster)` answers it."""
        self._require_up(cluster_name)
        job = self.jobs.get(cluster_name)
        return {None: None} if job is None else {job.job_id: job.status}

    def _require_up(self, cluster: str) -> None:
        record = self.clusters.get(cluster)
        if record is None or record.status != sky.ClusterStatus.UP:
            raise exceptions.ClusterNotUpError(
                f"Cluster {cluster!r} is not in UP status.", cluster_status=None
            )

    # --- steering ----------------------------------------------------------------------------

    def add_cluster(
        self, name: str, status: sky.ClusterStatus, *, reason: str | None = None
    ) -> None:
        self.clusters[name] = StatusResponse(
            name=name,
            launched_at=int(time.time()),
            status=status,
            autostop=10,
            to_down=True,
            cluster_hash=uuid.uuid4().hex,
            cluster_ever_up=status == sky.ClusterStatus.UP,
            user_hash="fake",
            user_name="fake",
            workspace="default",
            is_managed=False,
            nodes=1,
            init_status_reason=reason if status == sky.ClusterStatus.INIT else None,
        )

    def end_job(self, name: str, status: JobStatus, log: str) -> None:
        """The cluster's job ends (its setup failed, the worker exited) with this log."""
        self.jobs[name] = FakeJob(status=status, log=log)

    def preempt(self, name: str) -> None:
        """The cloud takes a spot instance back: the cluster disappears from `sky status`."""
        del self.clusters[name]

    def settle(self, timeout_s: float = 30.0) -> None:
        """Wait for the provider's background launches and teardowns to finish."""
        deadline = time.monotonic() + timeout_s
        for thread in threading.enumerate():
            if thread.name.startswith(("sky-launch-", "sky-down-")):
                thread.join(max(0.0, deadline - time.monotonic()))
                assert not thread.is_alive(), f"{thread.name} did not finish"

    def _request(self, kind: str, **args: Any) -> str:
        request_id = uuid.uuid4().hex
        with self._lock:
            self._requests[request_id] = _Request(kind, args)
        return request_id

"""The worker agent: serves the models placed on it and trains them, one job at a time.

Two loops run side by side:

- the heartbeat loop tells the control plane what the engine serves, learns which models (and
  which of their steps) are placed here, keeps the engine's adapters in line with that
  (``worker/engine_host.py``), and restarts the engine if it dies;
- the job loop leases a training job and runs it (``worker/jobs.py``).

The trainer's turns on the device are one at a time (``EngineHost.trainer_turn``): a job
holds it from its lease to its end, a Tinker run (``worker.tinker_runs``) for each operation that
computes, with the engine asleep meanwhile when it shares the device; between operations a
Tinker run's trainer waits in host memory (``Trainer.offload``), so two runs and the engine
never hold the GPU at once.

Every change of state goes through the control plane over HTTP (``ControlPlaneClient``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from dataclasses import dataclass

from skytrain_backend.observability import logs
from skytrain_backend.protocol import (
    Heartbeat,
    ModelConfig,
    ServedCheckpoint,
    WorkerStatus,
)
from skytrain_backend.worker.client import LEASE_RETRY_S, ControlPlaneClient, until_stopped
from skytrain_backend.worker.engine_host import EngineHost, SupervisedEngine
from skytrain_backend.worker.jobs import JobRunner
from skytrain_backend.worker.options import AgentOptions
from skytrain_backend.worker.stats import StatsReader
from skytrain_backend.worker.tinker_runs import TinkerExecutor

__all__ = ["AgentOptions", "SupervisedEngine", "WorkerAgent"]

logger = logging.getLogger(__name__)


@dataclass
class _Placement:
    model_id: str
    latest_step: int
    steps: list[int]
    model_config: ModelConfig


class WorkerAgent:
    """Runs until ``stop()`` is called or the control plane asks it to drain."""

    def __init__(
        self,
        *,
        control_plane: ControlPlaneClient,
        host: EngineHost,
        options: AgentOptions,
        stats: StatsReader | None = None,
    ) -> None:
        """``host``: the engine this worker serves from, built with the same ``options``."""
        self._cp = control_plane
        self._options = options
        self._stats = stats
        self._placements: dict[str, _Placement] = {}
        self._placements_asked_at = 0.0
        self._stopping = asyncio.Event()
        self._host = host
        self._host.on_asleep = self._send_heartbeat
        self._jobs = JobRunner(
            control_plane=control_plane,
            host=self._host,
            options=options,
            stopping=self._stopping,
            heartbeat=self._send_heartbeat,
        )
        self.worker_id: str | None = None
        self._heartbeat_interval_s = 2.0
        self._tinker = TinkerExecutor(control_plane, self._host, options)

    async def run(self) -> None:
        options = self._options
        registered = await self._cp.register(options.registration)
        self.worker_id = registered.worker_id
        # On every line from here on, the front door's (other tasks) included.
        logs.set_process_context(worker_id=self.worker_id)
        self._heartbeat_interval_s = registered.heartbeat_interval_s
        self._jobs.lease_s = registered.lease_s
        if registered.reachable:
            logger.info(
                "registered as worker %s for %s; the control plane reaches it at %s",
                self.worker_id,
                options.base_model,
                registered.endpoint,
            )
        else:
            logger.error("registered as worker %s, but %s", self.worker_id, registered.message)
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        self._tinker.lease_s = registered.lease_s
        tinker = asyncio.create_task(self._tinker.run(self._stopping), name="tinker")
        try:
            await self._job_loop()
        finally:
            for task in (heartbeat, tinker):
                task.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await task

    def stop(self) -> None:
        self._stopping.set()
        self._cp.stop_retrying()

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._host.supervise()
                await self._send_heartbeat()
                await self._sync_adapters()
            except Exception:
                logger.exception("heartbeat failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._heartbeat_interval_s)

    def _status(self) -> WorkerStatus:
        if self._stopping.is_set():
            return "draining"
        if self._host.asleep:
            return "sleeping"
        return "training" if self._jobs.current else "ready"

    async def _send_heartbeat(self) -> None:
        """Tell the control plane what the worker does and serves; learn its placements."""
        stats = await self._stats.read() if self._stats is not None else None

        built_at = time.monotonic()

        def now() -> Heartbeat:
            nonlocal built_at
            built_at = time.monotonic()
            # Built for each try (a retried one says what the worker does then). A step loaded
            # but not committed yet is reported too: the control plane routes to committed
            # steps only, and a heartbeat built just before the commit but read after it must
            # not take the new step out of the served list the commit just wrote.
            job = self._jobs.current
            served = [ServedCheckpoint(model_id=m, step=s) for (m, s) in self._host.served]
            served += [ServedCheckpoint(model_id=m, step=0) for m in self._placements]
            return Heartbeat(
                status=self._status(), served=served, job_id=job.id if job else None, stats=stats
            )

        answer = await self._cp.heartbeat(now)
        self._placements = {
            item.model_id: _Placement(
                model_id=item.model_id,
                latest_step=item.latest_step,
                steps=item.steps,
                model_config=item.model_config_,
            )
            for item in answer.models
        }
        # What the placements know of: the commits confirmed before this try was built.
        self._placements_asked_at = built_at
        job = self._jobs.current
        if job is not None and job.id in answer.cancel_job_ids:
            job.cancelled = True
        if answer.drain:
            logger.info("the control plane asked this worker to drain")
            self.stop()

    async def _sync_adapters(self) -> None:
        """Load the checkpoints placed here into the engine; unload those no longer wanted."""
        wanted = {(p.model_id, s) for p in self._placements.values() for s in p.steps if s > 0}
        await self._host.sync_adapters(wanted, asked_at=self._placements_asked_at)

    async def _job_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                job = await until_stopped(
                    self._cp.lease(wait_s=self._options.job_wait_s), self._stopping
                )
            except Exception:
                logger.exception("leasing a job failed; retrying in %g s", LEASE_RETRY_S)
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), LEASE_RETRY_S)
                continue
            if job is not None:
                with logs.bind(job_id=job.id, model_id=job.model_id, request_id=job.request_id):
                    await self._jobs.run(job)

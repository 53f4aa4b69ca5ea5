"""The scheduler loop the control plane runs in the background.

Each pass (about once a second, or at once when woken by a registration, a request or a
job): expire job leases, declare silent workers lost, reconcile with the provider, place
active models (launching workers when needed), and stop idle workers. Every
``sweep_interval_s`` it also removes the files of deleted checkpoints that are still there,
and every ``garbage_interval_s`` the objects no row refers to (``garbage``). A pass runs in a
thread with its own session; nothing in it blocks API requests.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from datetime import timedelta
from typing import Any

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Worker, utcnow
from skytrain_backend.provision.base import ClusterInfo, Provider, WorkerLaunch
from skytrain_backend.scheduler import garbage, placement, queue
from skytrain_backend.storage import ObjectStore

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the provider and runs the scheduling passes; one per control plane."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        provider: Provider | None,
        store: ObjectStore | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self.provider = provider
        # Where the sweeps remove objects no row refers to any more (None: no sweeping).
        self.store = store
        self._next_sweep = 0.0
        self._next_garbage = 0.0
        self._sessions = sessions
        self._interval_s = interval_s
        self._wake: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        """Stop what an earlier control plane left running, then start the passes."""
        if self.provider is not None:
            orphans = await asyncio.to_thread(self.provider.stop_orphans)
            await asyncio.to_thread(self._record_stopped, orphans, "its control plane is gone")
        self._loop = asyncio.get_running_loop()
        self._wake = asyncio.Event()
        self._task = asyncio.create_task(self._run(), name="skytrain-scheduler")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self.provider is not None:
            stopped = await asyncio.to_thread(self.provider.close)
            await asyncio.to_thread(self._record_stopped, stopped, "the control plane stopped")

    def _record_stopped(self, worker_ids: list[str], reason: str) -> None:
        """Workers that ended with a control plane: their models are free, their running
        jobs go back to the queue (or end, if cancelled) for the next start to hand out."""
        with self._sessions() as session:
            for worker_id in worker_ids:
                worker = session.get(Worker, worker_id)
                if worker is not None and worker.status in worker_rows.LIVE_STATUSES:
                    placement.worker_gone(session, worker=worker, status="stopped", reason=reason)

    def wake(self) -> None:
        """Run a pass soon; safe to call from any thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await asyncio.to_thread(self.tick)
            except Exception:
                logger.exception("scheduler pass failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)

    def tick(self) -> None:
        """One scheduling pass."""
        s = self.settings
        with self._sessions() as session:
            queue.expire_leases(session)
            for worker in worker_rows.silent_workers(
                session, timeout_s=s.worker_heartbeat_timeout_s
            ):
                drained = worker.status == "draining"
                placement.worker_gone(
                    session,
                    worker=worker,
                    status="stopped" if drained else "lost",
                    reason="drained"
                    if drained
                    else f"no heartbeat for {s.worker_heartbeat_timeout_s:.0f}s",
                )
            if self.provider is not None:
                self._reconcile(session, self.provider.poll())
            placement.place_models(
                session,
                idle_timeout_s=s.worker_idle_timeout_s,
                max_workers=s.max_workers,
                launch_backoff_s=s.worker_launch_backoff_s,
                launch=(lambda base: self._launch(session, base)) if self.provider else None,
                limits=tenants.limits_by_id(session, s),
            )
            for worker in placement.idle_workers(session, idle_timeout_s=s.worker_idle_timeout_s):
                self._stop_idle(session, worker)
            if self.store is not None and time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + s.sweep_interval_s
                garbage.purge_deleted_checkpoints(session, store=self.store)
            if self.store is not None and time.monotonic() >= self._next_garbage:
                self._next_garbage = time.monotonic() + s.garbage_interval_s
                garbage.collect_garbage(
                    session,
                    store=self.store,
                    written_before=utcnow() - timedelta(seconds=s.garbage_grace_s),
                )

    def _launch(self, session: Session, base_model: str) -> None:
        assert self.provider is not None
        secret = secrets.token_urlsafe(24)
        worker, token = worker_rows.create_worker(
            session,
            provider=self.provider.name,
            base_model=base_model,
            max_models=self.settings.worker_max_models,
            engine_secret=secret,
        )
        session.commit()
        launch = WorkerLaunch(
            worker_id=worker.id,
            base_model=base_model,
            control_plane_url=self.settings.resolved_public_url,
            join_token=token,
            engine_secret=secret,
            envs=self._worker_envs(),
        )
        try:
            worker.cluster_name = self.provider.launch(launch)
        except Exception as exc:
            logger.exception("launching a worker for %s failed", base_model)
            placement.worker_gone(session, worker=worker, status="failed", reason=str(exc))
            return
        session.commit()
        logger.info("launching worker %s for %s (%s)", worker.id, base_model, worker.cluster_name)

    def _worker_envs(self) -> dict[str, str]:
        """Settings a worker started by this control plane inherits."""
        s = self.settings
        envs: dict[str, Any] = {
            "SKYTRAIN_ENGINE": s.engine,
            "SKYTRAIN_ENGINE_STARTUP_TIMEOUT_S": s.engine_startup_timeout_s,
            "SKYTRAIN_ENGINE_MAX_LORAS": s.engine_max_loras,
            "SKYTRAIN_ENGINE_MAX_LORA_RANK": s.engine_max_lora_rank,
            "SKYTRAIN_ENGINE_GPU_MEMORY_UTILIZATION": s.engine_gpu_memory_utilization,
            "SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE": s.engine_tensor_parallel_size,
            "SKYTRAIN_ENGINE_MAX_MODEL_LEN": s.engine_max_model_len,
            "SKYTRAIN_WORKER_MAX_MODELS": s.worker_max_models,
        }
        return {key: str(value) for key, value in envs.items() if value is not None}

    def _reconcile(self, session: Session, clusters: list[ClusterInfo]) -> None:
        """Bring worker rows in line with what the provider reports."""
        assert self.provider is not None
        known = {c.worker_id: c for c in clusters}
        for info in clusters:
            worker = session.get(Worker, info.worker_id)
            if worker is None or worker.status in worker_rows.ENDED_STATUSES:
                if info.state in ("launching", "up"):
                    logger.warning("stopping unknown cluster %s", info.cluster_name)
                    self.provider.terminate(info.cluster_name)
                continue
            if info.state == "failed":
                # A worker that never registered failed to start (no retry for a while); one
                # that ran and died is lost, and a replacement is started at once.
                status = "lost" if worker.last_heartbeat_at is not None else "failed"
                placement.worker_gone(
                    session, worker=worker, status=status, reason=info.message or "failed"
                )
            elif info.state == "gone":
                status = "stopped" if worker.status == "draining" else "lost"
                placement.worker_gone(
                    session, worker=worker, status=status, reason=info.message or "gone"
                )
            elif info.engine_endpoint and worker.engine_endpoint != info.engine_endpoint:
                worker.engine_endpoint = info.engine_endpoint
                session.commit()
            elif info.state == "launching" and info.message != worker.status_message:
                worker.status_message = info.message
                session.commit()
        # Workers the provider lost track of (e.g. the control plane restarted) that never
        # registered are gone; registered ones are judged by their heartbeats.
        cutoff = utcnow() - timedelta(seconds=self.settings.worker_heartbeat_timeout_s)
        for worker in session.scalars(
            select(Worker).where(
                Worker.provider == self.provider.name,
                Worker.status == "provisioning",
                Worker.created_at < cutoff,
            )
        ):
            if worker.id not in known:
                placement.worker_gone(
                    session,
                    worker=worker,
                    status="lost",
                    reason=f"the {self.provider.name} provider no longer knows this worker",
                )

    def _stop_idle(self, session: Session, worker: Worker) -> None:
        logger.info("stopping idle worker %s", worker.id)
        if self.provider is not None and worker.provider == self.provider.name:
            worker.status = "draining"
            session.commit()
            if worker.cluster_name:
                self.provider.terminate(worker.cluster_name)
            placement.worker_gone(session, worker=worker, status="stopped", reason="idle")
        else:
            # A worker started by hand: ask it to drain; it exits at its next heartbeat.
            worker.status = "draining"
            worker.status_message = "idle: asked to drain"
            session.commit()

"""The scheduler loop the control plane runs in the background.

Each pass (about once a second, or at once when woken by a registration, a request or a
job): expire job leases, declare silent workers lost, ask jobs that have had their time slice
to yield their worker to another tenant's waiting job, reconcile with the provider, fail the
workers that will not register (their process ended, or ``worker_register_deadline_s`` went
by: their machines are stopped), take idle models off their workers, place active models
(launching workers when needed, after the back-off of failed launches; at ``max_workers``,
stopping an idle worker to make room), and stop idle workers. Every ``sweep_interval_s`` it
also removes the files of deleted checkpoints that are still there, and every
``garbage_interval_s`` the objects no row refers to (``garbage``). A pass runs in a thread
with its own session; nothing in it blocks API requests.

Several control-plane processes may share one database: every one runs this loop, but only
the leader (``scheduler.leader``) runs passes. The others follow: they try to take the
leadership at every pass and never provision, expire leases or stop workers meanwhile.
Leadership changes are logged.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import timedelta

from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Worker, utcnow
from skytrain_backend.errors import FitsNoGpu, ModelConfigUnavailable
from skytrain_backend.provision.base import ClusterInfo, Provider, WorkerLaunch
from skytrain_backend.scheduler import garbage, placement, queue, ranks, replicas, scale_in
from skytrain_backend.scheduler.demand import DemandMeter
from skytrain_backend.scheduler.leader import Leadership, SoleLeadership, process_name
from skytrain_backend.scheduler.model_configs import ModelConfigs, hub_endpoint
from skytrain_backend.scheduler.placement import LaunchBackoff
from skytrain_backend.scheduler.tinker import runs as tinker_runs
from skytrain_backend.storage import ObjectStore

logger = logging.getLogger(__name__)


class Scheduler:
    """Owns the provider and runs the scheduling passes while this process leads.

    ``leadership`` decides whether it leads (default: always, the only scheduler).
    """

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        provider: Provider | None,
        leadership: Leadership | None = None,
        store: ObjectStore | None = None,
        interval_s: float = 1.0,
    ) -> None:
        self.settings = settings
        self.provider = provider
        self.is_leader = False
        self._leadership = leadership or SoleLeadership()
        # Where the sweeps remove objects no row refers to any more (None: no sweeping).
        self.store = store
        # Base models' config.json for the memory plan: the routes plan a model's creation
        # with it, and each launch before it goes.
        self.configs = ModelConfigs(settings, store)
        self._next_sweep = 0.0
        self._next_garbage = 0.0
        # Not at start: on an S3-compatible store that reports a wrong start time (moto: a
        # fixed one in 2010), a batch streaming in as this process starts would look stale.
        self._next_upload_sweep = time.monotonic() + settings.scheduler.garbage_interval_s
        self._sessions = sessions
        self._interval_s = interval_s
        self._backoff = LaunchBackoff(
            base_s=settings.scheduler.worker_launch_backoff_s,
            max_s=settings.scheduler.worker_launch_backoff_max_s,
            max_failures=settings.scheduler.worker_launch_max_failures,
        )
        self._role_logged = False
        # Requests in flight per model, counted by this process's gateway: the replica
        # policy's demand (replicas.py).
        self.demand = DemandMeter()
        self._replica_policy = replicas.ScalePolicy(
            window_s=settings.scheduler.replica_window_s,
            scale_out_in_flight=settings.scheduler.replica_scale_out_in_flight,
            scale_in_in_flight=settings.scheduler.replica_scale_in_in_flight,
            cooldown_s=settings.scheduler.replica_cooldown_s,
        )
        # Held by a pass: shutting down waits for one still running in its thread.
        self._pass_lock = threading.Lock()
        # Told the id of each worker that ended (the gateway closes its connection to it);
        # called from the scheduler's thread.
        self.on_worker_gone: Callable[[str], None] = lambda worker_id: None
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
        await asyncio.to_thread(self._shut_down)

    def _shut_down(self) -> None:
        """Stop the provider's own workers, then give the leadership up."""
        with self._pass_lock:
            if self.provider is not None:
                self._record_stopped(self.provider.close(), "the control plane stopped")
            self._leadership.release()
            if self.is_leader:
                logger.info("scheduler: %s stopped leading", process_name())
                self.is_leader = False

    def _record_stopped(self, worker_ids: list[str], reason: str) -> None:
        """Workers that ended with a control plane: their models are free, their running
        jobs go back to the queue (or end, if cancelled) for the next start to hand out."""
        with self._sessions() as session:
            for worker_id in worker_ids:
                worker = session.get(Worker, worker_id)
                if worker is not None and worker.status in worker_rows.LIVE_STATUSES:
                    self._worker_gone(session, worker=worker, status="stopped", reason=reason)

    def _worker_gone(self, session: Session, *, worker: Worker, status: str, reason: str) -> None:
        placement.worker_gone(
            session, worker=worker, status=status, reason=reason, backoff=self._backoff
        )
        self.on_worker_gone(worker.id)

    def _failed_start(self, session: Session, *, worker: Worker, reason: str) -> None:
        """A launched worker that will never register: its machine stopped, its launch
        counted as failed."""
        assert self.provider is not None
        if worker.cluster_name:
            self.provider.terminate(worker.cluster_name)
        self._worker_gone(session, worker=worker, status="failed", reason=reason)

    def wake(self) -> None:
        """Run a pass soon; safe to call from any thread."""
        if self._loop is not None and self._wake is not None:
            self._loop.call_soon_threadsafe(self._wake.set)

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await asyncio.to_thread(self.run_pass)
            except Exception:
                logger.exception("scheduler pass failed; trying again")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self._interval_s)

    def run_pass(self) -> bool:
        """Take or keep the leadership, then run a pass if this process leads; whether it
        leads."""
        with self._pass_lock:
            return self._run_pass()

    def _run_pass(self) -> bool:
        leading = self._leadership.hold()
        if leading != self.is_leader or not self._role_logged:
            self._role_logged = True
            if leading:
                logger.info("scheduler: %s is the leader; it runs the passes", process_name())
            elif self.is_leader:
                logger.warning(
                    "scheduler: %s lost the leadership (its database connection broke); "
                    "another process takes over",
                    process_name(),
                )
            else:
                logger.info(
                    "scheduler: %s follows; another process leads (it takes over if that "
                    "one stops)",
                    process_name(),
                )
            self.is_leader = leading
        if leading:
            self.tick()
        return leading

    def tick(self) -> None:
        """One scheduling pass (whoever calls it acts: ``run_pass`` checks leadership)."""
        s = self.settings
        with self._sessions() as session:
            queue.expire_leases(session)
            tinker_runs.expire_sessions(session, timeout_s=s.tinker.session_timeout_s)
            for worker in worker_rows.silent_workers(
                session, timeout_s=s.scheduler.worker_heartbeat_timeout_s
            ):
                drained = worker.status == "draining"
                self._worker_gone(
                    session,
                    worker=worker,
                    status="stopped" if drained else "lost",
                    reason="drained"
                    if drained
                    else f"no heartbeat for {s.scheduler.worker_heartbeat_timeout_s:.0f}s",
                )
            queue.request_yields(session, slice_s=s.scheduler.job_time_slice_s)
            if self.provider is not None:
                self._reconcile(session, self.provider.poll())
                self._fail_unregistered(session)
            # Idle models leave first, so the models waiting for their places get them now.
            placement.release_idle_models(
                session, idle_timeout_s=s.scheduler.resolved_model_idle_timeout_s
            )
            held_back = placement.place_models(
                session,
                idle_timeout_s=s.scheduler.resolved_model_idle_timeout_s,
                max_workers=s.scheduler.max_workers,
                launch=(lambda base: self._launch(session, base)) if self.provider else None,
                limits=tenants.limits_by_id(session, s),
            )
            # Replicas follow each placed model's demand (after placement: homes first, and
            # none added where a model still waits for a slot).
            limits = tenants.limits_by_id(session, s)
            replicas.scale(
                session,
                demand=self.demand,
                policy=self._replica_policy,
                limits=limits,
                max_workers=s.scheduler.max_workers,
                launch=(lambda base: self._launch(session, base)) if self.provider else None,
                waiting=placement.bases_waiting_for_a_slot(
                    session, idle_timeout_s=s.scheduler.resolved_model_idle_timeout_s, limits=limits
                ),
            )
            # At max_workers, a model that needs a worker does not wait for idle ones to time
            # out: they stop now, and a later pass launches its worker in their place.
            for worker, reason in scale_in.make_room(
                session,
                held_back=held_back,
                idle_timeout_s=s.scheduler.resolved_model_idle_timeout_s,
                max_workers=s.scheduler.max_workers,
            ):
                self._stop_drained(session, worker, reason=reason)
            for worker in scale_in.idle_workers(
                session, idle_timeout_s=s.scheduler.worker_idle_timeout_s
            ):
                self._stop_idle(session, worker)
            if time.monotonic() >= self._next_sweep:
                self._next_sweep = time.monotonic() + s.scheduler.sweep_interval_s
                garbage.prune_model_events(session, keep=s.scheduler.model_events_kept)
                if self.store is not None:
                    garbage.purge_deleted_checkpoints(session, store=self.store)
            if self.store is not None and time.monotonic() >= self._next_garbage:
                self._next_garbage = time.monotonic() + s.scheduler.garbage_interval_s
                garbage.collect_garbage(
                    session,
                    store=self.store,
                    written_before=utcnow() - timedelta(seconds=s.scheduler.garbage_grace_s),
                    hub_endpoint=hub_endpoint(s),
                )
            if self.store is not None and time.monotonic() >= self._next_upload_sweep:
                self._next_upload_sweep = time.monotonic() + s.scheduler.garbage_interval_s
                garbage.abort_stale_uploads(
                    self.store, started_before=utcnow() - garbage.STALE_UPLOAD_AGE
                )

    def _launch(self, session: Session, base_model: str) -> None:
        assert self.provider is not None
        secret = secrets.token_urlsafe(24)
        lora_rank = self._launch_lora_rank(session, base_model)
        worker, token = worker_rows.create_worker(
            session,
            provider=self.provider.name,
            base_model=base_model,
            max_models=self.settings.worker.max_models,
            engine_secret=secret,
            max_lora_rank=lora_rank,
        )
        session.commit()
        config = None
        try:
            if self.provider.accelerator_choices():
                # The plan picks the GPU: without the base model's config, nothing is launched.
                config = self.configs.get(base_model, fresh=True)
            launch = WorkerLaunch(
                worker_id=worker.id,
                base_model=base_model,
                control_plane_url=self.settings.server.resolved_public_url,
                join_token=token,
                engine_secret=secret,
                envs=self._worker_envs(lora_rank),
                base_model_config=config,
                lora_rank=lora_rank,
            )
            worker.cluster_name = self.provider.launch(launch)
        except (FitsNoGpu, ModelConfigUnavailable) as exc:
            # The plan's refusal, or its missing config: the tenant's status says why (the
            # words are skytrain's own, with no host's details), without a traceback.
            logger.warning("no worker launched for %s: %s", base_model, exc)
            self._worker_gone(
                session,
                worker=worker,
                status="failed",
                reason=f"{placement.NOT_LAUNCHED}{exc.message}",
            )
            return
        except Exception as exc:
            logger.exception("launching a worker for %s failed", base_model)
            self._worker_gone(session, worker=worker, status="failed", reason=str(exc))
            return
        session.commit()
        logger.info("launching worker %s for %s (%s)", worker.id, base_model, worker.cluster_name)

    def _launch_lora_rank(self, session: Session, base_model: str) -> int | None:
        """The LoRA rank a worker for ``base_model`` is planned and started at, where the
        control plane plans (the provider chooses GPUs): the largest of the models it is
        launched for. None elsewhere (a local worker): it loads up to
        SKYTRAIN_ENGINE_MAX_LORA_RANK, as it plans for itself."""
        assert self.provider is not None
        if not self.provider.accelerator_choices():
            return None
        waiting = placement.active_models_without_worker(
            session, idle_timeout_s=self.settings.scheduler.resolved_model_idle_timeout_s
        )
        return ranks.launch_lora_rank(
            (model for model in waiting if model.base_model == base_model),
            largest=self.settings.engine.max_lora_rank,
        )

    def _worker_envs(self, lora_rank: int | None = None) -> dict[str, str]:
        """Settings a worker started by this control plane inherits; ``lora_rank``: the
        largest rank it loads (default: SKYTRAIN_ENGINE_MAX_LORA_RANK)."""
        s = self.settings
        envs: dict[str, str | float | bool | None] = {
            "SKYTRAIN_ENGINE": s.engine.kind,
            "SKYTRAIN_ENGINE_STARTUP_TIMEOUT_S": s.engine.startup_timeout_s,
            "SKYTRAIN_ENGINE_MAX_LORAS": s.engine.max_loras,
            "SKYTRAIN_ENGINE_MAX_LORA_RANK": lora_rank or s.engine.max_lora_rank,
            "SKYTRAIN_ENGINE_GPU_MEMORY_UTILIZATION": s.engine.gpu_memory_utilization,
            "SKYTRAIN_ENGINE_TENSOR_PARALLEL_SIZE": s.engine.tensor_parallel_size,
            "SKYTRAIN_ENGINE_PIPELINE_PARALLEL_SIZE": s.engine.pipeline_parallel_size,
            "SKYTRAIN_ENGINE_MAX_MODEL_LEN": s.engine.max_model_len,
            "SKYTRAIN_ENGINE_SLEEP_WAIT_S": s.engine.sleep_wait_s,
            "SKYTRAIN_ENGINE_SLEEP_TIMEOUT_S": s.engine.sleep_timeout_s,
            "SKYTRAIN_WORKER_MAX_MODELS": s.worker.max_models,
            "SKYTRAIN_WORKER_SLEEP_ENGINE": s.worker.sleep_engine,
            "SKYTRAIN_WORKER_UNLOAD_WAIT_S": s.worker.unload_wait_s,
            "SKYTRAIN_TRAINER_MEMORY_LIMIT_MB": s.trainer.memory_limit_mb,
            "SKYTRAIN_TRAINER_GRADIENT_CHECKPOINTING": s.trainer.gradient_checkpointing,
            "SKYTRAIN_TRAINER_MAX_ROW_TOKENS": s.trainer.max_row_tokens,
            "SKYTRAIN_TRAINER_DEVICE_MAP": s.trainer.device_map,
            "SKYTRAIN_TRAINER_SHARDS": s.trainer.shards,
            "SKYTRAIN_WORKER_TINKER_MAX_RUNS": s.worker.tinker_max_runs,
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
                self._worker_gone(
                    session, worker=worker, status=status, reason=info.message or "failed"
                )
            elif info.state == "gone":
                # Gone before it registered: its start failed (a failed setup autostops).
                if worker.status == "draining":
                    status = "stopped"
                else:
                    status = "lost" if worker.last_heartbeat_at is not None else "failed"
                self._worker_gone(
                    session, worker=worker, status=status, reason=info.message or "gone"
                )
            elif (
                info.state == "up"
                and worker.status == "provisioning"
                and (report := self.provider.startup_report(info.cluster_name)) is not None
                and report.ended
            ):
                self._failed_start(
                    session,
                    worker=worker,
                    reason=f"its process ended before it registered: {report.detail}",
                )
            elif info.engine_endpoint and worker.engine_endpoint != info.engine_endpoint:
                worker.engine_endpoint = info.engine_endpoint
                if worker.status in ("ready", "training", "sleeping"):
                    # Routed to again once its next heartbeat reaches it there.
                    worker.status = "unreachable"
                    worker.status_message = (
                        f"trying the address {self.provider.name} reports for this worker: "
                        f"{info.engine_endpoint}"
                    )
                session.commit()
            elif info.state == "launching" and info.message != worker.status_message:
                worker.status_message = info.message
                session.commit()
        # Workers the provider lost track of (e.g. the control plane restarted) that never
        # registered are gone; registered ones are judged by their heartbeats.
        cutoff = utcnow() - timedelta(seconds=self.settings.scheduler.worker_heartbeat_timeout_s)
        for worker in session.scalars(
            select(Worker).where(
                Worker.provider == self.provider.name,
                Worker.status == "provisioning",
                Worker.created_at < cutoff,
            )
        ):
            if worker.id not in known:
                self._worker_gone(
                    session,
                    worker=worker,
                    status="lost",
                    reason=f"the {self.provider.name} provider no longer knows this worker",
                )

    def _fail_unregistered(self, session: Session) -> None:
        """Workers this provider launched that did not register within the deadline."""
        assert self.provider is not None
        deadline_s = self.settings.scheduler.worker_register_deadline_s
        late = session.scalars(
            select(Worker).where(
                Worker.provider == self.provider.name,
                Worker.status == "provisioning",
                Worker.created_at < utcnow() - timedelta(seconds=deadline_s),
            )
        )
        for worker in list(late):
            reason = (
                f"did not register within {deadline_s:.0f}s of its launch "
                "(SKYTRAIN_WORKER_REGISTER_DEADLINE_S)"
            )
            if worker.cluster_name:
                report = self.provider.startup_report(worker.cluster_name, with_log=True)
                if report is not None:
                    reason += f"; {report.detail}"
            self._failed_start(session, worker=worker, reason=reason)

    def _stop_idle(self, session: Session, worker: Worker) -> None:
        worker.status = "draining"
        session.commit()
        self._stop_drained(session, worker, reason="idle")

    def _stop_drained(self, session: Session, worker: Worker, *, reason: str) -> None:
        """Stop a worker marked draining: its machine, if this control plane's provider
        started it; a worker started by hand is only asked (it exits at its next heartbeat,
        and is recorded stopped when its heartbeats end)."""
        logger.info("stopping worker %s: %s", worker.id, reason)
        if self.provider is not None and worker.provider == self.provider.name:
            if worker.cluster_name:
                self.provider.terminate(worker.cluster_name)
            self._worker_gone(session, worker=worker, status="stopped", reason=reason)
        else:
            worker.status_message = f"{reason}: asked to drain"
            session.commit()

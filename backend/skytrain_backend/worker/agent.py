"""The worker agent: serves the models placed on it and trains them, one job at a time.

Two loops run side by side:

- the heartbeat loop tells the control plane what the engine serves, learns which models (and
  which of their steps) are placed here, keeps the engine's adapters in line with that, and
  restarts the engine if it dies;
- the job loop leases a training job and runs it.

A job on a worker whose engine shares the GPU with the trainer goes in this order, so that
the two never hold the GPU at once:

1. tell the control plane the worker is ``sleeping`` (it stops routing requests here and
   answers 503 with ``Retry-After``), then put the engine to sleep, letting the requests in
   flight finish (``/sleep?mode=wait``), not aborting them;
2. load the trainer onto the memory the engine freed, train, save the checkpoint (the job's
   ``training_started`` event carries the sampler-vs-trainer agreement, so it goes once the
   first step's forward pass has measured it: after that step, or before it when the plan
   measured it already);
3. free the trainer's memory and empty the CUDA cache (vLLM's wake-up maps all of its
   memory again), then wake the engine;
4. load the new adapter from local disk (and check that the engine generates with it) while
   the checkpoint uploads, report the job's timeline (the engine's own log of its control
   calls, and the trainer's events) and only then commit, so a client that sees
   ``training_ended`` gets the new step on its next request. Until the commit the loaded
   step is served to no one; if anything fails before it, the step is unloaded.

A job that fails, out of memory included, is reported and the worker goes on serving: its
trainer is freed and the engine woken (or restarted) whatever happened. Failures a retry
cannot fix (bad config, an adapter the engine refuses, out of memory at the same size) are
reported as not retryable. A worker told to stop (SIGTERM or SIGINT: a scale-down, a spot
instance's notice; or a drain) while it trains stops at the next gradient step and hands the
job back as a retryable failure, so another worker runs it at once rather than after this one
is killed mid-step and its lease runs out. A job that has finished training is still saved and
committed (seconds) before the worker goes.

Every change of state goes through the control plane over HTTP (``ControlPlaneClient``).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from skytrain_backend.errors import (
    EngineRefused,
    LeaseLost,
    SkytrainError,
    TrainingError,
)
from skytrain_backend.protocol import (
    Heartbeat,
    LeasedJob,
    ModelConfig,
    RLTrainConfig,
    ServedCheckpoint,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
    WorkerCapacity,
    WorkerRegistration,
    WorkerStatus,
    lora_name,
)
from skytrain_backend.worker.client import LEASE_RETRY_S, ControlPlaneClient, until_stopped
from skytrain_backend.worker.tinker import TinkerExecutor

if TYPE_CHECKING:
    from skytrain_backend.engine.client import EngineClient
    from skytrain_backend.trainer import RLPlan, SFTPlan, Trainer

logger = logging.getLogger(__name__)

BatchItem = TypeVar("BatchItem", Trajectory, TrajectoryGroup)

ENGINE_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class EngineProcess(Protocol):
    """The engine subprocess the agent supervises."""

    def is_alive(self) -> bool: ...

    async def restart(self) -> None: ...

    def log_tail(self) -> str: ...


class _JobCancelled(SkytrainError):
    """The user cancelled the job while it ran."""


class _WorkerStopping(SkytrainError):
    """The worker was told to stop while a job trained."""


@dataclass
class _Placement:
    model_id: str
    latest_step: int
    steps: list[int]
    model_config: ModelConfig


@dataclass
class _RunningJob:
    id: str
    model_id: str
    attempt: int
    started_at: float = field(default_factory=time.time)
    cancelled: bool = False
    lease_lost: bool = False
    started_reported: bool = False  # its training_started event was sent
    # The job's trainer while it holds memory; freed (or cached) when the job ends.
    trainer: Trainer | None = None
    # The trainer freed after a failure, whose events the failure's timeline reports.
    released_trainer: Trainer | None = None


@dataclass(frozen=True)
class _Failure:
    message: str
    retryable: bool = False
    cancelled: bool = False


@dataclass
class AgentOptions:
    base_model: str
    served_model_name: str
    work_dir: Path
    # The front door: its port and certificate, and its URL when the worker knows it.
    port: int
    certificate: str
    engine_secret: str
    advertise_url: str | None = None
    # Put the engine to sleep while training (an engine sharing the GPU with the trainer).
    sleep_engine_during_training: bool = False
    device: str | None = None
    max_models: int = 8
    # The largest LoRA rank the engine loads (None: any).
    max_lora_rank: int | None = None
    # Most bytes one training step's activations may take (None: the trainer's default).
    trainer_memory_limit_bytes: int | None = None
    hardware: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    # How long one lease request waits on the control plane for a job (a long-poll: a job
    # queued meanwhile is answered at once).
    job_wait_s: float = 30.0
    max_cached_trainers: int = 2
    # Tinker training runs held at once (worker.tinker), beside the job loop.
    tinker_max_runs: int = 2


class WorkerAgent:
    """Runs until ``stop()`` is called or the control plane asks it to drain."""

    def __init__(
        self,
        *,
        control_plane: ControlPlaneClient,
        engine: EngineClient,
        engine_process: EngineProcess | None,
        options: AgentOptions,
    ) -> None:
        self._cp = control_plane
        self._engine = engine
        self._engine_process = engine_process
        self._options = options
        self._placements: dict[str, _Placement] = {}
        self._served: dict[tuple[str, int], Path] = {}
        # Steps loaded into the engine whose checkpoint is not committed yet: never reported
        # as served (see _train_and_commit).
        self._trainers: dict[str, tuple[int, Trainer]] = {}
        self._engine_lock = asyncio.Lock()
        # True from the moment the engine is told to sleep until it is awake again.
        self._engine_asleep = False
        self._job: _RunningJob | None = None
        self._stopping = asyncio.Event()
        self.worker_id: str | None = None
        self._heartbeat_interval_s = 2.0
        self._lease_s = 60.0
        self._tinker = TinkerExecutor(
            control_plane=control_plane,
            adapters=self,
            work_dir=options.work_dir,
            device=options.device,
            max_runs=options.tinker_max_runs,
            wait_s=options.job_wait_s,
        )

    # --- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        options = self._options
        registered = await self._cp.register(
            WorkerRegistration(
                base_model=options.base_model,
                served_model_name=options.served_model_name,
                engine_secret=options.engine_secret,
                port=options.port,
                certificate=options.certificate,
                advertise_url=options.advertise_url,
                capacity=WorkerCapacity(
                    max_models=options.max_models, max_lora_rank=options.max_lora_rank
                ),
                hardware=options.hardware,
                version=options.version,
            )
        )
        self.worker_id = registered.worker_id
        self._heartbeat_interval_s = registered.heartbeat_interval_s
        self._lease_s = registered.lease_s
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
        self._tinker.lease_s = self._lease_s
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

    # --- heartbeat and adapters ----------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._supervise_engine()
                await self._send_heartbeat()
                await self._sync_adapters()
            except Exception:
                logger.exception("heartbeat failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._heartbeat_interval_s)

    def _status(self) -> WorkerStatus:
        if self._stopping.is_set():
            return "draining"
        if self._engine_asleep:
            return "sleeping"
        return "training" if self._job else "ready"

    async def _send_heartbeat(self) -> None:
        """Tell the control plane what the worker does and serves; learn its placements."""
        job = self._job
        # A step loaded but not committed yet is reported too: the control plane routes to
        # committed steps only, and a heartbeat built just before the commit but read after
        # it must not take the new step out of the served list the commit just wrote.
        served = [ServedCheckpoint(model_id=m, step=s) for (m, s) in self._served]
        served += [ServedCheckpoint(model_id=m, step=0) for m in self._placements]
        answer = await self._cp.heartbeat(
            Heartbeat(status=self._status(), served=served, job_id=job.id if job else None)
        )
        self._placements = {
            item.model_id: _Placement(
                model_id=item.model_id,
                latest_step=item.latest_step,
                steps=item.steps,
                model_config=item.model_config_,
            )
            for item in answer.models
        }
        if job is not None and job.id in answer.cancel_job_ids:
            job.cancelled = True
        if answer.drain:
            logger.info("the control plane asked this worker to drain")
            self.stop()

    async def _supervise_engine(self) -> None:
        process = self._engine_process
        if process is None or process.is_alive():
            return
        logger.error("the engine died; restarting it. Its last lines:\n%s", process.log_tail())
        async with self._engine_lock:
            await self._restart_engine(process)

    async def _restart_engine(self, process: EngineProcess) -> None:
        """Start the engine again (under the engine lock): it comes back awake, serving the
        base model only; the heartbeat loads the adapters again."""
        self._served.clear()
        await process.restart()
        self._engine_asleep = False

    async def _sync_adapters(self) -> None:
        """Load the checkpoints placed here into the engine; unload those no longer wanted."""
        if self._engine_asleep:
            return
        wanted = {(p.model_id, s) for p in self._placements.values() for s in p.steps if s > 0}
        for key in sorted(wanted - set(self._served)):
            try:
                directory = await self._fetch_checkpoint(*key, ENGINE_ADAPTER_FILES)
                async with self._engine_lock:
                    if self._engine_asleep:
                        return
                    await self._engine.load_lora(lora_name(*key), str(directory))
                    self._served[key] = directory
                logger.info("serving %s step %d", *key)
            except Exception:
                logger.exception("could not load %s step %d into the engine", *key)
        for key in sorted(set(self._served) - wanted):
            if self._job is not None and key[0] == self._job.model_id:
                continue  # its new step is being committed right now
            async with self._engine_lock:
                with contextlib.suppress(Exception):
                    await self._engine.unload_lora(lora_name(*key))
                self._served.pop(key, None)

    async def serve_checkpoint(self, model_id: str, step: int, directory: Path) -> bool:
        """Load a checkpoint written on this worker into the engine (the Tinker executor's
        sampler saves); False while the engine sleeps (the heartbeat loads it on waking)."""
        if self._engine_asleep:
            return False
        name = lora_name(model_id, step)
        async with self._engine_lock:
            await self._engine.load_lora(name, str(directory))
            self._served[(model_id, step)] = directory
        if not await self._engine.is_serving(name):
            raise SkytrainError(f"the engine does not serve {name} after loading it")
        return True

    async def _fetch_checkpoint(
        self, model_id: str, step: int, names: tuple[str, ...] | None = None
    ) -> Path:
        """A local copy of a checkpoint's files (downloaded once, kept in the work dir)."""
        directory = self._options.work_dir / "checkpoints" / model_id / str(step)
        if names is None:
            listing = await self._cp.list_checkpoint_files(model_id, step)
            names = tuple(item["name"] for item in listing)
        for name in names:
            if not (directory / name).is_file():
                await self._cp.download_checkpoint_file(model_id, step, name, directory / name)
        return directory

    # --- jobs ----------------------------------------------------------------------------------

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
                await self._run_job(job)

    async def _run_job(self, job: LeasedJob) -> None:
        running = _RunningJob(id=job.id, model_id=job.model_id, attempt=job.attempt)
        self._job = running
        renew = asyncio.create_task(self._renew_loop(running), name=f"renew-{running.id}")
        logger.info("job %s (attempt %d): %s", running.id, running.attempt, job.kind)
        try:
            failure = await self._attempt(job, running)
            # Recovered first, so the failure's timeline shows the trainer freed and the
            # engine awake again; the lease is still renewed meanwhile.
            await self._recover(running)
            if failure is not None:
                await self._report_failure(running, failure)
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            self._job = None
            shutil.rmtree(self._options.work_dir / "jobs" / running.id, ignore_errors=True)

    async def _attempt(self, job: LeasedJob, running: _RunningJob) -> _Failure | None:
        """Run the job; what to report if it failed (None when it committed or was lost)."""
        try:
            await self._train_and_commit(job, running)
        except LeaseLost as exc:
            logger.warning("job %s: lease lost (%s); its result is discarded", running.id, exc)
            self._trainers.pop(job.model_id, None)
        except _JobCancelled:
            logger.info("job %s cancelled", running.id)
            return _Failure("cancelled by the user", cancelled=True)
        except _WorkerStopping as exc:
            logger.info("job %s: %s", running.id, exc)
            return _Failure(str(exc), retryable=True)
        except (TrainingError, EngineRefused, ValueError) as exc:
            # Bad data or config, an adapter the engine refuses, out of memory: the same job
            # would fail the same way again.
            logger.warning("job %s failed: %s", running.id, exc)
            return _Failure(str(exc))
        except Exception as exc:
            if self._stopping.is_set():  # a call to a control plane that is gone, most likely
                logger.info("job %s ended with the worker: %s", running.id, exc)
                return _Failure(f"the worker was stopped while the job ran: {exc}", retryable=True)
            if type(exc).__name__ == "OutOfMemoryError":  # torch's, raised outside the trainer
                logger.warning("job %s ran out of memory: %s", running.id, exc)
                return _Failure(f"out of memory: {exc}")
            logger.exception("job %s failed unexpectedly", running.id)
            return _Failure(f"{type(exc).__name__}: {exc}", retryable=True)
        return None

    async def _recover(self, running: _RunningJob) -> None:
        """After a job, whatever became of it: no trainer left holding memory, the engine
        awake (restarted if it will not wake), the control plane told."""
        trainer, running.trainer = running.trainer, None
        if trainer is not None:
            running.released_trainer = trainer
            self._trainers.pop(running.model_id, None)
            try:
                await asyncio.to_thread(trainer.release)
            except Exception:
                logger.exception("freeing the trainer of job %s failed", running.id)
        try:
            await self._wake_engine()
        except Exception:
            logger.exception("the engine did not wake up after job %s; restarting it", running.id)
            if self._engine_process is not None:
                async with self._engine_lock:
                    await self._restart_engine(self._engine_process)
        with contextlib.suppress(Exception):
            await self._send_heartbeat()

    async def _report_failure(self, running: _RunningJob, failure: _Failure) -> None:
        try:
            await self._report_timeline(running)
            await self._cp.fail(
                running.id,
                attempt=running.attempt,
                error_message=failure.message,
                retryable=failure.retryable,
                cancelled=failure.cancelled,
            )
        except LeaseLost:
            pass
        except Exception:
            logger.exception("could not report the failure of job %s", running.id)

    async def _renew_loop(self, running: _RunningJob) -> None:
        while True:
            await asyncio.sleep(max(self._lease_s / 3, 0.5))
            try:
                answer = await self._cp.renew(running.id, attempt=running.attempt)
            except LeaseLost:
                running.lease_lost = True
                return
            except Exception:
                logger.exception("renewing the lease of job %s failed", running.id)
                continue
            if answer.cancel_requested:
                running.cancelled = True

    def _check(self, running: _RunningJob, *, training: bool = False) -> None:
        """Raise if the job is no longer this worker's to finish: its lease lost, a cancel,
        or (``training``: before a gradient step, not once training is done) a stop."""
        if running.lease_lost:
            raise LeaseLost(f"job {running.id} was leased to another worker")
        if running.cancelled:
            raise _JobCancelled(f"job {running.id} was cancelled")
        if training and self._stopping.is_set():
            raise _WorkerStopping(
                "the worker was stopped while the job trained; the job goes back to the queue"
            )

    async def _train_and_commit(self, job: LeasedJob, running: _RunningJob) -> None:
        model_id = job.model_id
        step = job.step  # base_step + 1 unless newer steps were deleted
        job_dir = self._options.work_dir / "jobs" / running.id
        times: dict[str, float] = {}  # time/<phase>_s, reported with the result
        # Downloads first: they need the network, not the GPU the engine still holds.
        with _timed(times, "download"):
            batch_path = await self._cp.download_input(running.id, job_dir / "input.jsonl")
            base_dir = (
                None
                if job.base_step == 0
                else await self._fetch_checkpoint(model_id, job.base_step)
            )
        self._check(running, training=True)

        await self._sleep_engine()
        trainer = await self._trainer_for(model_id, job.base_step, job.model_config_, base_dir)
        running.trainer = trainer
        started = time.monotonic()
        # Parsing, tokenizing and packing a large batch takes a while: all off the event loop.
        plan: RLPlan | SFTPlan
        with _timed(times, "prepare"):
            if job.kind == "sft":
                trajectories = await asyncio.to_thread(_read_batch, batch_path, Trajectory)
                sft_config = SFTTrainConfig.model_validate(job.config or {})
                plan = await asyncio.to_thread(trainer.prepare_sft, trajectories, sft_config)
                num_trajectories = len(trajectories)
            else:
                groups = await asyncio.to_thread(_read_batch, batch_path, TrajectoryGroup)
                rl_config = RLTrainConfig.model_validate(job.config or {})
                plan = await asyncio.to_thread(trainer.prepare_rl, groups, rl_config)
                num_trajectories = sum(len(g.trajectories) for g in groups)
        # training_started carries the sampler-vs-trainer agreement: sent now when the plan has
        # it, else once the first step (whose forward pass measures it) is done.
        report_started = functools.partial(
            self._report_started, running, plan, step=step, num_trajectories=num_trajectories
        )
        step_metrics: list[dict[str, float]] = []
        iterator: Iterator[dict[str, float]] = trainer.run(plan)
        with _timed(times, "steps"):
            try:
                if not plan.agreement_pending:
                    await report_started()
                while (metrics := await asyncio.to_thread(next, iterator, None)) is not None:
                    await report_started()
                    step_metrics.append(metrics)
                    self._check(running, training=len(step_metrics) < plan.num_gradient_steps)
                    await self._cp.event(
                        running.id, attempt=running.attempt, type="gradient_step", data=metrics
                    )
            except Exception:
                # A job that fails in its first step has started all the same (without the
                # agreement when it failed before its forward pass measured it).
                with contextlib.suppress(Exception):
                    await report_started()
                raise
        self._check(running)

        checkpoint_dir = self._options.work_dir / "checkpoints" / model_id / str(step)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        trainer.step = step
        with _timed(times, "save"):
            await asyncio.to_thread(trainer.save, checkpoint_dir)
        files = sorted(p for p in checkpoint_dir.iterdir() if p.is_file())
        await self._put_trainer_away(running, model_id, step)
        await self._wake_engine()

        # The hand-off (docs/operators.md, "When a new step is served"): the engine loads
        # the new adapter from this disk while its files go up to the object store. Loaded is
        # not served: until the checkpoint row is committed the control plane routes nothing
        # to the step (it routes to committed steps only). If the upload, the load or the
        # commit fails, the step is unloaded here and never served to anyone.
        key = (model_id, step)
        try:
            with _timed(times, "handoff"):
                await _both(
                    self._load_new_step(key, checkpoint_dir, times),
                    self._upload(running, files, times),
                )
            self._check(running)
            await self._report_timeline(running, trainer)
            summary = {**_mean_metrics(step_metrics), **_floats(plan.summary), **times}
            summary["time/training_s"] = time.monotonic() - started
            await self._cp.complete(
                running.id, attempt=running.attempt, step=step, metrics=summary, files=files
            )
        except BaseException:
            # Not committed (lease lost, store failure...): the step must not stay loaded, or
            # the job's next attempt could not load its own result under the same name.
            await self._unload(key)
            self._trainers.pop(model_id, None)
            raise
        logger.info("job %s committed step %d of model %s", running.id, step, model_id)

    async def _report_started(
        self, running: _RunningJob, plan: RLPlan | SFTPlan, *, step: int, num_trajectories: int
    ) -> None:
        """Send the job's ``training_started`` event, once."""
        if running.started_reported:
            return
        running.started_reported = True
        if plan.warning:
            logger.warning("job %s: %s", running.id, plan.warning)
        await self._cp.event(
            running.id,
            attempt=running.attempt,
            type="training_started",
            data={
                "num_sequences": plan.num_gradient_steps,
                "num_gradient_steps": plan.num_gradient_steps,
                "num_trajectories": num_trajectories,
                "attempt": running.attempt,
                "step": step,
                **_agreement(plan.summary),
                **({"warning": plan.warning} if plan.warning else {}),
            },
        )

    async def _load_new_step(
        self, key: tuple[str, int], directory: Path, times: dict[str, float]
    ) -> None:
        """Load a step just trained into the engine and check that it generates with it."""
        name = lora_name(*key)
        with _timed(times, "engine_load"):
            async with self._engine_lock:
                await self._engine.load_lora(name, str(directory))
                self._served[key] = directory
            if not await self._engine.is_serving(name):
                raise SkytrainError(f"the engine does not serve {name} after loading it")
            await self._engine.check_generates(name)

    async def _upload(
        self, running: _RunningJob, files: list[Path], times: dict[str, float]
    ) -> None:
        with _timed(times, "upload"):
            for path in files:
                await self._cp.upload_file(running.id, path, attempt=running.attempt)

    async def _unload(self, key: tuple[str, int]) -> None:
        """Take a step out of the engine (quietly: an engine that died has dropped it)."""
        async with self._engine_lock:
            with contextlib.suppress(Exception):
                await self._engine.unload_lora(lora_name(*key))
            self._served.pop(key, None)

    async def _trainer_for(
        self, model_id: str, step: int, model_config: ModelConfig, adapter_dir: Path | None
    ) -> Trainer:
        """The model's trainer at ``step``: cached from its last job, or loaded from storage."""
        cached = self._trainers.pop(model_id, None)
        if cached is not None and cached[0] == step:
            return cached[1]
        if cached is not None:
            await asyncio.to_thread(cached[1].release)
        from skytrain_backend.trainer import Trainer

        return await asyncio.to_thread(
            Trainer.load,
            self._options.base_model,
            model_config=model_config,
            adapter_dir=adapter_dir,
            device=self._options.device,
            activation_memory_limit_bytes=self._options.trainer_memory_limit_bytes,
        )

    async def _put_trainer_away(self, running: _RunningJob, model_id: str, step: int) -> None:
        """After saving: a trainer that shares the GPU with the engine is freed (the next job
        loads it again from the checkpoint just written); otherwise it is kept for the next
        job of its model."""
        trainer, running.trainer = running.trainer, None
        if trainer is None:
            return
        if self._options.sleep_engine_during_training:
            await asyncio.to_thread(trainer.release)
            return
        self._trainers[model_id] = (step, trainer)
        while len(self._trainers) > self._options.max_cached_trainers:
            _, evicted = self._trainers.pop(next(iter(self._trainers)))
            await asyncio.to_thread(evicted.release)

    async def _report_timeline(self, running: _RunningJob, trainer: Trainer | None = None) -> None:
        """The job's ``job_timeline`` event: what the engine and the trainer recorded of it."""
        trainer = trainer or running.trainer or running.released_trainer
        engine_log = None
        with contextlib.suppress(Exception):
            engine_log = await self._engine.control_log()
        since = running.started_at
        data = {
            "engine": None
            if engine_log is None
            else [entry for entry in engine_log if entry["at"] >= since],
            "trainer": []
            if trainer is None
            else [entry for entry in trainer.events if entry["at"] >= since],
        }
        await self._cp.event(running.id, attempt=running.attempt, type="job_timeline", data=data)

    async def _sleep_engine(self) -> None:
        """Stop routing here, then sleep the engine once its requests in flight finished."""
        if not self._options.sleep_engine_during_training or self._engine_asleep:
            return
        async with self._engine_lock:
            self._engine_asleep = True
            try:
                await self._send_heartbeat()
            except Exception:
                logger.exception("could not tell the control plane the engine sleeps")
            await self._engine.sleep(mode="wait")

    async def _wake_engine(self) -> None:
        if not self._engine_asleep:
            return
        async with self._engine_lock:
            await self._engine.wake_up()
            self._engine_asleep = False


async def _both(first: Awaitable[None], second: Awaitable[None]) -> None:
    """Run both at once; the first failure cancels the other and is raised."""
    tasks = [asyncio.ensure_future(first), asyncio.ensure_future(second)]
    try:
        done, _ = await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        for task in done:
            if task.exception() is not None:
                raise task.exception()  # type: ignore[misc]
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


@contextlib.contextmanager
def _timed(times: dict[str, float], phase: str) -> Iterator[None]:
    """Record how long the block took as ``times["time/<phase>_s"]``."""
    start = time.monotonic()
    yield
    times[f"time/{phase}_s"] = time.monotonic() - start


def _read_batch(path: Path, kind: type[BatchItem]) -> list[BatchItem]:
    """A stored batch: one JSON object of ``kind`` per line."""
    with open(path) as handle:
        return [kind.model_validate(json.loads(line)) for line in handle if line.strip()]


def _agreement(summary: dict[str, float]) -> dict[str, float]:
    """What the job measured of sampler-vs-trainer logprobs before its first update."""
    return {
        key: value
        for key, value in summary.items()
        if key.startswith("logprob_agreement/") or key == "tokens/without_sampling_logprob"
    }


def _floats(values: dict[str, Any]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}


def _mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {key for metrics in steps for key in metrics}
    return {
        key: sum(m[key] for m in steps if key in m) / sum(1 for m in steps if key in m)
        for key in sorted(keys)
    }

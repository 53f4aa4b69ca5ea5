"""The worker agent: serves the models placed on it and trains them, one job at a time.

Two loops run side by side:

- the heartbeat loop tells the control plane what the engine serves, learns which models (and
  which of their steps) are placed here, keeps the engine's adapters in line with that, and
  restarts the engine if it dies;
- the job loop leases a training job, trains it with the trainer library, uploads the new
  checkpoint, hot-loads it into the engine, verifies it is served, and only then commits it,
  so a client that sees ``training_ended`` gets the new step on its next request.

Every change of state goes through the control plane over HTTP (``ControlPlaneClient``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypeVar

from skytrain_backend.errors import SkytrainError, TrainingError
from skytrain_backend.protocol import (
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    Trajectory,
    TrajectoryGroup,
    lora_name,
)
from skytrain_backend.worker.client import ControlPlaneClient, LeaseLost

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
    cancelled: bool = False
    lease_lost: bool = False


@dataclass
class AgentOptions:
    base_model: str
    served_model_name: str
    work_dir: Path
    engine_endpoint: str
    engine_secret: str
    # Put the engine to sleep while training (an engine sharing the GPU with the trainer).
    sleep_engine_during_training: bool = False
    device: str | None = None
    max_models: int = 8
    hardware: dict[str, Any] = field(default_factory=dict)
    version: str = ""
    job_poll_interval_s: float = 1.0
    max_cached_trainers: int = 2


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
        self._trainers: dict[str, tuple[int, Trainer]] = {}
        self._engine_lock = asyncio.Lock()
        self._engine_asleep = False
        self._job: _RunningJob | None = None
        self._stopping = asyncio.Event()
        self.worker_id: str | None = None
        self._heartbeat_interval_s = 2.0
        self._lease_s = 60.0

    # --- lifecycle -----------------------------------------------------------------------------

    async def run(self) -> None:
        registered = await self._cp.register(
            {
                "base_model": self._options.base_model,
                "served_model_name": self._options.served_model_name,
                "engine_endpoint": self._options.engine_endpoint,
                "engine_secret": self._options.engine_secret,
                "capacity": {"max_models": self._options.max_models},
                "hardware": self._options.hardware,
                "version": self._options.version,
            }
        )
        self.worker_id = registered["worker_id"]
        self._heartbeat_interval_s = float(registered.get("heartbeat_interval_s", 2.0))
        self._lease_s = float(registered.get("lease_s", 60.0))
        logger.info("registered as worker %s for %s", self.worker_id, self._options.base_model)
        heartbeat = asyncio.create_task(self._heartbeat_loop(), name="heartbeat")
        try:
            await self._job_loop()
        finally:
            heartbeat.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await heartbeat

    def stop(self) -> None:
        self._stopping.set()

    # --- heartbeat and adapters ----------------------------------------------------------------

    async def _heartbeat_loop(self) -> None:
        while not self._stopping.is_set():
            try:
                await self._heartbeat_once()
            except Exception:
                logger.exception("heartbeat failed; retrying")
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._heartbeat_interval_s)

    async def _heartbeat_once(self) -> None:
        await self._supervise_engine()
        job = self._job
        status = "training" if job else "ready"
        if self._stopping.is_set():
            status = "draining"
        answer = await self._cp.heartbeat(
            {
                "status": status,
                "served": [{"model_id": m, "step": s} for (m, s) in self._served]
                + [{"model_id": m, "step": 0} for m in self._placements],
                "job_id": job.id if job else None,
            }
        )
        self._placements = {
            item["model_id"]: _Placement(
                model_id=item["model_id"],
                latest_step=int(item["latest_step"]),
                steps=[int(s) for s in item["steps"]],
                model_config=ModelConfig.model_validate(item.get("model_config") or {}),
            )
            for item in answer.get("models", [])
        }
        if job is not None and job.id in answer.get("cancel_job_ids", []):
            job.cancelled = True
        if answer.get("drain"):
            logger.info("the control plane asked this worker to drain")
            self.stop()
        await self._sync_adapters()

    async def _supervise_engine(self) -> None:
        process = self._engine_process
        if process is None or process.is_alive():
            return
        logger.error("the engine died; restarting it. Its last lines:\n%s", process.log_tail())
        async with self._engine_lock:
            self._served.clear()
            await process.restart()

    async def _sync_adapters(self) -> None:
        """Load the checkpoints placed here into the engine; unload those no longer wanted."""
        if self._engine_asleep:
            return
        wanted = {(p.model_id, s) for p in self._placements.values() for s in p.steps if s > 0}
        for key in sorted(wanted - set(self._served)):
            try:
                directory = await self._fetch_checkpoint(*key, ENGINE_ADAPTER_FILES)
                async with self._engine_lock:
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
                job = await self._cp.lease()
            except Exception:
                logger.exception("leasing a job failed; retrying")
                job = None
            if job is None:
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(self._stopping.wait(), self._options.job_poll_interval_s)
                continue
            await self._run_job(job)

    async def _run_job(self, job: dict[str, Any]) -> None:
        running = _RunningJob(id=job["id"], model_id=job["model_id"], attempt=int(job["attempt"]))
        self._job = running
        renew = asyncio.create_task(self._renew_loop(running), name=f"renew-{running.id}")
        logger.info("job %s (attempt %d): %s", running.id, running.attempt, job["kind"])
        try:
            await self._train_and_commit(job, running)
        except LeaseLost as exc:
            logger.warning("job %s: lease lost (%s); its result is discarded", running.id, exc)
            self._trainers.pop(job["model_id"], None)
        except _JobCancelled:
            logger.info("job %s cancelled", running.id)
            self._trainers.pop(job["model_id"], None)
            await self._report_failure(running, "cancelled by the user", cancelled=True)
        except (TrainingError, ValueError) as exc:
            logger.warning("job %s failed: %s", running.id, exc)
            self._trainers.pop(job["model_id"], None)
            await self._report_failure(running, str(exc), retryable=False)
        except Exception as exc:
            logger.exception("job %s failed unexpectedly", running.id)
            self._trainers.pop(job["model_id"], None)
            await self._report_failure(running, f"{type(exc).__name__}: {exc}", retryable=True)
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            await self._wake_engine()
            self._job = None
            shutil.rmtree(self._options.work_dir / "jobs" / running.id, ignore_errors=True)

    async def _report_failure(
        self,
        running: _RunningJob,
        message: str,
        *,
        retryable: bool = False,
        cancelled: bool = False,
    ) -> None:
        try:
            await self._cp.fail(
                running.id,
                attempt=running.attempt,
                error_message=message,
                retryable=retryable,
                cancelled=cancelled,
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
            if answer.get("cancel_requested"):
                running.cancelled = True

    def _check(self, running: _RunningJob) -> None:
        if running.lease_lost:
            raise LeaseLost(f"job {running.id} was leased to another worker")
        if running.cancelled:
            raise _JobCancelled(f"job {running.id} was cancelled")

    async def _train_and_commit(self, job: dict[str, Any], running: _RunningJob) -> None:
        model_id: str = job["model_id"]
        base_step = int(job["base_step"])
        step = base_step + 1
        model_config = ModelConfig.model_validate(job.get("model_config") or {})
        job_dir = self._options.work_dir / "jobs" / running.id
        batch_path = await self._cp.download_input(running.id, job_dir / "input.jsonl")
        trainer = await self._trainer_for(model_id, base_step, model_config)
        self._check(running)

        await self._sleep_engine()
        started = time.monotonic()
        # Parsing, tokenizing and packing a large batch takes a while: all off the event loop.
        plan: RLPlan | SFTPlan
        if job["kind"] == "sft":
            trajectories = await asyncio.to_thread(_read_batch, batch_path, Trajectory)
            sft_config = SFTTrainConfig.model_validate(job.get("config") or {})
            plan = await asyncio.to_thread(trainer.prepare_sft, trajectories, sft_config)
            num_trajectories = len(trajectories)
        else:
            groups = await asyncio.to_thread(_read_batch, batch_path, TrajectoryGroup)
            rl_config = RLTrainConfig.model_validate(job.get("config") or {})
            plan = await asyncio.to_thread(trainer.prepare_rl, groups, rl_config)
            num_trajectories = sum(len(g.trajectories) for g in groups)
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
        step_metrics: list[dict[str, float]] = []
        iterator: Iterator[dict[str, float]] = trainer.run(plan)
        while (metrics := await asyncio.to_thread(next, iterator, None)) is not None:
            self._check(running)
            step_metrics.append(metrics)
            await self._cp.event(
                running.id, attempt=running.attempt, type="gradient_step", data=metrics
            )
        self._check(running)

        checkpoint_dir = self._options.work_dir / "checkpoints" / model_id / str(step)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        await asyncio.to_thread(trainer.save, checkpoint_dir)
        files = sorted(p for p in checkpoint_dir.iterdir() if p.is_file())
        for path in files:
            await self._cp.upload_file(running.id, path, attempt=running.attempt)
        await self._wake_engine()

        name = lora_name(model_id, step)
        async with self._engine_lock:
            await self._engine.load_lora(name, str(checkpoint_dir))
            self._served[(model_id, step)] = checkpoint_dir
        if not await self._engine.is_serving(name):
            raise SkytrainError(f"the engine does not serve {name} after loading it")
        self._check(running)

        summary = {**_mean_metrics(step_metrics), **_floats(plan.summary)}
        summary["time/training_s"] = time.monotonic() - started
        try:
            await self._cp.complete(
                running.id, attempt=running.attempt, step=step, metrics=summary, files=files
            )
        except LeaseLost:
            async with self._engine_lock:
                with contextlib.suppress(Exception):
                    await self._engine.unload_lora(name)
                self._served.pop((model_id, step), None)
            raise
        self._remember_trainer(model_id, step, trainer)
        logger.info("job %s committed step %d of model %s", running.id, step, model_id)

    async def _trainer_for(self, model_id: str, step: int, model_config: ModelConfig) -> Trainer:
        """The model's trainer at ``step``: cached from its last job, or loaded from storage."""
        cached = self._trainers.pop(model_id, None)
        if cached is not None and cached[0] == step:
            return cached[1]
        from skytrain_backend.trainer import Trainer

        adapter_dir = None if step == 0 else await self._fetch_checkpoint(model_id, step)
        return await asyncio.to_thread(
            Trainer.load,
            self._options.base_model,
            model_config=model_config,
            adapter_dir=adapter_dir,
            device=self._options.device,
        )

    def _remember_trainer(self, model_id: str, step: int, trainer: Trainer) -> None:
        self._trainers[model_id] = (step, trainer)
        while len(self._trainers) > self._options.max_cached_trainers:
            self._trainers.pop(next(iter(self._trainers)))

    async def _sleep_engine(self) -> None:
        if not self._options.sleep_engine_during_training or self._engine_asleep:
            return
        async with self._engine_lock:
            await self._engine.sleep()
            self._engine_asleep = True

    async def _wake_engine(self) -> None:
        if not self._engine_asleep:
            return
        async with self._engine_lock:
            await self._engine.wake_up()
            self._engine_asleep = False


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

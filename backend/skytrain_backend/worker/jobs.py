"""A training job on the worker: leased, trained, saved, handed to the engine, committed.

A job on a worker whose engine shares the GPU with the trainer goes in this order, so that
the two never hold the GPU at once:

1. tell the control plane the worker is ``sleeping`` (it stops routing requests here and
   answers 503 with ``Retry-After``), then put the engine to sleep, letting the requests in
   flight finish (``/sleep?mode=wait``) for up to ``engine_sleep_wait_s``, then aborting
   those still running (``mode=abort``): no request holds training up for long;
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

A job asked to yield (another tenant's job waits for this worker and this one has had its time
slice; the answer to each ``gradient_step`` event says so) stops after the step in progress:
the trainer saves the job's state (``Trainer.save_progress``), the GPU goes back to the engine,
the state is uploaded as the attempt's files and the job handed back (``preempt``). The
attempt that leases it next, here or on another worker, downloads that state and resumes
exactly where it stopped, reporting ``training_resumed`` instead of ``training_started``.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import shutil
import time
from collections.abc import Awaitable, Callable, Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from skytrain_backend.errors import (
    EngineRefused,
    LeaseLost,
    SkytrainError,
    TrainingError,
)
from skytrain_backend.protocol import (
    LeasedJob,
    LeasedRLJob,
    LeasedSFTJob,
    LeaseRenewed,
    ModelConfig,
    Trajectory,
    TrajectoryGroup,
    within_off_policy,
)
from skytrain_backend.worker.client import ControlPlaneClient
from skytrain_backend.worker.engine_host import EngineHost
from skytrain_backend.worker.options import AgentOptions

if TYPE_CHECKING:
    from skytrain_backend.trainer import RLPlan, SFTPlan, Trainer

logger = logging.getLogger(__name__)

BatchItem = TypeVar("BatchItem", Trajectory, TrajectoryGroup)


class _JobCancelled(SkytrainError):
    """The user cancelled the job while it ran."""


class _WorkerStopping(SkytrainError):
    """The worker was told to stop while a job trained."""


@dataclass
class _RunningJob:
    id: str
    model_id: str
    attempt: int
    started_at: float = field(default_factory=time.time)
    cancelled: bool = False
    # Another tenant's job waits for this worker: stop at the next step boundary.
    yield_requested: bool = False
    lease_lost: bool = False
    started_reported: bool = False  # its training_started (or training_resumed) was sent
    # The job's trainer while it holds memory; freed (or cached) when the job ends.
    trainer: Trainer | None = None
    # The trainer freed after a failure, whose events the failure's timeline reports.
    released_trainer: Trainer | None = None

    def note(self, answer: LeaseRenewed) -> None:
        """What the control plane asks of the job, from a renewal's or an event's answer."""
        self.cancelled = self.cancelled or answer.cancel_requested
        self.yield_requested = self.yield_requested or answer.yield_requested


@dataclass(frozen=True)
class _Failure:
    message: str
    retryable: bool = False
    cancelled: bool = False


class JobRunner:
    """Runs the jobs the agent leases, one at a time, and caches their trainers."""

    def __init__(
        self,
        *,
        control_plane: ControlPlaneClient,
        host: EngineHost,
        options: AgentOptions,
        stopping: asyncio.Event,
        heartbeat: Callable[[], Awaitable[None]],
    ) -> None:
        self._cp = control_plane
        self._host = host
        self._options = options
        self._stopping = stopping
        # Tells the control plane the worker's state (after a job, so it routes here again).
        self._heartbeat = heartbeat
        # model id -> (step, its trainer) kept from the model's last job.
        self._trainers: dict[str, tuple[int, Trainer]] = {}
        # The job running now, if any.
        self.current: _RunningJob | None = None
        # The lease's length, as the control plane said at registration.
        self.lease_s = 60.0

    async def run(self, job: LeasedJob) -> None:
        running = _RunningJob(id=job.id, model_id=job.model_id, attempt=job.attempt)
        self.current = running
        renew = asyncio.create_task(self._renew_loop(running), name=f"renew-{running.id}")
        logger.info("job %s (attempt %d): %s", running.id, running.attempt, job.kind)
        try:
            async with self._host.turn:
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
            self.current = None
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
        await self._release_trainer(running)
        await self._host.wake_or_restart(running.id)
        with contextlib.suppress(Exception):
            await self._heartbeat()

    async def _release_trainer(self, running: _RunningJob) -> None:
        """Free the job's trainer (kept for the failure's timeline), never to be reused."""
        trainer, running.trainer = running.trainer, None
        if trainer is None:
            return
        running.released_trainer = trainer
        self._trainers.pop(running.model_id, None)
        try:
            await asyncio.to_thread(trainer.release)
        except Exception:
            logger.exception("freeing the trainer of job %s failed", running.id)

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
        renewals = self._cp.renewals(
            running.id, attempt=running.attempt, lease_s=self.lease_s, what=f"job {running.id}"
        )
        try:
            async for answer in renewals:
                running.note(answer)
        except LeaseLost:
            running.lease_lost = True

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

    async def _kl_reference(self, job: LeasedJob) -> Path | None:
        """An RL job's KL reference checkpoint, fetched as its start adapter is (None: the base
        model). The control plane checked the step when the job was queued; one deleted
        since, or a lag reaching a step that is not there, fails the job naming it."""
        if not isinstance(job, LeasedRLJob):
            return None
        config = job.config
        step = config.kl_reference_step(job.base_step)
        if config.kl_penalty_coef == 0 or step == 0:
            return None
        try:
            return await self._host.fetch_checkpoint(job.model_id, step)
        except SkytrainError as exc:
            raise TrainingError(f"the KL reference (step {step} of this model): {exc}") from exc

    async def _train_and_commit(self, job: LeasedJob, running: _RunningJob) -> None:
        model_id = job.model_id
        step = job.step  # base_step + 1 unless newer steps were deleted
        job_dir = self._options.work_dir / "jobs" / running.id
        times: dict[str, float] = {}  # time/<phase>_s, reported with the result
        # Downloads first: they need the network, not the GPU the engine still holds. A job
        # that yielded before resumes from the state it saved then, not from its base step.
        saved_dir: Path | None = None
        base_dir: Path | None = None
        with _timed(times, "download"):
            batch_path = await self._cp.download_input(running.id, job_dir / "input.jsonl")
            if job.steps_done:
                saved_dir = await self._cp.download_saved_state(running.id, job_dir / "saved")
            elif job.base_step > 0:
                base_dir = await self._host.fetch_checkpoint(model_id, job.base_step)
            reference_dir = await self._kl_reference(job)
        groups: list[TrajectoryGroup] = []
        trained: list[TrajectoryGroup] = []  # those within max_off_policy_steps
        if isinstance(job, LeasedRLJob):
            # Read before the engine sleeps: a job none of whose groups may be trained on from
            # the step it starts at (the model moved on while it was queued) fails without a
            # sleep (and its 503s) for nothing.
            with _timed(times, "prepare"):
                groups = await asyncio.to_thread(_read_batch, batch_path, TrajectoryGroup)
            trained, _ = within_off_policy(
                groups, base_step=job.base_step, limit=job.config.max_off_policy_steps
            )
        self._check(running, training=True)

        await self._host.sleep()
        if saved_dir is None:
            trainer = await self._trainer_for(model_id, job.base_step, job.model_config_, base_dir)
        else:
            trainer = await self._trainer_for(
                model_id, job.base_step, job.model_config_, saved_dir, cached=False
            )
        running.trainer = trainer
        started = time.monotonic()
        # Parsing, tokenizing and packing a large batch takes a while: all off the event loop.
        plan: RLPlan | SFTPlan
        with _timed(times, "prepare"):
            if isinstance(job, LeasedSFTJob):
                trajectories = await asyncio.to_thread(_read_batch, batch_path, Trajectory)
                plan = await asyncio.to_thread(
                    functools.partial(
                        trainer.prepare_sft, trajectories, job.config, resume_from=saved_dir
                    )
                )
                num_trajectories = len(trajectories)
            else:
                plan = await asyncio.to_thread(
                    functools.partial(
                        trainer.prepare_rl,
                        groups,
                        job.config,
                        resume_from=saved_dir,
                        reference=reference_dir,
                    )
                )
                num_trajectories = sum(len(g.trajectories) for g in trained)
        # training_started carries the sampler-vs-trainer agreement: sent now when the plan has
        # it, else once the first step (whose forward pass measures it) is done. A resumed job
        # sends training_resumed instead (its agreement was measured before it yielded).
        report_started = functools.partial(
            self._report_started,
            running,
            plan,
            step=step,
            num_trajectories=num_trajectories,
            resumed_after=plan.steps_done,
        )
        iterator: Iterator[dict[str, float]] = trainer.run(plan)
        with _timed(times, "steps"):
            try:
                if not plan.agreement_pending:
                    await report_started()
                while (metrics := await asyncio.to_thread(next, iterator, None)) is not None:
                    await report_started()
                    more = plan.steps_done < plan.num_gradient_steps
                    self._check(running, training=more)
                    answer = await self._cp.event(
                        running.id, attempt=running.attempt, type="gradient_step", data=metrics
                    )
                    running.note(answer)
                    if more and running.yield_requested:
                        break
                # A plan with no steps whose trainer learns so only by running it (sharded).
                await report_started()
            except Exception:
                # A job that fails in its first step has started all the same (without the
                # agreement when it failed before its forward pass measured it).
                with contextlib.suppress(Exception):
                    await report_started()
                raise
        self._check(running)
        if plan.steps_done < plan.num_gradient_steps:
            await self._hand_back(running, trainer, plan, job_dir / "state", times)
            return

        checkpoint_dir = self._options.work_dir / "checkpoints" / model_id / str(step)
        shutil.rmtree(checkpoint_dir, ignore_errors=True)
        trainer.step = step
        with _timed(times, "save"):
            await asyncio.to_thread(trainer.save, checkpoint_dir)
        files = sorted(p for p in checkpoint_dir.iterdir() if p.is_file())
        await self._put_trainer_away(running, model_id, step)
        await self._host.wake()

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
            summary = {**_mean_metrics(plan.step_metrics), **_floats(plan.summary), **times}
            summary["time/training_s"] = time.monotonic() - started
            await self._cp.complete(
                running.id, attempt=running.attempt, step=step, metrics=summary, files=files
            )
            self._host.confirm(key)
        except BaseException:
            # Not committed (lease lost, store failure...): the step must not stay loaded, or
            # the job's next attempt could not load its own result under the same name.
            await self._host.unload(key)
            self._trainers.pop(model_id, None)
            raise
        logger.info("job %s committed step %d of model %s", running.id, step, model_id)

    async def _hand_back(
        self,
        running: _RunningJob,
        trainer: Trainer,
        plan: RLPlan | SFTPlan,
        directory: Path,
        times: dict[str, float],
    ) -> None:
        """Yield the worker at this step boundary: save the job's state, give the GPU back
        to the engine, upload the state as this attempt's files and hand the job back."""
        shutil.rmtree(directory, ignore_errors=True)
        with _timed(times, "save"):
            await asyncio.to_thread(trainer.save_progress, plan, directory)
        files = await asyncio.to_thread(_files_in, directory)
        # The trainer is mid-job: never cached as if it were at a checkpoint.
        await self._release_trainer(running)
        await self._host.wake()
        await self._upload(running, files, times)
        self._check(running)
        await self._report_timeline(running)
        await self._cp.preempt(
            running.id, attempt=running.attempt, steps_done=plan.steps_done, files=files
        )
        logger.info(
            "job %s yielded this worker to another tenant's job after step %d of %d (%s)",
            running.id,
            plan.steps_done,
            plan.num_gradient_steps,
            ", ".join(f"{key} {value:.2f}" for key, value in sorted(times.items())),
        )

    async def _report_started(
        self,
        running: _RunningJob,
        plan: RLPlan | SFTPlan,
        *,
        step: int,
        num_trajectories: int,
        resumed_after: int,
    ) -> None:
        """Send the job's ``training_started`` event, or ``training_resumed`` for a job that
        resumes from a saved state, once."""
        if running.started_reported:
            return
        running.started_reported = True
        if resumed_after:
            await self._cp.event(
                running.id,
                attempt=running.attempt,
                type="training_resumed",
                data={
                    "steps_done": resumed_after,
                    "num_gradient_steps": plan.num_gradient_steps,
                    "attempt": running.attempt,
                    "step": step,
                },
            )
            return
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
                **_cut(plan.summary),
                **({"warning": plan.warning} if plan.warning else {}),
            },
        )

    async def _upload(
        self, running: _RunningJob, files: list[Path], times: dict[str, float]
    ) -> None:
        with _timed(times, "upload"):
            for path in files:
                await self._cp.upload_file(running.id, path, attempt=running.attempt)

    async def _trainer_for(
        self,
        model_id: str,
        step: int,
        model_config: ModelConfig,
        adapter_dir: Path | None,
        *,
        cached: bool = True,
    ) -> Trainer:
        """The model's trainer at ``step``: cached from its last job, or loaded from storage
        (``adapter_dir``; with ``cached=False`` always, as for a job's saved state)."""
        kept = self._trainers.pop(model_id, None)
        if kept is not None and kept[0] == step and cached:
            return kept[1]
        if kept is not None:
            await asyncio.to_thread(kept[1].release)
        if self._options.trainer_shards > 1 or self._options.trainer_python:
            from skytrain_backend.worker.sharded import sharded_trainer

            return sharded_trainer(self._options, model_id, model_config, adapter_dir)
        from skytrain_backend.trainer import Trainer

        return await asyncio.to_thread(
            Trainer.load,
            self._options.base_model,
            model_config=model_config,
            adapter_dir=adapter_dir,
            device=self._options.device,
            activation_memory_limit_bytes=self._options.trainer_memory_limit_bytes,
            **self._options.trainer_options,
        )

    async def _put_trainer_away(self, running: _RunningJob, model_id: str, step: int) -> None:
        """After saving: a trainer that shares the GPU with the engine is freed (the next job
        loads it again from the checkpoint just written); otherwise it is kept for the next
        job of its model."""
        trainer, running.trainer = running.trainer, None
        if trainer is None:
            return
        if self._host.trainer_shares_engine_device:
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
            engine_log = await self._host.engine.control_log()
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

    async def _load_new_step(
        self, key: tuple[str, int], directory: Path, times: dict[str, float]
    ) -> None:
        with _timed(times, "engine_load"):
            await self._host.load_new_step(key, directory)


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
    """Add how long the block took to ``times["time/<phase>_s"]``."""
    start = time.monotonic()
    yield
    key = f"time/{phase}_s"
    times[key] = times.get(key, 0.0) + time.monotonic() - start


def _files_in(directory: Path) -> list[Path]:
    return sorted(path for path in directory.iterdir() if path.is_file())


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


def _cut(summary: dict[str, float]) -> dict[str, float]:
    """What the job's rows (``packing/row_length`` tokens) cut of longer sequences: the
    sequences cut and their trained tokens left out (``tokens/truncated``), or, under ART's
    rules, the sequences left out whole (``sequences/dropped``, ``tokens/dropped``)."""
    keys = (
        "packing/row_length",
        "sequences/truncated",
        "tokens/truncated",
        "sequences/dropped",
        "tokens/dropped",
    )
    return {key: summary[key] for key in keys if key in summary}


def _floats(values: Mapping[str, object]) -> dict[str, float]:
    return {k: float(v) for k, v in values.items() if isinstance(v, int | float)}


def _mean_metrics(steps: list[dict[str, float]]) -> dict[str, float]:
    keys = {key for metrics in steps for key in metrics}
    return {
        key: sum(m[key] for m in steps if key in m) / sum(1 for m in steps if key in m)
        for key in sorted(keys)
    }

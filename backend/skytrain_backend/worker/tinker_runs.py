"""The worker's Tinker executor: holds Tinker training runs and runs their operations in order.

Beside the agent's job loop, it leases ``tinker`` runs of models placed on this worker (at
most ``max_runs`` at once: each keeps a trainer in memory), and for each one:

1. rebuilds the run's state from the control plane's plan: a fresh adapter from the run's seed,
   or a checkpoint (adapter + Adam state), then the forward-backward and optimizer steps that
   followed it, rerun from their stored inputs (a run whose worker was lost comes back exactly
   where it was, gradients not yet applied included);
2. pulls operation after operation (``seq_id`` order, waiting for the next to arrive) and runs
   it on the trainer: gradients accumulate over ``forward_backward`` calls until
   ``optim_step``; saves write ordinary checkpoints, and a sampler save is loaded into the
   engine before it is committed, so sampling works as soon as its future resolves;
3. renews the run's lease meanwhile, and lets the trainer go when the lease is lost or the
   run ends (its session finished).

Operations that compute run one at a time, across runs and with the agent's jobs: each takes
the agent's trainer turn (``WorkerAgent.trainer_turn``), which puts an engine that shares the
GPU to sleep and wakes it after; between two operations a run's trainer waits in host memory
(``Trainer.offload``), so a Tinker run never holds the GPU while the engine serves. The torch
work is done off the event loop, so heartbeats and renewals go on. An operation the trainer refuses (a token
id outside the vocabulary, a non-finite gradient) fails alone and leaves the state as it was;
anything unexpected drops the state, and the run is leased again and rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from skytrain_backend.errors import LeaseLost, SkytrainError, TrainingError
from skytrain_backend.protocol import StagedFile, tinker_protobuf
from skytrain_backend.protocol.tinker_ops import (
    BatchOperation,
    CreationOperation,
    LeasedOperation,
    LeasedRun,
    LoadOperation,
    OperationCompletion,
    OperationFailure,
    OperationResult,
    OptimOperation,
    RestorePoint,
    SaveCommit,
    SaveOperation,
    TinkerOperation,
)
from skytrain_backend.worker.client import (
    LEASE_RETRY_S,
    ControlPlaneClient,
    staged_file,
    until_stopped,
)
from skytrain_backend.worker.options import AgentOptions

if TYPE_CHECKING:
    from skytrain_backend.trainer import Trainer

logger = logging.getLogger(__name__)

NEXT_WAIT_S = 10.0


class AdapterHost(Protocol):
    """The agent's engine host: loads a checkpoint into the engine and counts it as served
    (``confirm`` once its commit returned, ``unload`` if it failed); gives the device to one
    trainer at a time."""

    async def serve_checkpoint(self, model_id: str, step: int, directory: Path) -> bool: ...

    def confirm(self, key: tuple[str, int]) -> None: ...

    async def unload(self, key: tuple[str, int]) -> None: ...

    def trainer_turn(self, what: str) -> AbstractAsyncContextManager[None]: ...

    @property
    def trainer_shares_engine_device(self) -> bool: ...


class _RunEnded(SkytrainError):
    """The run's lease was lost, or its job cancelled."""


@dataclass
class _Run:
    leased: LeasedRun
    # The next operation to run, and the newest step the model had: saves go above it.
    next_seq: int = field(init=False)
    latest_step: int = field(init=False)
    trainer: Trainer | None = None
    # The committed step whose weights the trainer holds, while nothing changed them.
    saved_step: int | None = None
    ended: str | None = None
    cancelled: bool = False

    def __post_init__(self) -> None:
        self.next_seq = self.leased.plan.next_seq
        self.latest_step = self.leased.latest_step

    def check(self) -> None:
        if self.ended is not None:
            raise _RunEnded(self.ended)


class TinkerExecutor:
    def __init__(
        self, control_plane: ControlPlaneClient, adapters: AdapterHost, options: AgentOptions
    ) -> None:
        """``options``: the agent's; its work directory, device, trainer sizing (as for the
        worker's jobs), runs held at once (``tinker_max_runs``) and lease wait."""
        self._cp = control_plane
        self._adapters = adapters
        self._options = options
        # The control plane's, once the worker registers (as the job runner's).
        self.lease_s = 60.0
        # By job and attempt: a run taken back and leased again may meet its old attempt here.
        self._runs: dict[tuple[str, int], _Run] = {}
        # Set when a run ends: the executor, full, may lease another.
        self._room = asyncio.Event()

    async def run(self, stopping: asyncio.Event) -> None:
        """Lease runs while there is room, until ``stopping`` is set."""
        served: set[asyncio.Task[None]] = set()
        try:
            while not stopping.is_set():
                if len(self._runs) >= self._options.tinker_max_runs:
                    self._room.clear()
                    await until_stopped(self._room.wait(), stopping)
                    continue
                try:
                    run = await until_stopped(self._lease(), stopping)
                except Exception:
                    logger.exception("leasing a Tinker run failed; retrying")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), LEASE_RETRY_S)
                    continue
                if run is not None:
                    task = asyncio.create_task(self._serve(run), name=f"tinker-{run.leased.run_id}")
                    served.add(task)
                    task.add_done_callback(served.discard)
        finally:
            for task in list(served):
                task.cancel()
            await asyncio.gather(*served, return_exceptions=True)

    async def _lease(self) -> _Run | None:
        leased = await self._cp.tinker_lease(wait_s=self._options.job_wait_s)
        return None if leased is None else _Run(leased)

    # --- one run --------------------------------------------------------------------------------

    async def _serve(self, run: _Run) -> None:
        self._runs[run.leased.job_id, run.leased.attempt] = run
        renew = asyncio.create_task(self._renew_loop(run), name=f"renew-{run.leased.job_id}")
        logger.info(
            "Tinker run %s (attempt %d): from operation %d",
            run.leased.run_id,
            run.leased.attempt,
            run.next_seq,
        )
        try:
            # The memory plan shards this worker's trainer (worker.sharded), which Tinker's
            # one-process trainer cannot be: its runs are refused rather than loaded whole onto
            # one device that cannot hold them.
            if (shards := self._options.trainer_shards) > 1:
                raise _CreationFailed(
                    f"{run.leased.base_model} needs its training sharded over {shards} "
                    "devices on this worker, and Tinker runs train on one device for now; "
                    "train it with skytrain's training jobs (REST, SDK or ART's client), "
                    "which use every shard"
                )
            await self._rebuild(run)
            while True:
                run.check()
                operation = await self._next(run)
                if operation is not None:
                    await self._execute(run, operation)
                    run.next_seq += 1
        except (LeaseLost, _RunEnded) as exc:
            logger.info("Tinker run %s let go: %s", run.leased.run_id, exc)
            if run.cancelled:
                await self._fail_run(run, "the run was cancelled", retryable=False, cancelled=True)
        except _CreationFailed as exc:
            await self._fail_run(run, f"the model could not be created: {exc}", retryable=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("Tinker run %s failed; its state is dropped", run.leased.run_id)
            # The tenant reads this: the details (paths, addresses) stay in this worker's log.
            await self._fail_run(
                run,
                f"the worker failed running it ({type(exc).__name__}); its log says why",
                retryable=True,
            )
        finally:
            renew.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await renew
            run.trainer = None
            self._runs.pop((run.leased.job_id, run.leased.attempt), None)
            self._room.set()

    async def _fail_run(
        self, run: _Run, message: str, *, retryable: bool, cancelled: bool = False
    ) -> None:
        with contextlib.suppress(LeaseLost):
            try:
                await self._cp.fail(
                    run.leased.job_id,
                    attempt=run.leased.attempt,
                    error_message=message,
                    retryable=retryable,
                    cancelled=cancelled,
                )
            except Exception:
                logger.exception("could not report the end of Tinker run %s", run.leased.run_id)

    async def _renew_loop(self, run: _Run) -> None:
        renewals = self._cp.renewals(
            run.leased.job_id,
            attempt=run.leased.attempt,
            lease_s=self.lease_s,
            what=f"Tinker run {run.leased.run_id}",
        )
        try:
            async for answer in renewals:
                if answer.cancel_requested:
                    run.cancelled = True
                    run.ended = "cancelled"
                    return
        except LeaseLost as exc:
            run.ended = f"lease lost ({exc})"

    async def _next(self, run: _Run) -> LeasedOperation | None:
        return await self._cp.tinker_next(
            run.leased.job_id, attempt=run.leased.attempt, seq_id=run.next_seq, wait_s=NEXT_WAIT_S
        )

    # --- rebuilding state -----------------------------------------------------------------------

    async def _rebuild(self, run: _Run) -> None:
        """The state after the finished operations, from the plan (nothing to do when the
        creation itself is next)."""
        if run.next_seq == 0:
            return
        restore = run.leased.plan.restore
        if restore is None:
            raise _CreationFailed("its creation failed")
        await self._build(run, restore)
        for seq_id in run.leased.plan.replay:
            run.check()
            leased = await self._cp.tinker_operation(
                run.leased.job_id, seq_id, attempt=run.leased.attempt
            )
            with contextlib.suppress(TrainingError):
                await self._change_state(run, leased.operation, seq_id=seq_id)
        logger.info(
            "Tinker run %s rebuilt: %d operations replayed",
            run.leased.run_id,
            len(run.leased.plan.replay),
        )

    async def _build(self, run: _Run, restore: RestorePoint) -> None:
        from skytrain_backend.trainer import Trainer, primitives

        checkpoint = restore.checkpoint
        directory = None
        if checkpoint is not None:
            directory = await self._fetch(run, checkpoint.model_id, checkpoint.step)

        def build() -> Trainer:
            trainer = Trainer.load(
                run.leased.base_model,
                model_config=run.leased.model_config_,
                device=self._options.device,
                **self._options.trainer_options,
            )
            if restore.seed is not None:
                primitives.reseed_adapter(trainer, restore.seed)
            if directory is not None:
                primitives.load_weights(trainer, directory, with_optimizer=restore.optimizer)
            return trainer

        async with self._turn(run, "loading its model"):
            run.trainer = await asyncio.to_thread(build)
        run.saved_step = None

    @contextlib.asynccontextmanager
    async def _turn(self, run: _Run, what: str) -> AsyncIterator[None]:
        """The device for one operation of ``run``: its trainer on it meanwhile, back in host
        memory after when the engine shares the device."""
        async with self._adapters.trainer_turn(f"Tinker run {run.leased.run_id}: {what}"):
            if run.trainer is not None:
                await asyncio.to_thread(run.trainer.reload)
            try:
                yield
            finally:
                if run.trainer is not None and self._adapters.trainer_shares_engine_device:
                    await asyncio.to_thread(run.trainer.offload)

    async def _fetch(self, run: _Run, model_id: str, step: int) -> Path:
        """A local copy of a checkpoint the run may read."""
        directory = self._options.work_dir / "checkpoints" / model_id / str(step)
        files = await self._cp.tinker_checkpoint_files(
            run.leased.job_id, model_id, step, attempt=run.leased.attempt
        )
        for item in files:
            if not (directory / item.name).is_file():
                await self._cp.tinker_checkpoint_file(
                    run.leased.job_id,
                    model_id,
                    step,
                    item.name,
                    attempt=run.leased.attempt,
                    target=directory / item.name,
                )
        return directory

    # --- operations -----------------------------------------------------------------------------

    async def _execute(self, run: _Run, leased: LeasedOperation) -> None:
        if leased.finished:
            return
        seq_id, operation = leased.seq_id, leased.operation
        if isinstance(operation, CreationOperation):
            try:
                await self._build(run, operation.params.restore())
            except Exception as exc:
                logger.exception("Tinker run %s: creating the model failed", run.leased.run_id)
                message = _creation_error(exc, run.leased.base_model, operation.params.path)
                await self._cp.tinker_fail(
                    run.leased.job_id,
                    seq_id,
                    OperationFailure(attempt=run.leased.attempt, error=message),
                )
                raise _CreationFailed(message) from exc
            await self._complete(run, seq_id, OperationResult())
            return
        if isinstance(operation, SaveOperation):
            await self._save(run, operation, seq_id=seq_id)
            return
        try:
            result, output = await self._change_state(run, operation, seq_id=seq_id)
        except TrainingError as exc:
            await self._cp.tinker_fail(
                run.leased.job_id,
                seq_id,
                OperationFailure(attempt=run.leased.attempt, error=exc.message),
            )
            return
        if output is not None:
            await self._cp.tinker_output(
                run.leased.job_id,
                seq_id,
                attempt=run.leased.attempt,
                content=output,
                media_type=tinker_protobuf.PROTOBUF_MEDIA_TYPE,
            )
        await self._complete(run, seq_id, result, has_output=output is not None)

    async def _complete(
        self, run: _Run, seq_id: int, result: OperationResult, *, has_output: bool = False
    ) -> None:
        completion = OperationCompletion(
            attempt=run.leased.attempt, result=result, has_output=has_output
        )
        await self._cp.tinker_complete(run.leased.job_id, seq_id, completion)

    async def _change_state(
        self, run: _Run, operation: TinkerOperation, *, seq_id: int
    ) -> tuple[OperationResult, bytes | None]:
        """Run a forward, forward-backward, optimizer step or load: its result and output."""
        from skytrain_backend.trainer import primitives

        trainer = run.trainer
        assert trainer is not None
        if isinstance(operation, LoadOperation):
            if operation.params is None:
                raise TrainingError("the load was refused: nothing to load")
            source = operation.params
            await self._build(
                run, RestorePoint(checkpoint=source.source, optimizer=source.optimizer)
            )
            return OperationResult(), None
        if isinstance(operation, OptimOperation):
            if operation.params is None:
                raise TrainingError("the optimizer step was refused: nothing to apply")
            adam = operation.params.adam
            async with self._turn(run, operation.kind):
                metrics = await asyncio.to_thread(primitives.adam_step, trainer, adam)
            run.saved_step = None
            return OperationResult(metrics=metrics), None
        if not isinstance(operation, BatchOperation):
            raise TrainingError(f"a {operation.kind} does not change a run's state")
        body = await self._input(run, seq_id)
        batch = tinker_protobuf.parse_forward_backward(
            body, max_tokens=run.leased.model_config_.max_seq_length
        )
        examples = [
            primitives.Example(
                tokens=datum.tokens,
                inputs={name: tensor.values() for name, tensor in datum.inputs.items()},
            )
            for datum in batch.data
        ]
        async with self._turn(run, operation.kind):
            logprobs, metrics = await asyncio.to_thread(
                primitives.forward_backward,
                trainer.policy,
                examples,
                loss_fn=batch.loss_fn,
                config=batch.loss_config,
                backward=operation.kind == "forward_backward",
            )
        return OperationResult(), tinker_protobuf.encode_forward_backward_output(logprobs, metrics)

    async def _input(self, run: _Run, seq_id: int) -> bytes:
        target = self._options.work_dir / "tinker" / run.leased.job_id / f"{seq_id}.pb"
        await self._cp.tinker_input(
            run.leased.job_id, seq_id, attempt=run.leased.attempt, target=target
        )
        try:
            return target.read_bytes()
        finally:
            target.unlink(missing_ok=True)

    async def _save(self, run: _Run, operation: SaveOperation, *, seq_id: int) -> None:
        """Write the checkpoint (unless the weights did not change since the last one), load
        a sampler save into the engine, then commit it."""
        from skytrain_backend.trainer import primitives

        trainer = run.trainer
        assert trainer is not None
        grads_pending = primitives.has_gradients(trainer)
        files: list[StagedFile] = []
        served = False
        reuse_step = None
        if run.saved_step is not None:
            step = reuse_step = run.saved_step
        else:
            step = run.latest_step + 1
            directory = self._options.work_dir / "checkpoints" / run.leased.model_id / str(step)
            shutil.rmtree(directory, ignore_errors=True)
            async with self._turn(run, operation.kind):
                await asyncio.to_thread(trainer.save, directory)
            written = sorted(p for p in directory.iterdir() if p.is_file())
            for file in written:
                await self._cp.upload_file(run.leased.job_id, file, attempt=run.leased.attempt)
            files = await asyncio.to_thread(lambda: [staged_file(file) for file in written])
            if operation.kind == "save_weights_for_sampler":
                served = await self._adapters.serve_checkpoint(run.leased.model_id, step, directory)
        commit = SaveCommit(
            attempt=run.leased.attempt,
            files=files,
            step=step,
            reuse_step=reuse_step,
            grads_pending=grads_pending,
            optim_steps=trainer.step,
            served=served,
        )
        try:
            await self._cp.tinker_save(run.leased.job_id, seq_id, commit)
        except BaseException:
            if served:  # never committed: served to no one, and its name is free again
                await self._adapters.unload((run.leased.model_id, step))
            raise
        if served:
            self._adapters.confirm((run.leased.model_id, step))
        run.latest_step = max(run.latest_step, step)
        run.saved_step = step


def _creation_error(exc: Exception, base_model: str, path: str | None) -> str:
    """What the tenant is told: the trainer's own refusals, else what could not be loaded."""
    if isinstance(exc, TrainingError):
        return exc.message
    what = f"{base_model!r} with the weights of {path}" if path else repr(base_model)
    return f"{what} could not be loaded ({type(exc).__name__}): check the base model's name"


class _CreationFailed(SkytrainError):
    """The run's model could not be created (its base model, its checkpoint)."""

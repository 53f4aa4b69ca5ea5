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

Operations run one at a time across runs (they share the device); the torch work is done off
the event loop, so heartbeats and renewals go on. An operation the trainer refuses (a token
id outside the vocabulary, a non-finite gradient) fails alone and leaves the state as it was;
anything unexpected drops the state, and the run is leased again and rebuilt.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from skytrain_backend import tinker_wire
from skytrain_backend.errors import LeaseLost, SkytrainError, TrainingError
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.worker.client import LEASE_RETRY_S, ControlPlaneClient, until_stopped

if TYPE_CHECKING:
    from skytrain_backend.trainer import Trainer

logger = logging.getLogger(__name__)

API = "/tinker"
CREATIONS = frozenset({"create_model", "load_create"})
SAVES = frozenset({"save_weights", "save_weights_for_sampler"})
NEXT_WAIT_S = 10.0


class AdapterHost(Protocol):
    """The agent: loads a checkpoint into the engine and counts it as served."""

    async def serve_checkpoint(self, model_id: str, step: int, directory: Path) -> bool: ...


class _RunEnded(SkytrainError):
    """The run's lease was lost, or its job cancelled."""


@dataclass
class _Run:
    job_id: str
    attempt: int
    run_id: str
    model_id: str
    base_model: str
    model_config: ModelConfig
    next_seq: int
    latest_step: int
    plan: dict[str, Any]
    trainer: Trainer | None = None
    # The committed step whose weights the trainer holds, while nothing changed them.
    saved_step: int | None = None
    ended: str | None = None
    cancelled: bool = False

    def check(self) -> None:
        if self.ended is not None:
            raise _RunEnded(self.ended)

    def query(self) -> dict[str, int]:
        return {"attempt": self.attempt}


class TinkerExecutor:
    def __init__(
        self,
        *,
        control_plane: ControlPlaneClient,
        adapters: AdapterHost,
        work_dir: Path,
        device: str | None,
        max_runs: int,
        lease_s: float = 60.0,
        wait_s: float = 30.0,
    ) -> None:
        self._cp = control_plane
        self._adapters = adapters
        self._work_dir = work_dir
        self._device = device
        self._max_runs = max_runs
        self.lease_s = lease_s
        self._wait_s = wait_s
        self._runs: dict[str, _Run] = {}
        # Set when a run ends: the executor, full, may lease another.
        self._room = asyncio.Event()
        self._compute = asyncio.Lock()

    async def run(self, stopping: asyncio.Event) -> None:
        """Lease runs while there is room, until ``stopping`` is set."""
        served: set[asyncio.Task[None]] = set()
        try:
            while not stopping.is_set():
                if len(self._runs) >= self._max_runs:
                    self._room.clear()
                    await until_stopped(self._room.wait(), stopping)
                    continue
                try:
                    leased = await until_stopped(self._lease(), stopping)
                except Exception:
                    logger.exception("leasing a Tinker run failed; retrying")
                    with contextlib.suppress(TimeoutError):
                        await asyncio.wait_for(stopping.wait(), LEASE_RETRY_S)
                    continue
                if leased is not None:
                    task = asyncio.create_task(self._serve(leased), name=f"tinker-{leased.run_id}")
                    served.add(task)
                    task.add_done_callback(served.discard)
        finally:
            for task in list(served):
                task.cancel()
            await asyncio.gather(*served, return_exceptions=True)

    async def _lease(self) -> _Run | None:
        response = await self._cp.request(
            "POST",
            f"{API}/lease",
            params={"wait_s": self._wait_s},
            json={},
            timeout=self._wait_s + 30,
        )
        if response.status_code == 204:
            return None
        run = response.json()["run"]
        return _Run(
            job_id=run["job_id"],
            attempt=int(run["attempt"]),
            run_id=run["run_id"],
            model_id=run["model_id"],
            base_model=run["base_model"],
            model_config=ModelConfig.model_validate(run["model_config"]),
            next_seq=int(run["plan"]["next_seq"]),
            latest_step=int(run.get("latest_step", 0)),
            plan=run["plan"],
        )

    # --- one run --------------------------------------------------------------------------------

    async def _serve(self, run: _Run) -> None:
        self._runs[run.job_id] = run
        renew = asyncio.create_task(self._renew_loop(run), name=f"renew-{run.job_id}")
        logger.info(
            "Tinker run %s (attempt %d): from operation %d", run.run_id, run.attempt, run.next_seq
        )
        try:
            await self._rebuild(run)
            while True:
                run.check()
                operation = await self._next(run)
                if operation is not None:
                    await self._execute(run, operation)
                    run.next_seq += 1
        except (LeaseLost, _RunEnded) as exc:
            logger.info("Tinker run %s let go: %s", run.run_id, exc)
            if run.cancelled:
                await self._fail_run(run, "the run was cancelled", retryable=False, cancelled=True)
        except _CreationFailed as exc:
            await self._fail_run(run, f"the model could not be created: {exc}", retryable=False)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.exception("Tinker run %s failed; its state is dropped", run.run_id)
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
            self._runs.pop(run.job_id, None)
            self._room.set()

    async def _fail_run(
        self, run: _Run, message: str, *, retryable: bool, cancelled: bool = False
    ) -> None:
        with contextlib.suppress(LeaseLost):
            try:
                await self._cp.fail(
                    run.job_id,
                    attempt=run.attempt,
                    error_message=message,
                    retryable=retryable,
                    cancelled=cancelled,
                )
            except Exception:
                logger.exception("could not report the end of Tinker run %s", run.run_id)

    async def _renew_loop(self, run: _Run) -> None:
        while True:
            await asyncio.sleep(max(self.lease_s / 3, 0.5))
            try:
                answer = await self._cp.renew(run.job_id, attempt=run.attempt)
            except LeaseLost as exc:
                run.ended = f"lease lost ({exc})"
                return
            except Exception:
                logger.exception("renewing Tinker run %s failed", run.run_id)
                continue
            if answer.cancel_requested:
                run.cancelled = True
                run.ended = "cancelled"
                return

    async def _next(self, run: _Run) -> dict[str, Any] | None:
        response = await self._cp.request(
            "POST",
            f"{API}/runs/{run.job_id}/next",
            json={"attempt": run.attempt, "seq_id": run.next_seq, "wait_s": NEXT_WAIT_S},
            timeout=NEXT_WAIT_S + 30,
        )
        return None if response.status_code == 204 else dict(response.json()["operation"])

    # --- rebuilding state -----------------------------------------------------------------------

    async def _rebuild(self, run: _Run) -> None:
        """The state after the finished operations, from the plan (nothing to do when the
        creation itself is next)."""
        if run.next_seq == 0:
            return
        restore = run.plan["restore"]
        if restore is None:
            raise _CreationFailed("its creation failed")
        await self._build(run, restore)
        for seq_id in run.plan["replay"]:
            run.check()
            response = await self._cp.request(
                "GET",
                f"{API}/runs/{run.job_id}/operations/{seq_id}",
                params=run.query(),
                retry=True,
            )
            operation = response.json()["operation"]
            with contextlib.suppress(TrainingError):
                await self._change_state(run, operation)
        logger.info(
            "Tinker run %s rebuilt: %d operations replayed", run.run_id, len(run.plan["replay"])
        )

    async def _build(self, run: _Run, restore: dict[str, Any]) -> None:
        from skytrain_backend.trainer import Trainer, primitives

        checkpoint = restore.get("checkpoint")
        directory = None
        if checkpoint is not None:
            directory = await self._fetch(run, checkpoint["model_id"], int(checkpoint["step"]))

        def build() -> Trainer:
            trainer = Trainer.load(
                run.base_model, model_config=run.model_config, device=self._device
            )
            if restore.get("seed") is not None:
                primitives.reseed_adapter(trainer, int(restore["seed"]))
            if directory is not None:
                primitives.load_weights(
                    trainer, directory, with_optimizer=bool(restore.get("optimizer"))
                )
            return trainer

        async with self._compute:
            run.trainer = await asyncio.to_thread(build)
        run.saved_step = None

    async def _fetch(self, run: _Run, model_id: str, step: int) -> Path:
        """A local copy of a checkpoint the run may read."""
        directory = self._work_dir / "checkpoints" / model_id / str(step)
        base = f"{API}/runs/{run.job_id}/checkpoints/{model_id}/{step}/files"
        response = await self._cp.request("GET", base, params=run.query(), retry=True)
        for item in response.json()["data"]:
            if not (directory / item["name"]).is_file():
                await self._cp.download(
                    f"{base}/{item['name']}?attempt={run.attempt}", directory / item["name"]
                )
        return directory

    # --- operations -----------------------------------------------------------------------------

    async def _execute(self, run: _Run, operation: dict[str, Any]) -> None:
        kind, seq_id = operation["kind"], int(operation["seq_id"])
        path = f"{API}/runs/{run.job_id}/operations/{seq_id}"
        if operation.get("finished"):
            return
        if kind in CREATIONS:
            try:
                await self._build(run, _restore(operation["params"]))
            except Exception as exc:
                logger.exception("Tinker run %s: creating the model failed", run.run_id)
                message = _creation_error(exc, run.base_model, operation["params"].get("path"))
                await self._cp.request(
                    "POST",
                    f"{path}/fail",
                    json={"attempt": run.attempt, "error": message, "category": "user"},
                )
                raise _CreationFailed(message) from exc
            await self._complete(run, path, {})
            return
        if kind in SAVES:
            await self._save(run, operation, path)
            return
        try:
            result, output = await self._change_state(run, operation)
        except TrainingError as exc:
            await self._cp.request(
                "POST",
                f"{path}/fail",
                json={"attempt": run.attempt, "error": exc.message, "category": "user"},
            )
            return
        if output is not None:
            await self._cp.request(
                "PUT",
                f"{path}/output",
                params=run.query(),
                content=output,
                headers={"Content-Type": tinker_wire.PROTOBUF_MEDIA_TYPE},
                retry=True,
            )
        await self._complete(run, path, result, has_output=output is not None)

    async def _complete(
        self, run: _Run, path: str, result: dict[str, Any], *, has_output: bool = False
    ) -> None:
        await self._cp.request(
            "POST",
            f"{path}/complete",
            json={"attempt": run.attempt, "result": result, "has_output": has_output},
            retry=True,
        )

    async def _change_state(
        self, run: _Run, operation: dict[str, Any]
    ) -> tuple[dict[str, Any], bytes | None]:
        """Run a forward, forward-backward, optimizer step or load: its result and output."""
        from skytrain_backend.trainer import primitives

        trainer = run.trainer
        assert trainer is not None
        kind = operation["kind"]
        if kind == "load_weights":
            params = operation["params"]
            await self._build(
                run, {"checkpoint": params["source"], "optimizer": params["optimizer"]}
            )
            return {}, None
        if kind == "optim_step":
            adam = primitives.AdamParams(**operation["params"]["adam"])
            async with self._compute:
                metrics = await asyncio.to_thread(primitives.adam_step, trainer, adam)
            run.saved_step = None
            return {"metrics": metrics}, None
        body = await self._input(run, int(operation["seq_id"]))
        batch = tinker_wire.parse_forward_backward(body, max_tokens=run.model_config.max_seq_length)
        examples = [
            primitives.Example(
                tokens=datum.tokens,
                inputs={name: tensor.values() for name, tensor in datum.inputs.items()},
            )
            for datum in batch.data
        ]
        async with self._compute:
            logprobs, metrics = await asyncio.to_thread(
                primitives.forward_backward,
                trainer.policy,
                examples,
                loss_fn=batch.loss_fn,
                config=batch.loss_config,
                backward=kind == "forward_backward",
            )
        return {}, tinker_wire.encode_forward_backward_output(logprobs, metrics)

    async def _input(self, run: _Run, seq_id: int) -> bytes:
        target = self._work_dir / "tinker" / run.job_id / f"{seq_id}.pb"
        await self._cp.download(
            f"{API}/runs/{run.job_id}/operations/{seq_id}/input?attempt={run.attempt}", target
        )
        try:
            return target.read_bytes()
        finally:
            target.unlink(missing_ok=True)

    async def _save(self, run: _Run, operation: dict[str, Any], path: str) -> None:
        """Write the checkpoint (unless the weights did not change since the last one), load
        a sampler save into the engine, then commit it."""
        from skytrain_backend.trainer import primitives

        trainer = run.trainer
        assert trainer is not None
        grads_pending = primitives.has_gradients(trainer)
        payload: dict[str, Any] = {
            "attempt": run.attempt,
            "grads_pending": grads_pending,
            "optim_steps": trainer.step,
        }
        if run.saved_step is not None:
            step = run.saved_step
            payload.update(step=step, reuse_step=step)
        else:
            step = run.latest_step + 1
            payload["step"] = step
            directory = self._work_dir / "checkpoints" / run.model_id / str(step)
            shutil.rmtree(directory, ignore_errors=True)
            async with self._compute:
                await asyncio.to_thread(trainer.save, directory)
            files = sorted(p for p in directory.iterdir() if p.is_file())
            for file in files:
                await self._cp.upload_file(run.job_id, file, attempt=run.attempt)
            payload["files"] = [file.name for file in files]
            if operation["kind"] == "save_weights_for_sampler":
                payload["served"] = await self._adapters.serve_checkpoint(
                    run.model_id, step, directory
                )
        await self._cp.request("POST", f"{path}/save", json=payload, retry=True)
        run.latest_step = max(run.latest_step, step)
        run.saved_step = step


def _creation_error(exc: Exception, base_model: str, path: str | None) -> str:
    """What the tenant is told: the trainer's own refusals, else what could not be loaded."""
    if isinstance(exc, TrainingError):
        return exc.message
    what = f"{base_model!r} with the weights of {path}" if path else repr(base_model)
    return f"{what} could not be loaded ({type(exc).__name__}): check the base model's name"


def _restore(params: dict[str, Any]) -> dict[str, Any]:
    """A creation's or load's parameters as what ``_build`` starts from."""
    return {
        "seed": params.get("seed"),
        "checkpoint": params.get("source"),
        "optimizer": bool(params.get("optimizer")),
    }


class _CreationFailed(SkytrainError):
    """The run's model could not be created (its base model, its checkpoint)."""

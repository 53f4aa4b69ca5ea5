"""The worker's engine as the agent keeps it: alive, awake or asleep, its adapters loaded.

The engine serves the base model and one LoRA adapter per checkpoint placed here (named by
``lora_name``). ``EngineHost`` loads and unloads them (one no longer placed here once the
front door has no request in flight for it, or ``unload_wait_s`` after it left), restarts an
engine that died (it comes back serving the base model only; the heartbeat loads the adapters
again), and gives the device to one trainer at a time (``trainer_turn``): an engine that shares the GPU with the
trainer is put to sleep for it, after the control plane is told to stop routing here, and is
woken after.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from skytrain_backend.errors import EngineTimeout, SkytrainError
from skytrain_backend.protocol import lora_name
from skytrain_backend.worker.client import ControlPlaneClient
from skytrain_backend.worker.options import AgentOptions

if TYPE_CHECKING:
    from skytrain_backend.engine.client import EngineClient

logger = logging.getLogger(__name__)

ENGINE_ADAPTER_FILES = ("adapter_config.json", "adapter_model.safetensors")


class SupervisedEngine(Protocol):
    """The engine subprocess the agent supervises."""

    def is_alive(self) -> bool: ...

    async def restart(self) -> None: ...

    def log_tail(self) -> str: ...


async def _nothing() -> None:
    return None


class EngineHost:
    """The engine, its process and the checkpoints loaded into it."""

    def __init__(
        self,
        control_plane: ControlPlaneClient,
        engine: EngineClient,
        engine_process: SupervisedEngine | None,
        options: AgentOptions,
        *,
        requests_in_flight: Callable[[str], int] = lambda name: 0,
    ) -> None:
        """``options``: the agent's; the work directory, whether and how long the engine
        sleeps while training (``sleep_engine_during_training``, ``engine_sleep_*_s``), and how
        long an adapter no longer placed here waits for its requests (``unload_wait_s``).
        ``requests_in_flight``: the front door's count for a name in the engine."""
        self._cp = control_plane
        self.engine = engine
        self._process = engine_process
        self._options = options
        self._requests_in_flight = requests_in_flight
        # Steps no longer placed here whose unload waits for their requests in flight: since
        # when (``time.monotonic()``).
        self._unload_waits: dict[tuple[str, int], float] = {}
        # (model id, step) -> the local directory its adapter was loaded from. Steps loaded
        # for a commit are in it too; the heartbeat reports them, and the control plane routes
        # to committed steps only (see worker/jobs.py).
        self.served: dict[tuple[str, int], Path] = {}
        # Steps loaded here for a commit (a job's new step, a Tinker sampler save): kept loaded
        # until ``confirm``; then when it was confirmed. A heartbeat's answer (what is placed
        # here) read before the commit does not list them, and must not unload them.
        self._unconfirmed: set[tuple[str, int]] = set()
        self._confirmed_at: dict[tuple[str, int], float] = {}
        self._lock = asyncio.Lock()
        # Held while a trainer holds the device: a whole job, or one Tinker operation.
        self.turn = asyncio.Lock()
        # True from the moment the engine is told to sleep until it is awake again.
        self.asleep = False
        # Tells the control plane the worker's state (set by the agent): sent as the engine
        # goes to sleep, so that nothing is routed here meanwhile.
        self.on_asleep: Callable[[], Awaitable[None]] = _nothing

    @property
    def trainer_shares_engine_device(self) -> bool:
        """Whether the engine sleeps while a trainer computes (it shares the GPU)."""
        return self._options.sleep_engine_during_training

    @contextlib.asynccontextmanager
    async def trainer_turn(self, what: str) -> AsyncIterator[None]:
        """The device for one Tinker operation (``what``): after any job or other operation
        on it, with the engine asleep when it shares the device, awake again after."""
        async with self.turn:
            await self.sleep()
            if self.asleep:
                logger.info("the engine sleeps for %s", what)
            try:
                yield
            finally:
                await self.wake()

    async def supervise(self) -> None:
        """Restart the engine if it died."""
        process = self._process
        if process is None or process.is_alive():
            return
        logger.error("the engine died; restarting it. Its last lines:\n%s", process.log_tail())
        async with self._lock:
            await self._restart(process)

    async def _restart(self, process: SupervisedEngine) -> None:
        """Start the engine again (under the engine lock): it comes back awake, serving the
        base model only; the heartbeat loads the adapters again."""
        self.served.clear()
        self._unconfirmed.clear()
        self._confirmed_at.clear()
        self._unload_waits.clear()
        await process.restart()
        self.asleep = False

    async def wake_or_restart(self, job_id: str) -> None:
        """After a job, whatever became of it: the engine awake, restarted if it will not
        wake."""
        try:
            await self.wake()
        except Exception:
            logger.exception("the engine did not wake up after job %s; restarting it", job_id)
            if self._process is not None:
                async with self._lock:
                    await self._restart(self._process)

    async def sync_adapters(
        self,
        wanted: set[tuple[str, int]],
        *,
        asked_at: float = math.inf,
    ) -> None:
        """Load the checkpoints placed here into the engine; unload those no longer wanted,
        but not a step loaded for a commit (a job's new step, a Tinker sampler save) that is
        not confirmed yet or was confirmed after ``asked_at`` (``time.monotonic()`` when the
        heartbeat whose answer says ``wanted`` was built: the control plane may have answered
        before that commit), and not while requests for it are in flight (``_answering``: a
        later call unloads it)."""
        if self.asleep:
            return
        for key in sorted(wanted - set(self.served)):
            try:
                directory = await self.fetch_checkpoint(*key, ENGINE_ADAPTER_FILES)
                async with self._lock:
                    if self.asleep:
                        return
                    await self.engine.load_lora(lora_name(*key), str(directory))
                    self.served[key] = directory
                logger.info("serving %s step %d", *key)
            except Exception:
                logger.exception("could not load %s step %d into the engine", *key)
        for key in set(self._unload_waits) & wanted:
            del self._unload_waits[key]  # placed here again
        for key in sorted(set(self.served) - wanted):
            if key in self._unconfirmed or self._confirmed_at.get(key, -math.inf) >= asked_at:
                continue  # loaded for a commit the answer may not know of yet
            async with self._lock:
                if self._answering(key):
                    continue
                with contextlib.suppress(Exception):
                    await self.engine.unload_lora(lora_name(*key))
                self.served.pop(key, None)
                self._confirmed_at.pop(key, None)
                self._unload_waits.pop(key, None)

    def _answering(self, key: tuple[str, int]) -> bool:
        """Whether a step no longer placed here stays loaded for now: requests for it are in
        flight through the front door (a control plane's gateway sent them before the step
        left, or another control plane's still does), for ``unload_wait_s`` at most."""
        count = self._requests_in_flight(lora_name(*key))
        if not count:
            return False
        now = time.monotonic()
        if key not in self._unload_waits:
            self._unload_waits[key] = now
            logger.info(
                "%s step %d is no longer placed here; %d requests in flight for it: unloading it "
                "once they are answered, in %.0fs at most (SKYTRAIN_WORKER_UNLOAD_WAIT_S)",
                *key,
                count,
                self._options.unload_wait_s,
            )
        since = self._unload_waits[key]
        if now - since < self._options.unload_wait_s:
            return True
        logger.warning(
            "%s step %d: %d requests still in flight %.0fs after it left this worker "
            "(SKYTRAIN_WORKER_UNLOAD_WAIT_S): unloading it; they fail",
            *key,
            count,
            now - since,
        )
        return False

    async def serve_checkpoint(self, model_id: str, step: int, directory: Path) -> bool:
        """Load a checkpoint written on this worker into the engine (the Tinker executor's
        sampler saves); False while the engine sleeps (the heartbeat loads it on waking)."""
        if self.asleep:
            return False
        name = lora_name(model_id, step)
        async with self._lock:
            await self.engine.load_lora(name, str(directory))
            self.served[(model_id, step)] = directory
            self._unconfirmed.add((model_id, step))
        if not await self.engine.is_serving(name):
            raise SkytrainError(f"the engine does not serve {name} after loading it")
        return True

    async def load_new_step(self, key: tuple[str, int], directory: Path) -> None:
        """Load a step just trained into the engine and check that it generates with it."""
        name = lora_name(*key)
        async with self._lock:
            await self.engine.load_lora(name, str(directory))
            self.served[key] = directory
            self._unconfirmed.add(key)
        if not await self.engine.is_serving(name):
            raise SkytrainError(f"the engine does not serve {name} after loading it")
        await self.engine.check_generates(name)

    def confirm(self, key: tuple[str, int]) -> None:
        """The commit of a step loaded for it returned: from now on a heartbeat's answer
        knows of it (one built before now may not)."""
        self._unconfirmed.discard(key)
        self._confirmed_at[key] = time.monotonic()

    async def unload(self, key: tuple[str, int]) -> None:
        """Take a step out of the engine (quietly: an engine that died has dropped it)."""
        async with self._lock:
            with contextlib.suppress(Exception):
                await self.engine.unload_lora(lora_name(*key))
            self.served.pop(key, None)
            self._unconfirmed.discard(key)
            self._confirmed_at.pop(key, None)
            self._unload_waits.pop(key, None)

    async def fetch_checkpoint(
        self, model_id: str, step: int, names: tuple[str, ...] | None = None
    ) -> Path:
        """A local copy of a checkpoint's files (downloaded once, kept in the work dir)."""
        directory = self._options.work_dir / "checkpoints" / model_id / str(step)
        committed: dict[str, str | None] = {}
        if names is None:
            listing = await self._cp.list_checkpoint_files(model_id, step)
            # The SHA-256 each file was committed with: a damaged download is not loaded.
            committed = {item["name"]: item.get("sha256") for item in listing}
            names = tuple(committed)
        for name in names:
            if not (directory / name).is_file():
                await self._cp.download_checkpoint_file(
                    model_id, step, name, directory / name, sha256=committed.get(name)
                )
        return directory

    async def sleep(self) -> None:
        """Stop routing here, then sleep the engine once its requests in flight finished, or
        aborted once they had ``engine_sleep_wait_s``."""
        if not self._options.sleep_engine_during_training or self.asleep:
            return
        wait_s = self._options.engine_sleep_wait_s
        timeout_s = self._options.engine_sleep_timeout_s
        async with self._lock:
            self.asleep = True
            try:
                await self.on_asleep()
            except Exception:
                logger.exception("could not tell the control plane the engine sleeps")
            try:
                await self.engine.sleep(mode="wait", timeout_s=wait_s)
                return
            except EngineTimeout:
                logger.warning(
                    "requests in flight did not finish within %.0fs "
                    "(SKYTRAIN_ENGINE_SLEEP_WAIT_S): aborting them to train",
                    wait_s,
                )
            # The engine goes on with the waiting sleep; this one ends what it waits for.
            try:
                await self.engine.sleep(mode="abort", timeout_s=timeout_s)
            except EngineTimeout as exc:
                raise EngineTimeout(
                    f"the engine did not go to sleep within {timeout_s:.0f}s of aborting its "
                    f"requests ({exc.message}): raise SKYTRAIN_ENGINE_SLEEP_TIMEOUT_S if moving "
                    "its weights out of the GPU takes longer on this machine"
                ) from exc

    async def wake(self) -> None:
        if not self.asleep:
            return
        timeout_s = self._options.engine_sleep_timeout_s
        async with self._lock:
            try:
                await self.engine.wake_up(timeout_s=timeout_s)
            except EngineTimeout as exc:
                raise EngineTimeout(
                    f"the engine did not wake up within {timeout_s:.0f}s ({exc.message}): raise "
                    "SKYTRAIN_ENGINE_SLEEP_TIMEOUT_S if moving its weights back to the GPU takes "
                    "longer on this machine"
                ) from exc
            self.asleep = False

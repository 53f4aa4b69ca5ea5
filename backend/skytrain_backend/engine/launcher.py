"""Starting an engine as a subprocess and knowing when it is ready, or why it never will be.

The worker runs its engine (``vllm serve`` on CUDA, ``skytrain engine serve`` elsewhere) as a
child process in its own process group, with output going to a log file. Waiting for it polls
``/health`` and watches the process: an engine that dies while loading (out of memory, a bad
model name, a missing CUDA library) fails the wait at once with its last log lines instead of
letting the caller wait out the whole timeout.
"""

from __future__ import annotations

import asyncio
import logging
import os
import sys
from pathlib import Path

from skytrain_backend.child_processes import ChildProcess
from skytrain_backend.config import subprocess_env
from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.options import (
    EngineCommand,
    EngineOptions,
    ResolvedEngine,
)
from skytrain_backend.engine.vllm import vllm_engine_command

logger = logging.getLogger(__name__)

# The CPU engine reads its API key from skytrain's settings (SKYTRAIN_ENGINE_SECRET), not argv.
API_KEY_ENV = "SKYTRAIN_ENGINE_SECRET"


def hf_command(options: EngineOptions) -> EngineCommand:
    """``skytrain engine serve`` for the CPU engine, through this interpreter."""
    argv = [
        sys.executable,
        "-m",
        "skytrain_backend.engine",
        "serve",
        "--engine",
        "hf",
        "--model",
        options.model,
        *options.listen_args,
        "--dtype",
        options.dtype,
    ]
    if options.max_model_len is not None:
        argv += ["--max-model-len", str(options.max_model_len)]
    if options.max_num_seqs is not None:
        argv += ["--max-num-seqs", str(options.max_num_seqs)]
    if options.threads is not None:
        argv += ["--threads", str(options.threads)]
    argv += ["--max-lora-rank", str(options.max_lora_rank)]
    env = {API_KEY_ENV: options.api_key} if options.api_key else {}
    return EngineCommand(argv=argv + list(options.extra_args), env=env)


def engine_command(options: EngineOptions, kind: ResolvedEngine) -> EngineCommand:
    """The command of engine ``kind``; for vLLM this asks its interpreter about the platform
    (seconds), so call it off the event loop."""
    return vllm_engine_command(options) if kind == "vllm" else hf_command(options)


class EngineProcess:
    """One engine subprocess: start, wait until healthy, watch, restart, stop."""

    def __init__(
        self,
        command: EngineCommand,
        *,
        base_url: str,
        log_path: Path,
        api_key: str | None = None,
        startup_timeout_s: float = 900.0,
    ) -> None:
        self.command = command
        self.base_url = base_url
        self.log_path = log_path
        self.api_key = api_key
        self.startup_timeout_s = startup_timeout_s
        self._process: ChildProcess | None = None

    @classmethod
    def for_engine(
        cls,
        options: EngineOptions,
        *,
        kind: ResolvedEngine,
        log_path: Path,
        startup_timeout_s: float = 900.0,
    ) -> EngineProcess:
        """The process of engine ``kind`` serving ``options`` (not started yet)."""
        return cls(
            engine_command(options, kind),
            base_url=options.base_url,
            log_path=log_path,
            api_key=options.api_key,
            startup_timeout_s=startup_timeout_s,
        )

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        logger.info("starting engine: %s (log: %s)", " ".join(self.command.argv), self.log_path)
        # A child process of its own group that dies with the worker (processes.ChildProcess).
        with open(self.log_path, "ab") as log:
            self._process = ChildProcess.start(
                self.command.argv, env=subprocess_env(self.command.env), stdout=log
            )

    def poll(self) -> int | None:
        """The exit code once the process has ended; None while it runs (or never started)."""
        return self._process.poll() if self._process else None

    def is_alive(self) -> bool:
        return self._process is not None and self._process.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        try:
            with open(self.log_path, "rb") as log:
                log.seek(0, os.SEEK_END)
                log.seek(max(log.tell() - 64 * 1024, 0))
                text = log.read().decode("utf-8", errors="replace")
        except FileNotFoundError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    async def launch(self) -> None:
        """Start and return once ``/health`` answers; a process that never does is stopped."""
        self.start()
        try:
            await self.wait_until_healthy()
        except BaseException:
            await asyncio.to_thread(self.stop)
            raise

    async def wait_until_healthy(self, timeout_s: float | None = None) -> None:
        async with EngineClient(self.base_url, api_key=self.api_key) as client:
            await client.wait_until_healthy(timeout_s or self.startup_timeout_s, process=self)

    async def restart(self) -> None:
        await asyncio.to_thread(self.stop)
        await self.launch()

    def stop(self, grace_s: float = 20.0) -> None:
        """SIGTERM the engine's process group, then SIGKILL what is left after ``grace_s``."""
        process = self._process
        if process is None or process.poll() is not None:
            return
        process.stop(grace_s=grace_s)

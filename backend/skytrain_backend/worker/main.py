"""``skytrain worker``: start the engine, then run the agent until told to stop.

The same entry point serves every kind of worker: a subprocess of the embedded control plane
(the ``local`` provider), a SkyPilot cluster, or a machine an operator started by hand.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import logging
import os
import platform
import secrets
import signal
import socket
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from skytrain_backend import __version__
from skytrain_backend.config import EngineKind, Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.worker.agent import AgentOptions, WorkerAgent
from skytrain_backend.worker.client import ControlPlaneClient

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    control_plane_url: str
    token: str
    base_model: str
    engine: EngineKind
    engine_host: str
    engine_port: int
    # The engine's URL as the control plane reaches it (default: http://127.0.0.1:PORT).
    advertise_url: str | None
    work_dir: Path
    device: str | None
    engine_secret: str
    startup_timeout_s: float
    max_models: int

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> WorkerConfig:
        """The settings (``SKYTRAIN_*``), with the CLI's options (None = not given) on top."""
        given = {key: value for key, value in overrides.items() if value is not None}
        control_plane_url = given.pop("control_plane_url", settings.control_plane_url)
        token = given.pop("token", settings.worker_token)
        base_model = given.pop("base_model", settings.worker_base_model)
        missing = [
            flag
            for flag, value in (
                ("--control-plane (SKYTRAIN_CONTROL_PLANE_URL)", control_plane_url),
                ("--token (SKYTRAIN_WORKER_TOKEN)", token),
                ("--base-model (SKYTRAIN_WORKER_BASE_MODEL)", base_model),
            )
            if not value
        ]
        if missing:
            raise ConfigurationError(f"a worker needs {', '.join(missing)}")
        assert control_plane_url and token and base_model
        values: dict[str, Any] = {
            "control_plane_url": control_plane_url.rstrip("/"),
            "token": token,
            "base_model": base_model,
            "engine": settings.engine,
            "engine_host": "127.0.0.1",
            "engine_port": 0,
            "advertise_url": None,
            # One directory per worker token: several workers can share a host and a home.
            "work_dir": settings.home / "worker" / hashlib.sha256(token.encode()).hexdigest()[:12],
            "device": None,
            "engine_secret": settings.engine_secret or secrets.token_urlsafe(24),
            "startup_timeout_s": settings.engine_startup_timeout_s,
            "max_models": settings.worker_max_models,
        }
        values.update(given)
        return cls(**values)


def _free_port(host: str) -> int:
    with socket.socket() as sock:
        sock.bind((host if host not in ("0.0.0.0", "::") else "127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hardware() -> dict[str, Any]:
    info: dict[str, Any] = {
        "host": socket.gethostname(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "pid": os.getpid(),
    }
    with contextlib.suppress(Exception):
        import torch

        if torch.cuda.is_available():
            info["gpu_count"] = torch.cuda.device_count()
            info["gpu_name"] = torch.cuda.get_device_name(0)
    return info


async def run_worker(config: WorkerConfig, settings: Settings) -> None:
    """Start the engine, register, serve and train until SIGTERM/SIGINT or a drain request."""
    from skytrain_backend.engine.client import EngineClient
    from skytrain_backend.engine.launcher import EngineProcess
    from skytrain_backend.engine.options import EngineOptions, select_engine

    kind = select_engine(config.engine)
    port = config.engine_port or _free_port(config.engine_host)
    options = EngineOptions.from_settings(
        settings,
        model=config.base_model,
        port=port,
        host=config.engine_host,
        api_key=config.engine_secret,
        served_model_name=config.base_model,
    )
    config.work_dir.mkdir(parents=True, exist_ok=True)
    logger.info("starting the %s engine for %s on port %d", kind, config.base_model, port)
    engine_process = EngineProcess.for_engine(
        options,
        kind=kind,
        log_path=config.work_dir / "engine.log",
        startup_timeout_s=config.startup_timeout_s,
    )
    await engine_process.launch()
    # torch, transformers and peft take seconds to import: do it now, off the event loop, so
    # the first job does not stall heartbeats and lease renewals.
    await asyncio.to_thread(importlib.import_module, "skytrain_backend.trainer")
    control_plane = ControlPlaneClient(config.control_plane_url, config.token)
    engine = EngineClient(options.base_url, api_key=config.engine_secret)
    agent = WorkerAgent(
        control_plane=control_plane,
        engine=engine,
        engine_process=engine_process,
        options=AgentOptions(
            base_model=config.base_model,
            served_model_name=options.name,
            work_dir=config.work_dir,
            engine_endpoint=config.advertise_url or options.base_url,
            engine_secret=config.engine_secret,
            # vLLM shares the GPU with the trainer: it sleeps while the trainer runs.
            sleep_engine_during_training=kind == "vllm",
            device=config.device,
            max_models=config.max_models,
            tinker_max_runs=settings.worker_tinker_max_runs,
            hardware=_hardware(),
            version=__version__,
        ),
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    try:
        await agent.run()
    finally:
        await control_plane.aclose()
        await engine.aclose()
        await asyncio.to_thread(engine_process.stop)
        logger.info("worker stopped")

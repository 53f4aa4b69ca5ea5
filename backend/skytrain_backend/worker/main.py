"""``skytrain worker``: start the engine and the front door, then run the agent until told to
stop.

The same entry point serves every kind of worker: a subprocess of the embedded control plane
(the ``local`` provider), a SkyPilot cluster, or a machine an operator started by hand. The
engine listens on 127.0.0.1 with a secret only this process knows; the front door
(``frontdoor``) is the worker's one public port: HTTPS with a certificate made here at start,
which the worker registers and the control plane pins.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import importlib
import importlib.util
import logging
import os
import platform
import random
import secrets
import signal
import socket
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import uvicorn

from skytrain_backend import __version__, tls
from skytrain_backend.config import EngineKind, Settings
from skytrain_backend.connections import ConnectionLimits, guarded_protocol
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.observability.http import Observe
from skytrain_backend.protocol import ENGINE_SECRET_CHARS, WorkerCapacity, WorkerRegistration
from skytrain_backend.worker.agent import AgentOptions, WorkerAgent
from skytrain_backend.worker.client import ControlPlaneClient
from skytrain_backend.worker.engine_host import EngineHost
from skytrain_backend.worker.frontdoor import FrontDoor
from skytrain_backend.worker.stats import StatsReader

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerConfig:
    control_plane_url: str
    token: str
    base_model: str
    engine: EngineKind
    # Where the front door (HTTPS, engine secret) listens; port 0: a free one.
    host: str
    port: int
    # The front door's URL as the control plane reaches it (default: the control plane takes
    # the address the registration came from).
    advertise_url: str | None
    work_dir: Path
    device: str | None
    engine_secret: str
    startup_timeout_s: float
    max_models: int
    # None: sleep the engine during jobs when it is vLLM with sleep mode (it shares the GPU
    # with the trainer).
    sleep_engine: bool | None
    trainer_memory_limit_mb: int | None
    max_request_bytes: int

    @classmethod
    def from_settings(cls, settings: Settings, **overrides: Any) -> WorkerConfig:
        """The settings (``SKYTRAIN_*``), with the CLI's options (None = not given) on top."""
        given = {key: value for key, value in overrides.items() if value is not None}
        control_plane_url = given.pop("control_plane_url", settings.worker.control_plane_url)
        token = given.pop("token", settings.worker.token)
        base_model = given.pop("base_model", settings.worker.base_model)
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
        advertise_url = given.get("advertise_url")
        if advertise_url is not None and not advertise_url.startswith("https://"):
            raise ConfigurationError(
                f"--advertise-url {advertise_url!r} must be an https:// URL: the worker's front "
                "door speaks TLS only (https://HOST:PORT, the address the control plane reaches)"
            )
        values: dict[str, Any] = {
            "control_plane_url": control_plane_url.rstrip("/"),
            "token": token,
            "base_model": base_model,
            "engine": settings.engine.kind,
            "host": settings.worker.host,
            "port": settings.worker.port,
            "advertise_url": None,
            # One directory per worker token: several workers can share a host and a home.
            "work_dir": settings.storage.home
            / "worker"
            / hashlib.sha256(token.encode()).hexdigest()[:12],
            "device": None,
            "engine_secret": settings.engine.secret or secrets.token_urlsafe(24),
            "startup_timeout_s": settings.engine.startup_timeout_s,
            "max_models": settings.worker.max_models,
            "sleep_engine": settings.worker.sleep_engine,
            "trainer_memory_limit_mb": settings.trainer.memory_limit_mb,
            "max_request_bytes": settings.server.max_request_bytes,
        }
        values.update(given)
        shortest, longest = ENGINE_SECRET_CHARS
        if not shortest <= len(values["engine_secret"]) <= longest:
            # Checked here, not at registration: before the engine takes minutes to start.
            raise ConfigurationError(
                f"SKYTRAIN_ENGINE_SECRET must be {shortest} to {longest} characters long (it "
                f"has {len(values['engine_secret'])}); unset it and the worker makes one"
            )
        return cls(**values)


# Where the engine's port is drawn from when the kernel's range for outgoing connections
# leaves room below it (``engine_port``).
ENGINE_PORTS_FROM = 10_000
EPHEMERAL_RANGE = Path("/proc/sys/net/ipv4/ip_local_port_range")


def engine_port() -> int:
    """A loopback port free now for the engine, which binds it only once its model has loaded
    (seconds to minutes later). Drawn below the kernel's range for outgoing connections and
    ``bind(0)``: a port of that range is often taken meanwhile by any connection on the host
    (the engine then fails with 'address already in use'), a port below it only by a server
    choosing it as well."""
    try:
        low = int(EPHEMERAL_RANGE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        low = 0
    for _ in range(64 if low > ENGINE_PORTS_FROM + 1 else 0):
        port = random.randrange(ENGINE_PORTS_FROM, low)
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _hardware() -> dict[str, str | int | None]:
    info: dict[str, str | int | None] = {
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


def import_unsloth_first() -> None:
    """Import Unsloth before anything imports transformers, peft or trl: it patches them at
    import time and warns (losing its optimisations) when it comes second."""
    if importlib.util.find_spec("unsloth") is None:
        return
    late = sorted(name for name in ("transformers", "peft", "trl") if name in sys.modules)
    if late:
        logger.warning("unsloth is imported after %s: its patches may not apply", late)
    try:
        importlib.import_module("unsloth")
    except Exception as exc:  # unsloth refuses some GPUs and versions at import time
        logger.warning("unsloth is installed but failed to import (%s); training uses peft", exc)


def _certificate_hosts(config: WorkerConfig) -> list[str]:
    hosts = ["127.0.0.1", "localhost", socket.gethostname()]
    if config.advertise_url:
        hosts.insert(0, httpx.URL(config.advertise_url).host)
    if config.host not in ("0.0.0.0", "::", ""):
        hosts.insert(0, config.host)
    return hosts


def _write_tls_files(directory: Path, certificate: str, key: str) -> tuple[Path, Path]:
    directory.mkdir(parents=True, exist_ok=True)
    certificate_path, key_path = directory / "front-door.crt", directory / "front-door.key"
    certificate_path.write_text(certificate)
    key_path.touch(mode=0o600)
    key_path.chmod(0o600)
    key_path.write_text(key)
    return certificate_path, key_path


def front_door_protocol(settings: Settings) -> type[asyncio.Protocol]:
    """The front door's HTTP protocol: uvicorn's, counted and timed before a request is
    parsed (``connections.py``, ``ConnectionLimits.for_front_door``)."""
    return guarded_protocol(ConnectionLimits.for_front_door(settings))


class _FrontDoorServer(uvicorn.Server):
    """uvicorn inside the worker's event loop: the worker handles SIGTERM/SIGINT itself."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def run_worker(config: WorkerConfig, settings: Settings) -> None:
    """Start the engine and the front door, register, serve and train until SIGTERM/SIGINT
    or a drain request."""
    from skytrain_backend.engine.options import select_engine

    kind = select_engine(config.engine, vllm_python=settings.engine.vllm_python)
    if kind == "vllm":
        import_unsloth_first()
    from skytrain_backend.engine.client import EngineClient
    from skytrain_backend.engine.launcher import EngineProcess
    from skytrain_backend.engine.options import EngineOptions
    from skytrain_backend.planning import lora_rank_slot
    from skytrain_backend.worker.sizing import (
        check_machine,
        cuda_gpus,
        size_this_worker,
        this_machine,
    )
    from skytrain_backend.worker.trainer_python import trainer_python

    # The memory plan fills in what the worker was not told (on CUDA; worker.sizing).
    sizing = await asyncio.to_thread(size_this_worker, settings, base_model=config.base_model)
    # Before anything loads: a host or GPU short of what the plan needs stops the worker now.
    check_machine(sizing, await asyncio.to_thread(this_machine), base_model=config.base_model)
    # The engine listens on loopback with a secret of its own: only this worker reaches it.
    engine_key = secrets.token_urlsafe(32)
    options = EngineOptions.from_settings(
        settings,
        model=config.base_model,
        port=engine_port(),
        host="127.0.0.1",
        api_key=engine_key,
        served_model_name=config.base_model,
        **sizing.engine,
    )
    control_plane = ControlPlaneClient(config.control_plane_url, config.token)
    try:
        # Before the engine starts (minutes for a large model): a wrong token fails now.
        await control_plane.check(config.base_model)
    except BaseException:
        await control_plane.aclose()
        raise
    config.work_dir.mkdir(parents=True, exist_ok=True)
    certificate, key = tls.self_signed_certificate(_certificate_hosts(config))
    certificate_path, key_path = _write_tls_files(config.work_dir / "tls", certificate, key)
    logger.info(
        "starting the %s engine for %s on 127.0.0.1:%d", kind, config.base_model, options.port
    )
    # Off the event loop: for vLLM this asks its interpreter about the platform (seconds).
    engine_process = await asyncio.to_thread(
        EngineProcess.for_engine,
        options,
        kind=kind,
        log_path=config.work_dir / "engine.log",
        startup_timeout_s=config.startup_timeout_s,
    )
    await engine_process.launch()
    # torch, transformers and peft take seconds to import: do it now, off the event loop, so
    # the first job does not stall heartbeats and lease renewals.
    await asyncio.to_thread(importlib.import_module, "skytrain_backend.trainer")

    front_door = FrontDoor(
        engine_url=options.base_url,
        engine_api_key=engine_key,
        secret=config.engine_secret,
        max_body_bytes=config.max_request_bytes,
    )
    listener = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind((config.host, config.port))
    port = int(listener.getsockname()[1])
    server = _FrontDoorServer(
        uvicorn.Config(
            # Each request's id (the gateway's) binds to its log lines and goes to the engine.
            Observe(front_door, count=False),
            # Connections counted and timed before a request is parsed, as the control
            # plane's (connections.py): the front door is reachable from the internet.
            http=front_door_protocol(settings),
            log_config=None,
            ssl_certfile=str(certificate_path),
            ssl_keyfile=str(key_path),
            log_level="warning",
            timeout_graceful_shutdown=5,
        )
    )
    serving = asyncio.create_task(server.serve(sockets=[listener]), name="front-door")
    while not server.started:
        if serving.done():
            await serving
            raise ConfigurationError(
                f"the worker's front door could not listen on {config.host}:{port}"
            )
        await asyncio.sleep(0.05)
    logger.info(
        "front door on https://%s:%d (certificate %s)",
        config.host,
        port,
        tls.fingerprint(certificate),
    )

    engine = EngineClient(options.base_url, api_key=engine_key)
    # By default vLLM sleeps during jobs where that frees its memory (not on vLLM's CPU build).
    sleep_engine = (
        kind == "vllm" and engine_process.command.sleep_frees_memory
        if config.sleep_engine is None
        else config.sleep_engine
    )
    limit_mb = config.trainer_memory_limit_mb
    agent_options = AgentOptions(
        registration=WorkerRegistration(
            base_model=config.base_model,
            served_model_name=options.name,
            engine_secret=config.engine_secret,
            port=port,
            certificate=certificate,
            advertise_url=config.advertise_url,
            capacity=WorkerCapacity(
                max_models=config.max_models,
                max_lora_rank=lora_rank_slot(options.max_lora_rank)
                if kind == "vllm"
                else options.max_lora_rank,
            ),
            hardware=_hardware(),
            version=__version__,
        ),
        work_dir=config.work_dir,
        sleep_engine_during_training=sleep_engine,
        engine_sleep_wait_s=settings.engine.sleep_wait_s,
        engine_sleep_timeout_s=settings.engine.sleep_timeout_s,
        unload_wait_s=settings.worker.unload_wait_s,
        device=config.device,
        trainer_memory_limit_bytes=limit_mb * 1024 * 1024 if limit_mb else None,
        trainer_options=sizing.trainer,
        trainer_shards=sizing.trainer_shards,
        trainer_python=trainer_python(
            settings.worker.unsloth_python,
            cuda=cuda_gpus() is not None,
            trainer_shards=sizing.trainer_shards,
            device=config.device,
        ),
        tinker_max_runs=settings.worker.tinker_max_runs,
    )
    agent = WorkerAgent(
        control_plane=control_plane,
        host=EngineHost(
            control_plane,
            engine,
            engine_process,
            agent_options,
            requests_in_flight=front_door.requests_for,
        ),
        options=agent_options,
        stats=StatsReader(
            running_requests=lambda: front_door.in_flight,
            engine=engine,
            read_kv_cache=kind == "vllm",
        ),
    )
    loop = asyncio.get_running_loop()
    for signum in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(signum, agent.stop)
    try:
        await agent.run()
    finally:
        server.should_exit = True
        with contextlib.suppress(Exception):
            await serving
        await control_plane.aclose()
        await engine.aclose()
        await asyncio.to_thread(engine_process.stop)
        logger.info("worker stopped")

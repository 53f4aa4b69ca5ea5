"""What a worker measures of itself for the operator's metrics, sent with every heartbeat
(workers open no port for Prometheus): requests its engine is generating for (the front
door's count in flight), the engine's KV-cache use (vLLM's own ``/metrics``, read on
loopback), and GPU memory (CUDA's count, all GPUs together). What cannot be known here is
left out, never guessed."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

from skytrain_backend.protocol import WorkerStats

logger = logging.getLogger(__name__)

# vLLM's names for its KV-cache use (0-1) across versions.
_KV_SERIES = ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc")


class StatsReader:
    def __init__(
        self,
        *,
        running_requests: Callable[[], int],
        engine: Any | None = None,
        read_kv_cache: bool = False,
    ) -> None:
        self._running_requests = running_requests
        self._engine = engine
        self._read_kv_cache = read_kv_cache

    async def read(self) -> WorkerStats:
        # NVML or torch, off the loop that also serves the front door and runs jobs.
        used, total = await asyncio.to_thread(gpu_memory)
        kv = await self._kv_cache_usage() if self._read_kv_cache else None
        return WorkerStats(
            running_requests=self._running_requests(),
            kv_cache_usage=kv,
            gpu_memory_used_bytes=used,
            gpu_memory_total_bytes=total,
        )

    async def _kv_cache_usage(self) -> float | None:
        if self._engine is None:
            return None
        with contextlib.suppress(Exception):
            text = await self._engine.metrics_text()  # loopback, 2 s at most
            return kv_cache_usage(text)
        return None


def kv_cache_usage(text: str) -> float | None:
    """The mean KV-cache use across the engine's series (one per engine core), from vLLM's
    Prometheus text; None when it has none."""
    values = []
    for line in text.splitlines():
        if line.startswith(_KV_SERIES):
            with contextlib.suppress(ValueError, IndexError):
                values.append(float(line.rsplit(" ", 1)[1]))
    if not values:
        return None
    return min(1.0, max(0.0, sum(values) / len(values)))


def gpu_memory() -> tuple[int | None, int | None]:
    """Used and total bytes of this machine's GPUs, all processes' (None, None when unknown).

    NVML first (``pynvml``, which vLLM's image carries): it reads the driver's figures without
    a CUDA context. Else CUDA's own count, but only once this process has a context (the
    trainer made one): making one just to measure would take GPU memory from vLLM."""
    try:
        return _nvml_memory()
    except Exception:
        logger.debug("NVML unavailable", exc_info=True)
    try:
        import torch

        if not torch.cuda.is_available() or not torch.cuda.is_initialized():
            return None, None
        used = total = 0
        for index in range(torch.cuda.device_count()):
            free, size = torch.cuda.mem_get_info(index)
            used, total = used + size - free, total + size
        return used, total
    except Exception:
        logger.debug("GPU memory unknown", exc_info=True)
        return None, None


def _nvml_memory() -> tuple[int, int]:
    import pynvml

    pynvml.nvmlInit()
    try:
        used = total = 0
        for index in range(pynvml.nvmlDeviceGetCount()):
            info = pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(index))
            used, total = used + int(info.used), total + int(info.total)
        return used, total
    finally:
        pynvml.nvmlShutdown()

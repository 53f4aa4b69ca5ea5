"""What a worker reports of itself in heartbeats for the operator's metrics."""

from __future__ import annotations

import asyncio

import pytest
import torch

from skytrain_backend.worker.stats import StatsReader, gpu_memory, kv_cache_usage

# The shape of vLLM's exposition: a gauge per engine core, comments, other series.
VLLM_TEXT = """# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.75
vllm:num_requests_running{engine="0",model_name="m"} 3.0
"""


def test_kv_cache_use_is_the_mean_of_the_engines_series() -> None:
    assert kv_cache_usage(VLLM_TEXT) == 0.5
    assert kv_cache_usage("vllm:num_requests_running 1.0\n") is None
    assert kv_cache_usage('vllm:gpu_cache_usage_perc{engine="0"} 7\n') == 1.0  # clamped


class _Engine:
    def __init__(self, text: str | Exception) -> None:
        self.text = text

    async def metrics_text(self) -> str:
        if isinstance(self.text, Exception):
            raise self.text
        return self.text


def test_stats_report_what_is_known_and_leave_out_the_rest() -> None:
    reader = StatsReader(running_requests=lambda: 2, engine=_Engine(VLLM_TEXT), read_kv_cache=True)
    stats = asyncio.run(reader.read())
    assert stats.running_requests == 2 and stats.kv_cache_usage == 0.5
    failing = StatsReader(
        running_requests=lambda: 0, engine=_Engine(OSError("down")), read_kv_cache=True
    )
    assert asyncio.run(failing.read()).kv_cache_usage is None
    if not torch.cuda.is_available():
        assert stats.gpu_memory_used_bytes is None and stats.gpu_memory_total_bytes is None


def test_no_cuda_context_is_made_just_to_measure() -> None:
    if not torch.cuda.is_available():
        assert gpu_memory() == (None, None)
        return
    initialized = torch.cuda.is_initialized()
    gpu_memory()
    assert torch.cuda.is_initialized() == initialized


@pytest.mark.gpu
def test_gpu_memory_counts_what_is_allocated() -> None:
    torch.zeros(1, device="cuda")  # this process's context, as the trainer's
    used_before, total = gpu_memory()
    block = torch.empty(256 * 1024 * 1024, dtype=torch.uint8, device="cuda")
    used_after, _ = gpu_memory()
    assert total is not None and used_before is not None and used_after is not None
    assert used_after - used_before >= block.numel()
    assert used_after <= total

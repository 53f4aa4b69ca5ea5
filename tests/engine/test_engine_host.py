"""The worker's engine host keeps a step loaded for a commit until the control plane knows it.

A Tinker sampler save (or a job's new step) is loaded into the engine, then committed; the
heartbeat's answer (what is placed on the worker) may have been read by the control plane
before that commit. The host used to unload such a step at once, while the commit told the
gateway it was served: the next request got 503 "does not serve step 1" (seen in a full run
of the suite, the Tinker SDK's save then sample). The real CPU engine; the control plane is
never reached by what this test does.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from skytrain_backend.protocol import lora_name
from skytrain_backend.worker.client import ControlPlaneClient
from skytrain_backend.worker.engine_host import EngineHost
from tests.engine.conftest import RunningEngine
from tests.worker.support import agent_options


async def test_a_step_loaded_for_a_commit_outlives_an_answer_read_before_the_commit(
    tiny_engine: RunningEngine,
    tiny_model_path: Path,
    make_adapter: Callable[..., Path],
    tmp_path: Path,
) -> None:
    key = ("a" * 32, 1)
    name = lora_name(*key)
    async with tiny_engine.client() as engine:
        unused = ControlPlaneClient("http://127.0.0.1:9", "unused")
        options = agent_options(tiny_model_path, tmp_path, engine_sleep_wait_s=1.0)
        host = EngineHost(unused, engine, None, options)
        try:
            asked = time.monotonic()  # a heartbeat built now: its answer lists nothing here
            assert await host.serve_checkpoint(*key, make_adapter(tiny_model_path, seed=7))
            await host.sync_adapters(set(), asked_at=asked)  # the commit is in flight
            assert key in host.served and await engine.is_serving(name)
            host.confirm(key)  # the commit returned
            await host.sync_adapters(set(), asked_at=asked)  # answered before it, read after
            assert key in host.served and await engine.is_serving(name)
            # A heartbeat built after the commit: its answer knows the step, and no longer
            # places it here (the model moved): now it goes.
            await host.sync_adapters(set(), asked_at=time.monotonic())
            assert key not in host.served and not await engine.is_serving(name)
        finally:
            await host.unload(key)
            await unused.aclose()

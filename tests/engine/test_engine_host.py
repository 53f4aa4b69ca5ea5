"""The worker's engine host keeps a step loaded for a commit until the control plane knows it.

A Tinker sampler save (or a job's new step) is loaded into the engine, then committed; the
heartbeat's answer (what is placed on the worker) may have been read by the control plane
before that commit. The host used to unload such a step at once, while the commit told the
gateway it was served: the next request got 503 "does not serve step 1" (seen in a full run
of the suite, the Tinker SDK's save then sample). The real CPU engine; the control plane is
never reached by what this test does.
"""

from __future__ import annotations

import asyncio
import logging
import secrets
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from skytrain_backend.protocol import lora_name
from skytrain_backend.worker.client import ControlPlaneClient
from skytrain_backend.worker.engine_host import EngineHost
from skytrain_backend.worker.frontdoor import FrontDoor
from tests.engine.conftest import RunningEngine, start_engine
from tests.fixtures.tls import serve_tls
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


@pytest.fixture
def one_place_engine(tiny_model_path: Path, tmp_path: Path) -> Iterator[RunningEngine]:
    """The CPU engine with one place per caller (``--max-num-seqs 2``: one is reserved for
    another caller)."""
    engine = start_engine(tiny_model_path, "one-place", tmp_path, "--max-num-seqs", "2")
    yield engine
    engine.process.stop()


async def test_a_model_taken_off_the_worker_is_unloaded_once_its_requests_in_flight_end(
    one_place_engine: RunningEngine,
    tiny_model_path: Path,
    make_adapter: Callable[..., Path],
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Issue 35: scale-in never drops a request in flight. The scheduler drops a replica once
    its own gateway has none in flight there, but another control plane's gateway may still
    have one on its way: the worker's front door counts them per model, and the worker keeps
    the adapter loaded until they are answered (it used to unload it at once, and a request
    queued in the engine got 404 "unloaded before the request started").

    The real CPU engine with one place per caller, behind the real front door: a long stream
    holds the place, and a second request for the same adapter waits in the engine's queue
    while the model leaves the worker."""
    engine = one_place_engine
    key = ("c" * 32, 1)
    name = lora_name(*key)
    secret = secrets.token_urlsafe(24)
    door = FrontDoor(
        engine_url=engine.base_url, engine_api_key=None, secret=secret, max_body_bytes=1 << 20
    )
    unused = ControlPlaneClient("http://127.0.0.1:9", "unused")
    try:
        with serve_tls(door) as server:
            async with (
                engine.client() as client,
                server.async_client(secret=secret) as http,
            ):
                host = EngineHost(
                    unused,
                    client,
                    None,
                    agent_options(tiny_model_path, tmp_path),
                    requests_in_flight=door.requests_for,
                )
                assert await host.serve_checkpoint(*key, make_adapter(tiny_model_path, seed=5))
                host.confirm(key)
                messages = [{"role": "user", "content": "Tell a long story."}]
                long = {"model": name, "messages": messages, "max_tokens": 3500}
                long |= {"ignore_eos": True, "logprobs": True, "top_logprobs": 20, "stream": True}
                async with http.stream("POST", "/v1/chat/completions", json=long) as first:
                    assert first.status_code == 200, await first.aread()
                    lines = first.aiter_lines()  # held: dropping it would close the stream
                    assert (await anext(lines)).startswith("data: ")
                    queued = asyncio.create_task(
                        http.post(
                            "/v1/chat/completions",
                            json={"model": name, "messages": messages, "max_tokens": 4},
                        )
                    )
                    while door.requests_for(name) < 2:
                        assert not queued.done(), queued.result().text
                        await asyncio.sleep(0.02)
                    # The heartbeat's answer no longer places the model here.
                    with caplog.at_level(logging.INFO, logger="skytrain_backend.worker"):
                        await host.sync_adapters(set(), asked_at=time.monotonic())
                    assert key in host.served and await client.is_serving(name)
                    assert "2 requests in flight" in caplog.text
                # The stream ended (its caller left): the queued request gets its turn.
                answer = await queued
                assert answer.status_code == 200, answer.text
                assert answer.json()["choices"][0]["message"]["content"]
                assert door.requests_for(name) == 0
                await host.sync_adapters(set(), asked_at=time.monotonic())
                assert key not in host.served and not await client.is_serving(name)
    finally:
        await unused.aclose()

"""Which failures move a request to another replica (``Engines.send`` raising Unavailable)
and which do not: one the engine never received moves; one that may have reached it does not,
so a prompt that stops engines stops one at the most. A raw TCP server in this process plays
the engine's socket."""

from __future__ import annotations

import asyncio

import pytest

from skytrain_backend.api.gateway.upstream import Engines
from skytrain_backend.errors import EngineError, Unavailable
from skytrain_backend.scheduler.routing import EngineRoute
from tests.fixtures.ports import port_outside_the_ephemeral_range


def _route(port: int) -> EngineRoute:
    return EngineRoute(
        model_id="m",
        step=0,
        worker_id="w1",
        engine_endpoint=f"http://127.0.0.1:{port}",
        engine_secret="secret",
        engine_certificate=None,
        engine_model="base",
    )


async def _send(engines: Engines, port: int) -> None:
    await engines.send(
        route=_route(port), path="/v1/chat/completions", body={"messages": []}, tenant_id="t"
    )


async def test_a_request_the_engine_may_have_read_is_not_moved_to_another_replica() -> None:
    port = port_outside_the_ephemeral_range()
    read: list[bytes] = []
    stopped = asyncio.Event()

    async def read_then_stop(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        read.append(await reader.readuntil(b"\r\n\r\n"))
        server.close()  # the engine stops: its next connection is refused
        writer.close()
        stopped.set()

    server = await asyncio.start_server(read_then_stop, "127.0.0.1", port)
    engines = Engines()
    try:
        with pytest.raises(EngineError, match="closed the connection without answering") as err:
            await _send(engines, port)
        assert len(read) == 1 and stopped.is_set()
        assert "127.0.0.1" not in err.value.message and str(port) not in err.value.message
        # An engine that refuses the connection never had the request: that one moves.
        with pytest.raises(Unavailable, match="cannot be reached"):
            await _send(engines, port)
    finally:
        await engines.aclose()

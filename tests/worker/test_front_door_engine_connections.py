"""The front door's kept connections to its engine: one the engine closes as a request arrives
on it costs the caller nothing, and none is kept long enough for the engine to close it.

Every engine (uvicorn, under vLLM and the CPU engine) closes a connection idle for its
keep-alive, 5 s. A client that reuses a connection the engine is closing at that moment
loses the request: nothing reached the engine, and the connection breaks before an answer.
"""

from __future__ import annotations

import asyncio
import secrets
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

import httpx
import uvicorn

from skytrain_backend.worker.frontdoor import FrontDoor
from tests.fixtures.tls import serve_tls

HEALTHY = b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\ncontent-length: 2\r\n\r\n{}"


@dataclass
class EngineLike:
    """An engine-like HTTP server that answers ``GET /health`` and counts the connections it
    accepts. With ``closes_reused``, its keep-alive runs out on every connection as the next
    request arrives: it answers a connection's first request and closes the connection on its
    second, unanswered, as an engine does when its keep-alive closes a connection that a
    request was already on its way to."""

    closes_reused: bool = False
    connections: int = 0
    answered: int = 0
    closed_unanswered: int = 0
    _loop: asyncio.AbstractEventLoop = field(default_factory=asyncio.new_event_loop)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.connections += 1
        requests = 0
        try:
            while await reader.readuntil(b"\r\n\r\n"):  # the front door's GETs have no body
                requests += 1
                if self.closes_reused and requests > 1:
                    self.closed_unanswered += 1
                    return
                writer.write(HEALTHY)
                await writer.drain()
                self.answered += 1
        except asyncio.IncompleteReadError:
            pass
        finally:
            writer.close()

    @contextmanager
    def serving(self) -> Iterator[str]:
        sock = socket.socket()
        sock.bind(("127.0.0.1", 0))
        server = self._loop.run_until_complete(asyncio.start_server(self._connection, sock=sock))
        thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        thread.start()
        try:
            yield f"http://127.0.0.1:{sock.getsockname()[1]}"
        finally:
            self._loop.call_soon_threadsafe(server.close)
            self._loop.call_soon_threadsafe(self._loop.stop)
            thread.join(30)


@contextmanager
def front_door_before(engine_url: str) -> Iterator[httpx.Client]:
    """The front door in front of ``engine_url``, and a client holding its secret."""
    secret = secrets.token_urlsafe(24)
    app = FrontDoor(engine_url=engine_url, engine_api_key=None, secret=secret, max_body_bytes=1024)
    with (
        serve_tls(app) as server,
        server.client(secret=secret, timeout=30) as http,
    ):
        yield http


def test_request_on_a_connection_the_engine_closes_as_it_arrives_is_sent_again() -> None:
    engine = EngineLike(closes_reused=True)
    with engine.serving() as engine_url, front_door_before(engine_url) as http:
        assert http.get("/health").status_code == 200
        # The front door reuses its connection; the engine closes it as the request arrives.
        second = http.get("/health")
    assert second.status_code == 200, second.text
    assert (engine.connections, engine.answered, engine.closed_unanswered) == (2, 2, 1)


def test_connection_idle_nearly_as_long_as_the_engines_keep_alive_is_not_reused() -> None:
    engine = EngineLike()
    # The keep-alive of uvicorn, the engines' server, as they run it (vLLM's default is the same).
    keep_alive_s = uvicorn.Config(None).timeout_keep_alive
    with engine.serving() as engine_url, front_door_before(engine_url) as http:
        assert http.get("/health").status_code == 200
        assert http.get("/health").status_code == 200
        assert engine.connections == 1, "back-to-back requests share a connection"
        # Within a second of the engine closing the connection: the front door must not send
        # on it (the sleep lets the time pass; nothing is asserted about durations).
        time.sleep(keep_alive_s - 1)
        assert http.get("/health").status_code == 200
    assert engine.connections == 2, (
        "a connection nearly as old as the engine's keep-alive was reused"
    )


def test_an_engine_that_cannot_be_reached_is_a_503_saying_so() -> None:
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))  # bound, never listening: connections are refused
    with front_door_before(f"http://127.0.0.1:{sock.getsockname()[1]}") as http:
        answer = http.get("/health")
    sock.close()
    assert answer.status_code == 503
    error = answer.json()["error"]
    assert error["type"] == "service_unavailable"
    assert "cannot be reached" in error["message"] and "127.0.0.1" not in error["message"]

"""``skytrain serve`` keeps an idle client connection open longer than clients keep theirs.

httpx (under the SDK, the OpenAI and Tinker SDKs and the workers) drops an idle connection
after 5 s, as uvicorn does by default: a client reusing its connection just as the server
closes it has that request reset. The server waits ``SKYTRAIN_KEEP_ALIVE_S`` (75 s), so the
client always closes first. Both cases on one real ``skytrain serve`` each, over a raw socket,
so nothing reconnects behind the test's back.
"""

from __future__ import annotations

import socket
import time
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlsplit

import pytest

from tests.fixtures.raw_http import exchange
from tests.fixtures.service import Service, start_service, stop_service

# Past httpx's and uvicorn's 5 s: what a client pausing between two requests does.
PAUSE_S = 6.5


def _health(connection: socket.socket) -> bytes:
    """One keep-alive ``GET /health`` on ``connection``; the answer's head (b'' if closed)."""
    head, _ = exchange(connection, b"GET /health HTTP/1.1\r\nHost: skytrain\r\n\r\n")
    return head


def _connect(service: Service) -> socket.socket:
    address = urlsplit(service.url)
    assert address.hostname is not None and address.port is not None
    return socket.create_connection((address.hostname, address.port), timeout=30)


@pytest.fixture
def service(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Service]:
    overrides = {"SKYTRAIN_PROVIDER": "none", **getattr(request, "param", {})}
    served = start_service(overrides, tmp_path / "home")
    yield served
    stop_service(served)


@pytest.mark.slow
def test_an_idle_connection_outlives_the_clients_own_idle_timeout(service: Service) -> None:
    with _connect(service) as connection:
        assert _health(connection).startswith(b"HTTP/1.1 200")
        time.sleep(PAUSE_S)
        # Still open: the same socket carries the next request.
        assert _health(connection).startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("service", [{"SKYTRAIN_KEEP_ALIVE_S": "1"}], indirect=True)
@pytest.mark.slow
def test_the_server_closes_a_connection_idle_past_its_keep_alive(service: Service) -> None:
    with _connect(service) as connection:
        assert _health(connection).startswith(b"HTTP/1.1 200")
        # The server's end closes after its second: EOF, well before uvicorn's own 5 s.
        connection.settimeout(4)
        assert connection.recv(1) == b""

"""A worker's front door is reachable from the internet: it had no connection cap and no header
deadline, so anyone could hold its connections (and descriptors) open without a secret. It now
takes the control plane's guarded protocol (``connections.py``), sized for the worker."""

from __future__ import annotations

import secrets
import socket
import ssl

from skytrain_backend import tls
from skytrain_backend.config import Settings
from skytrain_backend.connections import ConnectionLimits
from skytrain_backend.worker.frontdoor import FrontDoor
from skytrain_backend.worker.main import front_door_protocol
from tests.fixtures.tls import serve_tls


def _connect(port: int, context: ssl.SSLContext) -> ssl.SSLSocket:
    raw = socket.create_connection(("127.0.0.1", port), timeout=30)
    return context.wrap_socket(raw, server_hostname="127.0.0.1")


def _answer(connection: ssl.SSLSocket) -> bytes:
    answer = b""
    while chunk := connection.recv(65536):
        answer += chunk
    return answer


def test_the_front_door_cuts_slow_headers_and_refuses_connections_past_its_cap() -> None:
    settings = Settings(server={"header_timeout_s": 1, "max_connections": 2})
    limits = ConnectionLimits.for_front_door(settings)
    # Its one client (the control plane's gateway) may hold every connection.
    assert (limits.max_connections, limits.max_per_client) == (2, 2)
    app = FrontDoor(
        engine_url="http://127.0.0.1:9",  # never reached: nothing here gets past the door
        engine_api_key=None,
        secret=secrets.token_urlsafe(24),
        max_body_bytes=1024,
    )
    with serve_tls(app, http=front_door_protocol(settings)) as server:
        context = tls.pinned_context(server.certificate)
        with _connect(server.port, context) as slow, _connect(server.port, context) as idle:
            slow.sendall(b"GET /health HTTP/1.1\r\nX-Slow: ")
            with _connect(server.port, context) as third:
                refused = _answer(third)
            assert refused.startswith(b"HTTP/1.1 503 "), refused
            assert b"SKYTRAIN_MAX_CONNECTIONS" in refused
            # Both held ones are closed by the server at the header deadline, with a 408.
            for connection in (slow, idle):
                answer = _answer(connection)
                assert answer.startswith(b"HTTP/1.1 408 "), answer
        with _connect(server.port, context) as again:  # room again once they are gone
            again.sendall(b"GET /health HTTP/1.1\r\nHost: w\r\nConnection: close\r\n\r\n")
            assert not _answer(again).startswith(b"HTTP/1.1 503 ")

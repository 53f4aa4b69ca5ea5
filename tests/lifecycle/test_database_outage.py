"""With the database down, every request is answered 503 ``database_unavailable`` on a
connection that stays open: the client's next request on it is answered too.

Requests are refused before any route runs by middlewares that read the database (a tenant's
REST admission, a worker's token); an error raised there must be answered there, or Starlette
raises it again for the server after answering, and uvicorn closes the connection (the
client's next request on it is reset). The control plane is the real app over HTTP on a PostgreSQL server of
the test's own, stopped by the test; one raw socket carries every request, so nothing
reconnects behind the test's back.
"""

from __future__ import annotations

import json
import socket
from urllib.parse import urlsplit

import pytest

from skytrain_backend.app import create_app
from skytrain_backend.db import api_keys
from skytrain_backend.db.session import create_db_engine, session_factory
from tests.fixtures.postgres import PostgresServer
from tests.fixtures.raw_http import exchange
from tests.fixtures.services import MakeSettings
from tests.gateway.conftest import serve_in_thread

pytestmark = pytest.mark.postgres


def _ask(connection: socket.socket, request: bytes) -> tuple[int, dict[str, object], bytes]:
    """Send one HTTP/1.1 request on ``connection``; its status, JSON body and raw head."""
    head, body = exchange(connection, request)
    assert head, "the server closed the connection"
    return int(head.split(b" ", 2)[1]), json.loads(body), head


def _request(method: str, path: str, token: str, body: bytes = b"") -> bytes:
    return (
        f"{method} {path} HTTP/1.1\r\nHost: skytrain\r\nAuthorization: Bearer {token}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    ).encode() + body


def test_requests_during_an_outage_get_503_and_keep_their_connection(
    make_settings: MakeSettings, private_postgres: PostgresServer
) -> None:
    settings = make_settings(storage={"database_url": private_postgres.url})
    engine = create_db_engine(settings.storage.resolved_database_url)
    with session_factory(engine)() as session:
        _, key = api_keys.create_key(session, tenant_name="alice")
    engine.dispose()
    with serve_in_thread(create_app(settings)) as url:
        address = urlsplit(url)
        assert address.hostname is not None and address.port is not None
        with socket.create_connection((address.hostname, address.port), timeout=60) as conn:
            status, _, _ = _ask(conn, _request("GET", "/v1/models", key))
            assert status == 200
            private_postgres.stop()
            try:
                refused = [
                    # A tenant's request: its REST admission counts it in the database.
                    _ask(conn, _request("GET", "/v1/models", key)),
                    # A worker's: its token is checked before the route.
                    _ask(conn, _request("POST", "/v1/worker/heartbeat", "wt-unknown", b"{}")),
                    # And the connection still carries the next one.
                    _ask(conn, _request("GET", "/v1/training-jobs", key)),
                ]
            finally:
                private_postgres.start_again()  # so the app's shutdown finds its database
        for status, body, head in refused:
            assert status == 503, body
            error = body["error"]
            assert isinstance(error, dict) and error["type"] == "database_unavailable", body
            assert b"connection: close" not in head.lower()
            assert str(private_postgres.port) not in json.dumps(body)

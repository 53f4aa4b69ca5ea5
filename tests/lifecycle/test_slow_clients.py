"""No connection, keyless and slow, holds ``skytrain serve``'s door open (connections.py).

Against the real server on PostgreSQL with 4,096 open files: 8,000 connections from one
address trickle their headers and are all closed by the server (at once past the caps, at the
header timeout otherwise), while another client's requests, each on a new connection from
another address, keep being answered. The smaller limits are checked on a server of their own
with small settings, over raw sockets.
"""

from __future__ import annotations

import resource
import socket
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from skytrain_backend.config import Settings
from skytrain_backend.connections import ConnectionLimits
from tests.fixtures.ports import free_port
from tests.fixtures.raw_http import exchange
from tests.fixtures.service import Service, start_service, stop_service
from tests.fixtures.slow_clients import (
    OtherClient,
    beside,
    open_files_limit,
    slow_clients,
)

SERVER_OPEN_FILES = 4_096
SLOW_CONNECTIONS = 8_000
CLOSED_WITHIN_S = 75.0


def _address(service: Service) -> tuple[str, int]:
    parts = urlsplit(service.url)
    assert parts.hostname is not None and parts.port is not None
    return parts.hostname, parts.port


@pytest.mark.postgres
@pytest.mark.slow
def test_thousands_of_slow_connections_are_closed_while_another_client_is_served(
    make_postgres_url: Callable[[], str], tmp_path: Path
) -> None:
    env = {
        "SKYTRAIN_PROVIDER": "none",
        "SKYTRAIN_DATABASE_URL": make_postgres_url(),
        "SKYTRAIN_AUTO_MIGRATE": "true",
    }
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    assert hard >= SLOW_CONNECTIONS + 1_000, "the test needs a hard limit of 9,000 open files"
    with open_files_limit(SERVER_OPEN_FILES):  # the server inherits it
        service = start_service(env, tmp_path / "home")
    try:
        other = OtherClient(service.url, service.key("other"))
        host, port = _address(service)
        with open_files_limit(SLOW_CONNECTIONS + 1_000), beside(other):
            outcome = slow_clients(
                host,
                port,
                count=SLOW_CONNECTIONS,
                source="127.0.0.2",
                give_up_s=CLOSED_WITHIN_S + 15,
            )
    finally:
        stop_service(service)

    assert outcome.still_open == 0 and outcome.never_connected == 0, outcome.statuses
    assert len(outcome.closed_after_s) == SLOW_CONNECTIONS
    assert max(outcome.closed_after_s) <= CLOSED_WITHIN_S, sorted(outcome.closed_after_s)[-5:]
    # Those under the address's cap were held until the header timeout, and told so.
    assert outcome.statuses[408] > 0, outcome.statuses
    assert not other.failures, other.failures
    assert set(other.statuses) == {200}, other.statuses
    assert sum(other.statuses.values()) >= 10, other.statuses


def test_the_connection_caps_follow_the_open_file_limit() -> None:
    with open_files_limit(1_024):
        default = ConnectionLimits.from_settings(Settings())
        over = ConnectionLimits.from_settings(Settings(server={"max_connections": 100_000}))
        set_ = ConnectionLimits.from_settings(
            Settings(server={"max_connections": 100, "max_connections_per_client": 500})
        )
    assert (default.max_connections, default.max_per_client) == (768, 384)
    assert (over.max_connections, over.max_per_client) == (768, 384)  # held to the files
    assert (set_.max_connections, set_.max_per_client) == (100, 100)


SMALL = {
    "SKYTRAIN_PROVIDER": "none",
    "SKYTRAIN_HEADER_TIMEOUT_S": "2",
    "SKYTRAIN_REQUEST_BODY_TIMEOUT_S": "2",
    "SKYTRAIN_MAX_CONNECTIONS": "6",
    "SKYTRAIN_MAX_CONNECTIONS_PER_CLIENT": "4",
    "SKYTRAIN_MAX_REQUESTS_PER_CONNECTION": "3",
    "SKYTRAIN_KEEP_ALIVE_S": "5",
}
# Far past the limits above (2 s, 5 s): a limit that a trickle extended would still be open then.
TRICKLE_FOR_S = 12.0
HEALTH = b"GET /health HTTP/1.1\r\nHost: skytrain\r\n\r\n"


@pytest.fixture(scope="module")
def small(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    metrics = {"SKYTRAIN_METRICS_PORT": str(free_port())}
    service = start_service({**SMALL, **metrics}, tmp_path_factory.mktemp("small") / "home")
    yield service
    stop_service(service)


def _connect(service: Service, source: str) -> socket.socket:
    return socket.create_connection(_address(service), timeout=30, source_address=(source, 0))


def _trickle_until_closed(connection: socket.socket, start: bytes) -> bytes:
    """Send ``start``, then a byte every 0.25 s; what the server answered before it closed
    the connection (``b""`` if it was still open after TRICKLE_FOR_S)."""
    connection.sendall(start)
    connection.settimeout(0.25)
    answer = b""
    deadline = time.monotonic() + TRICKLE_FOR_S
    while time.monotonic() < deadline:
        try:
            chunk = connection.recv(65536)
        except TimeoutError:
            try:
                connection.sendall(b"x")
            except OSError:
                return answer or b"closed"
            continue
        except OSError:
            return answer or b"closed"
        if not chunk:
            return answer or b"closed"
        answer += chunk
    return b""


def _refused(service: Service) -> dict[str, float]:
    """``skytrain_connections_refused_total`` by reason, from the service's metrics listener."""
    port = service.env["SKYTRAIN_METRICS_PORT"]
    text = httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=30).text
    return {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name == "skytrain_connections_refused_total"
    }


@pytest.mark.slow
def test_headers_sent_a_byte_at_a_time_are_cut_off_at_the_header_timeout(small: Service) -> None:
    before = _refused(small).get("header_timeout", 0)
    with _connect(small, "127.0.0.3") as connection:
        answer = _trickle_until_closed(connection, b"GET /health HTTP/1.1\r\nX-Slow: ")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert b"SKYTRAIN_HEADER_TIMEOUT_S" in answer and b"connection: close" in answer, answer

    # The next request on a kept-alive connection: timed from its first byte, the same way.
    with _connect(small, "127.0.0.3") as connection:
        head, _ = exchange(connection, HEALTH)
        assert head.startswith(b"HTTP/1.1 200 "), head
        answer = _trickle_until_closed(connection, b"GET /health HTTP/1.1\r\nX-Slow: ")
    assert answer.startswith(b"HTTP/1.1 408 "), answer
    assert _refused(small)["header_timeout"] == before + 2  # the operator sees each one


@pytest.mark.slow
def test_the_rest_of_a_body_nobody_reads_gets_the_body_timeout(small: Service) -> None:
    before = _refused(small).get("body_timeout", 0)
    with _connect(small, "127.0.0.4") as connection:
        answer = _trickle_until_closed(
            connection, b"GET /health HTTP/1.1\r\nHost: skytrain\r\nContent-Length: 1000\r\n\r\n"
        )
    # Answered at once, then closed while the body still trickled in.
    assert answer.startswith(b"HTTP/1.1 200 "), answer
    assert _refused(small)["body_timeout"] == before + 1


@pytest.mark.slow
def test_connections_past_the_address_cap_and_the_total_cap_are_refused_at_once(
    small: Service,
) -> None:
    before = _refused(small)
    held: list[socket.socket] = []
    try:
        for _ in range(4):  # the address's cap, each kept alive after an answer
            held.append(_connect(small, "127.0.0.5"))
            assert exchange(held[-1], HEALTH)[0].startswith(b"HTTP/1.1 200 ")
        with _connect(small, "127.0.0.5") as fifth:
            head, body = _answer_then_close(fifth)
        assert head.startswith(b"HTTP/1.1 429 "), head
        assert b"SKYTRAIN_MAX_CONNECTIONS_PER_CLIENT" in body, body

        for _ in range(2):  # another address fills the total
            held.append(_connect(small, "127.0.0.6"))
            assert exchange(held[-1], HEALTH)[0].startswith(b"HTTP/1.1 200 ")
        with _connect(small, "127.0.0.7") as seventh:
            head, body = _answer_then_close(seventh)
        assert head.startswith(b"HTTP/1.1 503 "), head
        assert b"SKYTRAIN_MAX_CONNECTIONS" in body, body
        after = _refused(small)
        for reason in ("per_client_cap", "total_cap"):
            assert after[reason] == before.get(reason, 0) + 1, (reason, before, after)

        held.pop().close()  # room again, as soon as the server sees the close
        for _ in range(50):
            with _connect(small, "127.0.0.7") as again:
                head, _ = _answer_then_close(again, request=HEALTH)
            if head.startswith(b"HTTP/1.1 200 "):
                break
            time.sleep(0.1)
        assert head.startswith(b"HTTP/1.1 200 "), head
    finally:
        for connection in held:
            connection.close()


def _answer_then_close(connection: socket.socket, request: bytes = b"") -> tuple[bytes, bytes]:
    """The server's answer on ``connection`` (sending ``request`` first), read to its close."""
    answer = b""
    try:
        if request:
            connection.sendall(request)
        while chunk := connection.recv(65536):
            answer += chunk
            if request and b"\r\n\r\n" in answer:
                break
    except (BrokenPipeError, ConnectionResetError):  # refused before it read the request
        pass
    head, _, body = answer.partition(b"\r\n\r\n")
    return head, body


@pytest.mark.slow
def test_a_connection_carries_at_most_max_requests_per_connection(small: Service) -> None:
    with _connect(small, "127.0.0.8") as connection:
        heads = [exchange(connection, HEALTH)[0] for _ in range(3)]
        assert all(head.startswith(b"HTTP/1.1 200 ") for head in heads), heads
        assert b"connection: close" not in heads[1].lower()
        assert b"connection: close" in heads[2].lower(), heads[2]
        assert connection.recv(1) == b""


@pytest.mark.slow
def test_websocket_upgrades_do_not_escape_the_count(small: Service) -> None:
    upgrade = (
        b"GET /health HTTP/1.1\r\nHost: skytrain\r\nUpgrade: websocket\r\nConnection: Upgrade"
        b"\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nSec-WebSocket-Version: 13\r\n\r\n"
    )
    for _ in range(6):  # more than the address's cap of 4, one after another
        with _connect(small, "127.0.0.9") as connection:
            head, _ = _answer_then_close(connection, request=upgrade)
        assert not head.startswith(b"HTTP/1.1 101 "), head
    # The address's 4 connections are free again as soon as the server has seen those close;
    # an upgrade that escaped the count would keep its slot for good.
    held: list[socket.socket] = []
    try:
        for _ in range(4):
            for _ in range(50):
                held.append(_connect(small, "127.0.0.9"))
                head, _ = _answer_then_close(held[-1], request=HEALTH)
                if head.startswith(b"HTTP/1.1 200 "):
                    break
                held.pop().close()
                time.sleep(0.1)
            assert head.startswith(b"HTTP/1.1 200 "), head
    finally:
        for connection in held:
            connection.close()


@pytest.mark.slow
def test_bytes_between_requests_do_not_hold_a_connection_open(small: Service) -> None:
    # Blank lines after an answer start no request, but each one cancelled the idle timeout.
    with _connect(small, "127.0.0.10") as connection:
        assert exchange(connection, HEALTH)[0].startswith(b"HTTP/1.1 200 ")
        connection.settimeout(0.25)
        answer = b""
        deadline = time.monotonic() + TRICKLE_FOR_S
        while time.monotonic() < deadline and not answer:
            try:
                answer = connection.recv(65536) or b"closed"
            except TimeoutError:
                connection.sendall(b"\r\n")
            except OSError:
                answer = b"closed"
    assert answer, "still open"

    # The unread rest of a body, sent after the answer, leaves the connection idle: it closes
    # at the keep-alive timeout, as any idle connection does.
    with _connect(small, "127.0.0.10") as connection:
        head, _ = exchange(
            connection, b"GET /health HTTP/1.1\r\nHost: skytrain\r\nContent-Length: 4\r\n\r\nx"
        )
        assert head.startswith(b"HTTP/1.1 200 "), head
        connection.settimeout(TRICKLE_FOR_S)
        connection.sendall(b"xyz")
        try:
            closed = connection.recv(1) == b""
        except TimeoutError:
            closed = False
    assert closed, "still open"

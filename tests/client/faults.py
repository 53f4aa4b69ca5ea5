"""A fault-injecting HTTP proxy in front of a real server, like toxiproxy: not a fake of it.

``FaultProxy(upstream)`` listens on a loopback port of its own and forwards every request to
``upstream`` (the real control plane, or the real object store behind a presigned URL),
passing the real answer back. A test arms faults for the requests it names, the kinds of
trouble a network, a load balancer or a dying connection causes:

- ``Drop()``: read the request, close the connection without answering.
- ``Answer(status, body, headers)``: answer in the upstream's place, as a load balancer does
  (a 502 page, a 503 with ``Retry-After``, a 429); nothing is forwarded.
- ``Stall()``: read the request and never answer (until the client hangs up).
- ``LoseAnswer()``: forward the request, so the upstream acts on it, then hang up without
  passing its answer on.
- ``Truncate(keep_bytes)``: forward, then pass the real answer on without its
  ``Content-Length``, cut after ``keep_bytes`` bytes of body, and close (the body ends early
  and nothing at the HTTP level says so).
- ``RewriteJson(change)``: forward, then pass on ``change(real JSON body)``.
- ``Before(action)``: run ``action()`` (another client's request), then forward.

Every request is recorded (``seen``), with what was done to it. ``location_map`` rewrites the
start of ``Location`` headers, so a redirect to the object store can be sent through a second
proxy in front of it. The proxy runs its own event loop in a thread, so synchronous and
asynchronous tests use it alike.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import re
import socket
import threading
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Self
from urllib.parse import parse_qsl, urlsplit

import h11
import httpx

# Not passed through: they describe one connection, not the message.
_HOP_BY_HOP = frozenset(
    {
        "connection",
        "keep-alive",
        "proxy-connection",
        "transfer-encoding",
        "te",
        "trailer",
        "upgrade",
        "host",
        "content-length",
        "accept-encoding",
        "content-encoding",
    }
)


@dataclass(frozen=True)
class Drop:
    """Read the request, then close the connection without a word."""


@dataclass(frozen=True)
class Answer:
    """Answer in the upstream's place (a load balancer's error page); nothing is forwarded."""

    status: int
    body: str = ""
    headers: dict[str, str] = field(default_factory=dict)
    content_type: str = "text/plain; charset=utf-8"


@dataclass(frozen=True)
class Stall:
    """Read the request and never answer, until the client hangs up."""


@dataclass(frozen=True)
class LoseAnswer:
    """Forward the request (the upstream acts on it), then hang up instead of answering."""


@dataclass(frozen=True)
class Truncate:
    """Forward; pass the answer on without Content-Length, cut after ``keep_bytes``."""

    keep_bytes: int


@dataclass(frozen=True)
class RewriteJson:
    """Forward; pass on ``change(body)`` instead of the real JSON body."""

    change: Callable[[Any], Any]


@dataclass(frozen=True)
class Before:
    """Run ``action()`` in a thread (e.g. another client's request), then forward."""

    action: Callable[[], object]


Fault = Drop | Answer | Stall | LoseAnswer | Truncate | RewriteJson | Before


@dataclass(frozen=True)
class Seen:
    """One request the proxy received, and the fault it met (None: forwarded as is)."""

    method: str
    path: str
    query: dict[str, str]
    headers: httpx.Headers
    body: bytes
    fault: Fault | None

    def json(self) -> Any:
        return json.loads(self.body)


@dataclass
class _Rule:
    method: str
    path: re.Pattern[str]
    fault: Fault
    times: int | None


class FaultProxy:
    """A loopback HTTP proxy to ``upstream`` that injects the faults a test arms.

    ``sock``: a bound socket to listen on (one the test kept closed so far), else a new one.
    """

    def __init__(
        self,
        upstream: str,
        *,
        sock: socket.socket | None = None,
        location_map: dict[str, str] | None = None,
    ) -> None:
        self.upstream = upstream.rstrip("/")
        self.location_map = dict(location_map or {})
        if sock is None:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.bind(("127.0.0.1", 0))
        self._sock = sock
        host, port = sock.getsockname()[:2]
        self.url = f"http://{host}:{port}"
        self._rules: list[_Rule] = []
        self._seen: list[Seen] = []
        self._lock = threading.Lock()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stopping: asyncio.Event | None = None
        self._connections: set[asyncio.Task[None]] = set()

    # --- arming faults and reading what happened ------------------------------------------

    def fault(
        self, method: str, path: str, fault: Fault, *, times: int | None = None
    ) -> FaultProxy:
        """Apply ``fault`` to the next ``times`` requests (all, if None) whose method is
        ``method`` and whose path matches the regular expression ``path`` (searched)."""
        with self._lock:
            self._rules.append(_Rule(method, re.compile(path), fault, times))
        return self

    def seen(self, method: str | None = None, path: str | None = None) -> list[Seen]:
        """The requests received so far, optionally those with ``method`` and whose path
        matches the regular expression ``path``."""
        with self._lock:
            return [
                s
                for s in self._seen
                if (method is None or s.method == method)
                and (path is None or re.search(path, s.path))
            ]

    def _take_fault(self, method: str, path: str) -> Fault | None:
        with self._lock:
            for rule in self._rules:
                if rule.method == method and rule.path.search(path) and rule.times != 0:
                    if rule.times is not None:
                        rule.times -= 1
                    return rule.fault
        return None

    def _record(self, seen: Seen) -> None:
        with self._lock:
            self._seen.append(seen)

    # --- running ----------------------------------------------------------------------------

    def start(self) -> Self:
        ready = threading.Event()
        failure: list[BaseException] = []

        def run() -> None:
            loop = asyncio.new_event_loop()
            self._loop = loop
            try:
                loop.run_until_complete(self._main(ready))
            except BaseException as exc:  # reported to start() if it happens before ready
                failure.append(exc)
                ready.set()
            finally:
                loop.close()

        self._thread = threading.Thread(target=run, name=f"fault-proxy {self.url}", daemon=True)
        self._thread.start()
        ready.wait(30)
        if failure:
            raise RuntimeError(f"the fault proxy did not start: {failure[0]!r}")
        return self

    def stop(self) -> None:
        if self._loop is not None and self._stopping is not None and self._thread is not None:
            with contextlib.suppress(RuntimeError):  # the loop ended already
                self._loop.call_soon_threadsafe(self._stopping.set)
            self._thread.join(30)
        self._sock.close()

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, *exc_info: object) -> None:
        self.stop()

    async def _main(self, ready: threading.Event) -> None:
        self._stopping = asyncio.Event()
        self._sock.listen(64)
        async with httpx.AsyncClient(
            base_url=self.upstream, follow_redirects=False, timeout=60.0
        ) as upstream:
            self._upstream = upstream
            server = await asyncio.start_server(self._connection, sock=self._sock)
            ready.set()
            await self._stopping.wait()
            server.close()
            for task in list(self._connections):
                task.cancel()
            await asyncio.gather(*self._connections, return_exceptions=True)

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self._connections.add(task)
        conn = h11.Connection(h11.SERVER)
        try:
            while True:
                received = await _read_request(conn, reader)
                if received is None:
                    return
                request, body = received
                keep_open = await self._handle(conn, reader, writer, request, body)
                if not keep_open or conn.our_state is not h11.DONE:
                    return
                conn.start_next_cycle()
        except (ConnectionError, h11.ProtocolError, asyncio.IncompleteReadError):
            return
        except asyncio.CancelledError:  # the proxy stops: end quietly, the client sees EOF
            return
        finally:
            self._connections.discard(task)
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()

    async def _handle(
        self,
        conn: h11.Connection,
        reader: asyncio.StreamReader,
        writer: asyncio.StreamWriter,
        request: h11.Request,
        body: bytes,
    ) -> bool:
        """Answer one request (or not, as the fault says); whether the connection stays open."""
        method = request.method.decode()
        target = request.target.decode()
        split = urlsplit(target)
        fault = self._take_fault(method, split.path)
        headers = httpx.Headers([(k.decode(), v.decode()) for k, v in request.headers])
        self._record(Seen(method, split.path, dict(parse_qsl(split.query)), headers, body, fault))
        if isinstance(fault, Drop):
            return False
        if isinstance(fault, Stall):
            while await reader.read(65536):
                pass
            return False
        if isinstance(fault, Answer):
            answer_headers = {"Content-Type": fault.content_type, **fault.headers}
            await _respond(conn, writer, fault.status, answer_headers, fault.body.encode())
            return True
        if isinstance(fault, Before):
            await asyncio.to_thread(fault.action)
        response = await self._forward(method, target, headers, body)
        if isinstance(fault, LoseAnswer):
            return False
        out_headers = [
            (k, self._relocated(v) if k.lower() == "location" else v)
            for k, v in response.headers.multi_items()
            if k.lower() not in _HOP_BY_HOP
        ]
        content = response.content
        if isinstance(fault, Truncate):
            head = f"HTTP/1.1 {response.status_code} {response.reason_phrase}\r\n"
            head += "".join(f"{k}: {v}\r\n" for k, v in out_headers)
            head += "Connection: close\r\n\r\n"
            writer.write(head.encode("latin-1") + content[: fault.keep_bytes])
            await writer.drain()
            return False
        if isinstance(fault, RewriteJson):
            content = json.dumps(fault.change(json.loads(content))).encode()
        await _respond(conn, writer, response.status_code, out_headers, content)
        return True

    async def _forward(
        self, method: str, target: str, headers: httpx.Headers, body: bytes
    ) -> httpx.Response:
        forwarded = [(k, v) for k, v in headers.multi_items() if k.lower() not in _HOP_BY_HOP]
        return await self._upstream.request(method, target, headers=forwarded, content=body)

    def _relocated(self, location: str) -> str:
        for origin, replacement in self.location_map.items():
            if location.startswith(origin):
                return replacement + location[len(origin) :]
        return location


async def _read_request(
    conn: h11.Connection, reader: asyncio.StreamReader
) -> tuple[h11.Request, bytes] | None:
    """The next request on the connection with its whole body; None once the client left."""
    request: h11.Request | None = None
    body = bytearray()
    while True:
        event = conn.next_event()
        if event is h11.NEED_DATA:
            conn.receive_data(await reader.read(65536))
        elif isinstance(event, h11.Request):
            request = event
        elif isinstance(event, h11.Data):
            body += event.data
        elif isinstance(event, h11.EndOfMessage):
            assert request is not None
            return request, bytes(body)
        elif isinstance(event, h11.ConnectionClosed):
            return None


async def _respond(
    conn: h11.Connection,
    writer: asyncio.StreamWriter,
    status: int,
    headers: list[tuple[str, str]] | dict[str, str],
    content: bytes,
) -> None:
    items = list(headers.items()) if isinstance(headers, dict) else list(headers)
    items.append(("Content-Length", str(len(content))))
    writer.write(conn.send(h11.Response(status_code=status, headers=items)) or b"")
    writer.write(conn.send(h11.Data(data=content)) or b"")
    writer.write(conn.send(h11.EndOfMessage()) or b"")
    await writer.drain()


async def eventually(
    condition: Callable[[], bool | Awaitable[bool]], what: str, *, within_s: float = 30.0
) -> None:
    """Wait until ``condition()`` holds (checked every few ms); fail naming ``what`` if it does
    not within ``within_s`` (a bound against hanging, not a measurement)."""
    deadline = time.monotonic() + within_s
    while True:
        held = condition()
        if not isinstance(held, bool):
            held = await held
        if held:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"still waiting, after {within_s:g} s, for {what}")
        await asyncio.sleep(0.005)

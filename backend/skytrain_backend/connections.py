"""Limits every connection to ``skytrain serve`` meets before a request is parsed, let alone a
key read: the server's own door, which holds even without a reverse proxy in front. A worker's
front door takes the same (``ConnectionLimits.for_front_door``): this module sits beside the
layers, so that both the control plane and the worker may import it.

- **Count.** At most ``SKYTRAIN_MAX_CONNECTIONS`` open at once (by default, and never more
  than, three quarters of the process's open-file limit) and ``SKYTRAIN_MAX_CONNECTIONS_PER_
  CLIENT`` from one address (by default half of those). A connection over either cap is
  answered 503 and closed as it is accepted: descriptors never run out, and one address never
  takes every slot.
- **Headers in time.** A request's line and headers must all arrive within
  ``SKYTRAIN_HEADER_TIMEOUT_S`` of the connection's accept (its first request) or of the
  first byte after the previous answer (the next ones on a kept-alive connection: blank
  lines count), however slowly they trickle; then 408 and the connection closes.
- **Bodies.** A body the app reads is timed where it reads it (``api/admission/limits.py``,
  ``SKYTRAIN_REQUEST_BODY_TIMEOUT_S``); the rest of a body the app answered without reading
  gets that long to arrive after the answer, then the connection closes (or, once it is in,
  idles as any other).
- **Keep-alive.** An idle connection closes after ``SKYTRAIN_KEEP_ALIVE_S``; one connection
  carries at most ``SKYTRAIN_MAX_REQUESTS_PER_CONNECTION`` requests, the last answered with
  ``Connection: close``.

Each connection closed by one of these is counted in ``skytrain_connections_refused_total`` by
reason (``total_cap``, ``per_client_cap``, ``header_timeout``, ``body_timeout``).

``guarded_protocol(limits)`` is uvicorn's HTTP protocol (httptools) with these limits, for
``uvicorn.Config(http=...)``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import resource
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, ClassVar

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
from uvicorn.protocols.utils import get_remote_addr

from skytrain_backend.config import Settings
from skytrain_backend.observability.metrics import CONNECTIONS_REFUSED

# Client connections may hold three quarters of the open-file limit; the last quarter stays
# for the rest of the process (database pool, object store, worker logs, the listener).
_CONNECTION_SHARE_OF_FILES = 0.75
_CLOSE = (b"connection", b"close")


def _files_share() -> int:
    """The connections the process's open-file limit leaves room for."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft == resource.RLIM_INFINITY:  # not on Linux; elsewhere, assume the usual 1,024
        soft = 1024
    return max(int(soft * _CONNECTION_SHARE_OF_FILES), 1)


@dataclass(frozen=True)
class ConnectionLimits:
    """The limits in force, with the derived caps resolved."""

    max_connections: int
    max_per_client: int
    header_timeout_s: float
    body_timeout_s: float
    max_requests: int

    @classmethod
    def from_settings(cls, settings: Settings) -> ConnectionLimits:
        bound = _files_share()
        total = min(settings.server.max_connections or bound, bound)
        per_client = min(settings.server.max_connections_per_client or max(total // 2, 1), total)
        return cls(
            max_connections=total,
            max_per_client=per_client,
            header_timeout_s=settings.server.header_timeout_s,
            body_timeout_s=settings.server.request_body_timeout_s,
            max_requests=settings.server.max_requests_per_connection,
        )

    @classmethod
    def for_front_door(cls, settings: Settings) -> ConnectionLimits:
        """A worker's front door (``worker/main.py``): the same timeouts, at most half the
        control plane's share of open files (each request it serves also holds a connection
        to the engine), and no cap per address below the total: its one client, the control
        plane's gateway, may hold them all (the secret turns everyone else away)."""
        limits = cls.from_settings(settings)
        total = max(_files_share() // 2, 1)
        if settings.server.max_connections:
            total = min(settings.server.max_connections, total)
        return dataclasses.replace(limits, max_connections=total, max_per_client=total)


class ConnectionCounts:
    """Open connections in total and per client address (one event loop: no lock)."""

    def __init__(self, limits: ConnectionLimits) -> None:
        self.limits = limits
        self.open = 0
        self.by_address: Counter[str] = Counter()

    def admit(self, address: str) -> tuple[int, str] | None:
        """Count a new connection from ``address``, or say why it is refused (status, why)."""
        if self.open >= self.limits.max_connections:
            return 503, (
                f"the server holds {self.open} connections, its most (SKYTRAIN_MAX_CONNECTIONS):"
                " retry in a few seconds"
            )
        if self.by_address[address] >= self.limits.max_per_client:
            return 429, (
                f"{self.by_address[address]} connections from your address are open, the most "
                "one address may hold (SKYTRAIN_MAX_CONNECTIONS_PER_CLIENT): reuse connections "
                "or close some"
            )
        self.open += 1
        self.by_address[address] += 1
        return None

    def release(self, address: str) -> None:
        self.open -= 1
        self.by_address[address] -= 1
        if not self.by_address[address]:
            del self.by_address[address]


def raw_error(status: int, kind: str, message: str) -> bytes:
    """A whole HTTP/1.1 answer with the API's error body that closes the connection."""
    body = json.dumps({"error": {"type": kind, "message": message}}).encode()
    reason = {408: "Request Timeout", 429: "Too Many Requests", 503: "Service Unavailable"}
    return (
        f"HTTP/1.1 {status} {reason[status]}\r\ncontent-type: application/json\r\n"
        f"content-length: {len(body)}\r\nconnection: close\r\n\r\n"
    ).encode() + body


class GuardedHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, counted and timed as the module says."""

    counts: ClassVar[ConnectionCounts]

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._address: str | None = None  # set while counted: refused connections stay None
        self._deadline: asyncio.TimerHandle | None = None
        self._requests = 0

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        remote = get_remote_addr(transport)
        address = remote[0] if remote else ""
        refusal = self.counts.admit(address)
        if refusal is not None:
            status, message = refusal
            kind = "rate_limit_error" if status == 429 else "service_unavailable"
            CONNECTIONS_REFUSED.labels(
                reason="per_client_cap" if status == 429 else "total_cap"
            ).inc()
            transport.write(raw_error(status, kind, message))
            transport.close()
            return
        self._address = address
        super().connection_made(transport)
        self._arm(self.counts.limits.header_timeout_s, self._headers_late)

    def connection_lost(self, exc: Exception | None) -> None:
        if self._address is None:  # refused: uvicorn never saw it
            return
        self._disarm()
        self.counts.release(self._address)
        super().connection_lost(exc)

    def data_received(self, data: bytes) -> None:
        if self._address is None:
            return
        if self.cycle is None or self.cycle.response_complete:
            # Between requests (uvicorn has just cancelled its idle timeout): whatever these
            # bytes are, the next request's headers are timed from them.
            self._arm(self.counts.limits.header_timeout_s, self._headers_late)
        super().data_received(data)

    def _should_upgrade_to_ws(self) -> bool:
        # The API has no websockets, and an upgrade would hand the connection to another
        # protocol, out of the count for good: the request is served as plain HTTP.
        return False

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._unset_keepalive_if_required()  # re-armed below when a body ends past its answer
        self._arm(self.counts.limits.header_timeout_s, self._headers_late)

    def on_headers_complete(self) -> None:
        self._disarm()
        self._requests += 1
        if self._requests >= self.counts.limits.max_requests:
            self.headers.append(_CLOSE)  # uvicorn answers it with Connection: close, then closes
        super().on_headers_complete()

    def on_message_complete(self) -> None:
        if self.cycle is not None and self.cycle.response_complete:
            # The unread rest of a body arrived in time: the connection is idle again.
            self._disarm()
            if self.timeout_keep_alive_task is None:
                self.timeout_keep_alive_task = self.loop.call_later(
                    self.timeout_keep_alive, self.timeout_keep_alive_handler
                )
        super().on_message_complete()

    def on_response_complete(self) -> None:
        super().on_response_complete()
        answered = self.cycle.response_complete and self.cycle.more_body
        if answered and not self.transport.is_closing():
            # Answered before its body was read: the rest gets the body timeout, no more.
            self._arm(self.counts.limits.body_timeout_s, self._body_late)

    def _arm(self, delay_s: float, callback: Callable[[], object]) -> None:
        if self._deadline is None:
            self._deadline = self.loop.call_later(delay_s, self._expire, callback)

    def _disarm(self) -> None:
        if self._deadline is not None:
            self._deadline.cancel()
            self._deadline = None

    def _expire(self, callback: Callable[[], object]) -> None:
        self._deadline = None
        if not self.transport.is_closing():
            callback()

    def _body_late(self) -> None:
        CONNECTIONS_REFUSED.labels(reason="body_timeout").inc()
        self.transport.close()

    def _headers_late(self) -> None:
        CONNECTIONS_REFUSED.labels(reason="header_timeout").inc()
        if self.cycle is None or self.cycle.response_complete:  # not in the middle of an answer
            timeout_s = self.counts.limits.header_timeout_s
            self.transport.write(
                raw_error(
                    408,
                    "request_timeout",
                    f"the request's headers did not arrive within {timeout_s:g} s "
                    "(SKYTRAIN_HEADER_TIMEOUT_S): send them at once",
                )
            )
        self.transport.close()


def guarded_protocol(limits: ConnectionLimits) -> type[GuardedHttpProtocol]:
    """A protocol class of its own for one server, counting that server's connections."""

    class Guarded(GuardedHttpProtocol):
        counts = ConnectionCounts(limits)

    return Guarded

"""The gateway's client for worker engines: pooled connections, TLS pinned per worker.

Workers are reached at their front door over TLS pinned to the certificate each registered
(pooled clients per worker, closed when the worker goes): a worker that presents any other
certificate gets nothing, not even the engine secret. A worker row without a certificate is
reached only on this host over loopback HTTP (a bare engine standing in for a worker in the
gateway's tests); anything else without one is refused. Connections are kept and reused: one
aiohttp session per engine, where a request takes an idle connection when there is one, so
sequential requests share one and C requests at once hold about C. An engine's redirect is
never followed (502), no cookies are kept (an engine's would reach other tenants' requests),
and no proxy is taken from the environment. aiohttp, not httpx, for this hop: on this
project's 2-core test machine httpx took 0.5 ms of CPU per request and aiohttp 0.08 ms in a
bare client test, and the gateway's own CPU per request went from 2.5 to 1.6-1.7 ms.

Failures that are not the caller's doing are said in skytrain's words, and never with a
worker's address (that goes to the operator's log): an unreachable engine is a 503 to retry,
one that presents the wrong certificate or does not answer in time a 502.
"""

from __future__ import annotations

import asyncio
import functools
import ipaddress
import logging
import ssl
from collections.abc import AsyncIterator, Callable
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import msgspec

from skytrain_backend import tls
from skytrain_backend.errors import EngineError, Unavailable
from skytrain_backend.observability import gateway as observe
from skytrain_backend.protocol import TENANT_HEADER
from skytrain_backend.scheduler.routing import EngineRoute

logger = logging.getLogger(__name__)

# Generation on a CPU engine can take minutes before a non-streamed answer's first byte (and
# between two events of a stream): 900 s of silence at most; 10 s to connect (TLS included),
# 30 s with the name's lookup.
ENGINE_TIMEOUT = aiohttp.ClientTimeout(total=None, connect=30.0, sock_connect=10.0, sock_read=900.0)
# Idle connections are dropped well before engines close them (uvicorn, under vLLM and the CPU
# engine: after 5 s). Connections are bounded by the per-tenant limits, not by the pool.
KEEPALIVE_S = 2.0
# What reusing a keep-alive connection the engine has just closed looks like: the request is
# sent once more. An engine that took the request and dropped the connection while generating
# raises the same errors: a completion has no side effects, so the worst case is a generation
# done twice. (A connection that could not be opened is not one of them.)
STALE_CONNECTION_ERRORS = (aiohttp.ServerDisconnectedError, aiohttp.ClientOSError)

_JSON = msgspec.json.Encoder()


class EnginePool:
    """The pooled connections to one engine (plain HTTP on loopback, or TLS pinned to the
    worker's certificate), and the answers being read from it: an answer is open until its
    ``Upstream`` is closed, however it ends."""

    def __init__(self, ssl_context: ssl.SSLContext | None = None) -> None:
        self._session = aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(
                ssl=ssl_context if ssl_context is not None else True,
                limit=0,
                keepalive_timeout=KEEPALIVE_S,
            ),
            timeout=ENGINE_TIMEOUT,
            cookie_jar=aiohttp.DummyCookieJar(),
        )
        self._open: set[Upstream] = set()
        self._posting = 0  # requests sent whose answer has not begun

    @property
    def in_flight(self) -> int:
        return self._posting + len(self._open)

    async def post(self, url: str, *, body: bytes, headers: dict[str, str]) -> Upstream:
        """The answer to a POST of ``body``, its body not read yet. A redirect is not followed
        (it is the answer): a worker must not send the control plane, and the engine secret,
        elsewhere."""
        self._posting += 1
        try:
            response = await self._session.post(
                url, data=body, headers=headers, allow_redirects=False
            )
        finally:
            self._posting -= 1
        upstream = Upstream(response, on_close=self._open.discard)
        self._open.add(upstream)
        return upstream

    async def aclose(self) -> None:
        # Closing the session drops its connections without telling the answers being read
        # from them (aiohttp detaches their readers first): they would wait forever. They are
        # failed first, so a stream ends with its error event and a request with its 502.
        for upstream in list(self._open):
            upstream.fail(aiohttp.ClientConnectionError("the worker's connection was closed"))
        await self._session.close()


class Upstream:
    """An engine's answer: its status, headers and body, read whole or line by line, and
    closed once (which counts it out of its client's open answers). Closed before its body
    was read to the end, its connection is closed too, so the engine stops generating."""

    def __init__(
        self, response: aiohttp.ClientResponse, *, on_close: Callable[[Upstream], None]
    ) -> None:
        self._response = response
        self._on_close: Callable[[Upstream], None] | None = on_close
        self.status_code = response.status
        self.headers = response.headers
        self.content = b""

    async def read(self) -> bytes:
        self.content = await self._response.read()
        return self.content

    async def lines(self) -> AsyncIterator[str]:
        """The body's lines as they arrive, without their line ends (no length limit, as
        the events of a long prompt's answer can be long)."""
        pending: list[bytes] = []  # the line begun, in the pieces it came in
        async for chunk in self._response.content.iter_any():
            *ends, rest = chunk.split(b"\n")
            for end in ends:
                line = b"".join([*pending, end]) if pending else end
                pending = []
                yield line.removesuffix(b"\r").decode()
            if rest:
                pending.append(rest)
        if pending:
            yield b"".join(pending).removesuffix(b"\r").decode()

    def text(self) -> str:
        return self.content.decode(errors="replace")

    @property
    def reason(self) -> str:
        return self._response.reason or ""

    def close(self) -> None:
        # release() keeps a connection whose answer was read whole; close() drops it.
        if self._response.content.is_eof():
            self._response.release()
        else:
            self._response.close()
        on_close, self._on_close = self._on_close, None
        if on_close is not None:
            on_close(self)

    def fail(self, error: Exception) -> None:
        """Make the reading of the body raise ``error`` (its connection is being dropped)."""
        self._response.content.set_exception(error)


class Engines:
    """The clients of every engine the gateway talks to: one for loopback HTTP, one per
    worker pinned to the certificate it registered (a new certificate, a restarted worker,
    gets a new client); and the sending of one request."""

    def __init__(self) -> None:
        # Engines on this host over loopback HTTP (worker rows without a certificate).
        self.http = EnginePool()
        # worker id -> (the certificate it registered, a client that trusts only it)
        self._pinned: dict[str, tuple[str, EnginePool]] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        await self.http.aclose()
        pinned, self._pinned = list(self._pinned.values()), {}
        for _, client in pinned:
            await client.aclose()
        if self._closing:
            await asyncio.gather(*self._closing, return_exceptions=True)

    def forget_worker(self, worker_id: str) -> None:
        """Close the client of a worker that ended; safe to call from any thread."""
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._drop_client, worker_id)

    def _drop_client(self, worker_id: str) -> None:
        held = self._pinned.pop(worker_id, None)
        if held is not None:
            task = asyncio.get_running_loop().create_task(held[1].aclose())
            self._closing.add(task)
            task.add_done_callback(self._closing.discard)

    def client_of(self, route: EngineRoute) -> EnginePool:
        """The client for the route's worker: pinned to its certificate."""
        self._loop = asyncio.get_running_loop()
        certificate = route.engine_certificate
        if certificate is None:
            if not _is_loopback_http(route.engine_endpoint):
                logger.error(
                    "worker %s at %s registered no certificate: refusing to send it requests",
                    route.worker_id,
                    route.engine_endpoint,
                )
                raise EngineError(
                    f"worker {route.worker_id} registered no TLS certificate, so the control "
                    "plane will not send it requests: its operator must replace it with a "
                    "worker of this control plane's version"
                )
            return self.http
        held = self._pinned.get(route.worker_id)
        if held is not None and held[0] == certificate:
            return held[1]
        if held is not None:
            self._drop_client(route.worker_id)
        client = EnginePool(tls.pinned_context(certificate))
        self._pinned[route.worker_id] = (certificate, client)
        return client

    async def send(
        self, *, route: EngineRoute, path: str, body: dict[str, Any], tenant_id: str
    ) -> Upstream:
        """The engine's answer, its body not read yet."""
        client = self.client_of(route)
        url = route.engine_endpoint + path
        data = _JSON.encode(body)
        headers = {
            "Authorization": f"Bearer {route.engine_secret}",
            "Content-Type": "application/json",
            TENANT_HEADER: tenant_id,
            **observe.request_id_header(),
        }
        try:
            with observe.metrics.upstream_timer(path):
                try:
                    return await client.post(url, body=data, headers=headers)
                except STALE_CONNECTION_ERRORS as exc:
                    if isinstance(exc, aiohttp.ClientConnectorError):
                        raise  # never sent: Unavailable below, another replica may take it
                    # Most likely a kept-alive connection the engine had closed: once more.
                    try:
                        return await client.post(url, body=data, headers=headers)
                    except aiohttp.ClientError as again:
                        # The first try may have reached the engine (and stopped it): the
                        # request goes to no other replica, a prompt that stops engines
                        # stops one at the most.
                        logger.warning(
                            "the engine of worker %s at %s closed the connection, then: %s: %s",
                            route.worker_id,
                            route.engine_endpoint,
                            type(again).__name__,
                            again,
                        )
                        raise EngineError(
                            f"the engine of worker {route.worker_id} closed the connection "
                            "without answering; it may have restarted: retry shortly"
                        ) from again
        except TimeoutError as exc:
            raise EngineError(
                f"the engine of worker {route.worker_id} did not answer in time "
                f"({type(exc).__name__}): retry, with a smaller max_tokens if it keeps happening"
            ) from exc
        except aiohttp.ClientError as exc:
            if _certificate_refused(exc):
                logger.error(
                    "worker %s at %s presented a certificate other than the one it registered "
                    "(%s): nothing was sent to it",
                    route.worker_id,
                    route.engine_endpoint,
                    exc,
                )
                raise EngineError(
                    f"worker {route.worker_id} did not present the certificate it registered, so "
                    "the control plane sent it nothing: retry shortly (a restarting worker "
                    "registers its new certificate); the operator's log has the details"
                ) from exc
            logger.warning(
                "the engine of worker %s at %s cannot be reached: %s: %s",
                route.worker_id,
                route.engine_endpoint,
                type(exc).__name__,
                exc,
            )
            raise Unavailable(
                f"the engine of worker {route.worker_id} cannot be reached; the worker may be "
                "restarting: retry shortly",
                retry_after_s=5.0,
            ) from exc


@functools.lru_cache(maxsize=1024)
def _is_loopback_http(url: str) -> bool:
    """Asked per request of the same few worker endpoints: parsed once each."""
    parsed = urlsplit(url)
    if parsed.scheme != "http" or parsed.hostname is None:
        return False
    if parsed.hostname == "localhost":
        return True
    try:
        return ipaddress.ip_address(parsed.hostname).is_loopback
    except ValueError:
        return False


def _certificate_refused(exc: BaseException) -> bool:
    """Whether a connection failed because the peer's certificate is not the pinned one."""
    cause: BaseException | None = exc
    while cause is not None:
        if isinstance(
            cause, ssl.SSLCertVerificationError | aiohttp.ClientConnectorCertificateError
        ):
            return True
        cause = cause.__cause__ or cause.__context__
    return False

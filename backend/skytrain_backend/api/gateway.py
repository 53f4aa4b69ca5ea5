"""The inference gateway: OpenAI chat completions and completions for the caller's models.

A request names one of the tenant's models (``scheduler.routing`` finds the worker engine
serving that checkpoint, or says why none does yet: 404, or 503 with ``Retry-After``). The
body goes to that engine as the caller sent it, with these changes: ``model`` becomes the
engine's name for the checkpoint, and since every model here is trainable, the engine is
always asked for the sampled tokens' logprobs and their token ids, and for the prompt's token
ids (vLLM's ``return_token_ids``), so the trainer trains on exactly the tokens the engine saw
and never re-tokenizes. The answer's ``model`` is written back to the caller's name, the
chat answer's ``prompt_token_ids`` is copied onto each of its choices (the object a client
keeps in its trajectory), and ``X-Skytrain-Model-Id``, ``X-Skytrain-Step`` and
``X-Skytrain-Worker`` say what served it.

Resolving a request (the key, the model, its step, the worker) is done once per key and model
name per ``SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S`` (1 s), and at once again after any commit in
this process that changes one of those rows (``api/route_cache.py``): a step committed, a model
deleted, a worker gone. Through another control plane on the same database such a change is
seen within that TTL. The activity marks a resolution writes (``scheduler.routing``) are thus
written at most once per row per 30 s, by at most one request per TTL.

Streams are passed through event by event as the engine sends them. When the caller goes
away (mid-stream, or while a non-streamed request is still generating) the upstream request
is closed at once, which makes the engine stop generating for it.

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

Engine refusals of the request itself (4xx) pass through with the engine's status and
OpenAI-style body. Failures that are not the caller's doing are said in skytrain's words, and
never with a worker's address (that goes to the operator's log): an unreachable engine or one
that no longer serves the checkpoint is a 503 to retry, an engine that rejects the control
plane's credentials, presents the wrong certificate or fails is a 502.

Each tenant's requests in flight (streams count until they end; across every control plane
on a PostgreSQL database, ``api/tenant_load.py``) are counted three ways, each against the tenant's limit (``db.tenants``): requests, sequences (``n``
times the number of prompts) and tokens (the body's bytes, an upper bound of the prompt's
tokens, plus ``n`` x ``max_tokens``). The request that would pass one gets 429 with
``Retry-After``; one that could never fit (more sequences or tokens than the limit itself)
gets 400. Each request tells the engine whose it is (``TENANT_HEADER``), so an engine shared
by several tenants can take turns between them.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import ipaddress
import json
import logging
import ssl
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlsplit

import aiohttp
import anyio
import msgspec
from fastapi import Request, Response
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from pydantic import ValidationError
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from skytrain_backend import tls
from skytrain_backend.api.deps import get_tenant
from skytrain_backend.api.route_cache import RouteCache
from skytrain_backend.api.schemas import ChatCompletionCreate, CompletionCreate
from skytrain_backend.api.tenant_load import Load, TenantLoads
from skytrain_backend.asgi import CLIENT_CLOSED_REQUEST, until_disconnected
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import (
    EngineError,
    InvalidRequest,
    Unavailable,
)
from skytrain_backend.protocol import TENANT_HEADER, format_validation_error
from skytrain_backend.scheduler.routing import EngineRoute, resolve_route

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

# How often a request waiting for its checkpoint to load looks again.
LOADING_POLL_S = 0.25

# Bodies up to this size are parsed on the event loop when their route is cached (no thread
# hop); larger ones, in a thread.
INLINE_PARSE_BYTES = 64 * 1024

# Requests resolved in threads at once: fewer than the database pool's 5 kept connections, so
# a burst reuses them instead of opening (and configuring) a connection per request.
RESOLVE_CONCURRENCY = 4


@dataclass(frozen=True)
class Endpoint:
    path: str
    ask_for_logprobs: Callable[[dict[str, Any]], None]
    # The options checked before the request goes to a worker.
    schema: type[ChatCompletionCreate | CompletionCreate]


def _chat_logprobs(body: dict[str, Any]) -> None:
    body["logprobs"] = True
    body["return_tokens_as_token_ids"] = True
    body["return_token_ids"] = True


def _completion_logprobs(body: dict[str, Any]) -> None:
    # Completions take the number of top logprobs; 0 still returns the sampled token's.
    if body.get("logprobs") is None or isinstance(body["logprobs"], bool):
        body["logprobs"] = 0
    body["return_tokens_as_token_ids"] = True
    body["return_token_ids"] = True


CHAT = Endpoint("/v1/chat/completions", _chat_logprobs, ChatCompletionCreate)
COMPLETIONS = Endpoint("/v1/completions", _completion_logprobs, CompletionCreate)


@dataclass(frozen=True)
class _Routed:
    tenant_id: str
    limits: TenantLimits
    body: dict[str, Any]
    cost: Load
    route: EngineRoute


@dataclass(frozen=True)
class _Resolved:
    """What a key and a model name resolve to: the route cache's values."""

    tenant_id: str
    limits: TenantLimits
    route: EngineRoute


class _EngineClient:
    """The pooled connections to one engine (plain HTTP on loopback, or TLS pinned to the
    worker's certificate), and the answers being read from it: an answer is open until its
    ``_Upstream`` is closed, however it ends."""

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
        self._open: set[_Upstream] = set()
        self._posting = 0  # requests sent whose answer has not begun

    @property
    def in_flight(self) -> int:
        return self._posting + len(self._open)

    async def post(self, url: str, *, body: bytes, headers: dict[str, str]) -> _Upstream:
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
        upstream = _Upstream(response, on_close=self._open.discard)
        self._open.add(upstream)
        return upstream

    async def aclose(self) -> None:
        # Closing the session drops its connections without telling the answers being read
        # from them (aiohttp detaches their readers first): they would wait forever. They are
        # failed first, so a stream ends with its error event and a request with its 502.
        for upstream in list(self._open):
            upstream.fail(aiohttp.ClientConnectionError("the worker's connection was closed"))
        await self._session.close()


class _Upstream:
    """An engine's answer: its status, headers and body, read whole or line by line, and
    closed once (which counts it out of its client's open answers). Closed before its body
    was read to the end, its connection is closed too, so the engine stops generating."""

    def __init__(
        self, response: aiohttp.ClientResponse, *, on_close: Callable[[_Upstream], None]
    ) -> None:
        self._response = response
        self._on_close: Callable[[_Upstream], None] | None = on_close
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


class Gateway:
    """One per app, opened in its lifespan: pooled HTTP clients per worker (pinned to its
    certificate), requests in flight per tenant, and the forwarding of one request."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        on_unplaced: Callable[[], None],
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        # Called when a request names a model that no worker holds: wakes the scheduler.
        self._on_unplaced = on_unplaced
        # Engines on this host over loopback HTTP (worker rows without a certificate).
        self.http = _EngineClient()
        # worker id -> (the certificate it registered, a client that trusts only it)
        self._pinned: dict[str, tuple[str, _EngineClient]] = {}
        self.resolvers = anyio.CapacityLimiter(RESOLVE_CONCURRENCY)
        # (sha256 of the key, model as sent) -> _Resolved; see api/route_cache.py.
        self.routes: RouteCache[_Resolved] = RouteCache(ttl_s=settings.gateway_route_cache_ttl_s)
        self._resolving: dict[tuple[bytes, str], asyncio.Event] = {}
        self.loads = TenantLoads(
            sessions=sessions,
            shared=make_url(settings.resolved_database_url).get_backend_name() == "postgresql",
        )
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closing: set[asyncio.Task[None]] = set()

    async def aclose(self) -> None:
        await self.loads.aclose()
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

    def _client_of(self, route: EngineRoute) -> _EngineClient:
        """The client for the route's worker: pinned to its certificate (a new certificate, a
        restarted worker, gets a new client)."""
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
        client = _EngineClient(tls.pinned_context(certificate))
        self._pinned[route.worker_id] = (certificate, client)
        return client

    async def forward(
        self,
        request: Request,
        *,
        credentials: HTTPAuthorizationCredentials | None,
        endpoint: Endpoint,
    ) -> Response:
        """The engine's answer to the caller's request, or the reason there is none."""
        raw = await request.body()
        routed = await self._route(credentials=credentials, raw=raw, endpoint=endpoint)
        release = await self.loads.admit(routed.tenant_id, limits=routed.limits, cost=routed.cost)
        try:
            response = await self._proxy(request, routed=routed, endpoint=endpoint)
        except BaseException:
            release()
            raise
        if isinstance(response, _EventStream):
            response.on_close = release  # a stream counts itself out when it ends
        else:
            release()
        return response

    async def _route(
        self, *, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> _Routed:
        """Where the request goes; a checkpoint being loaded onto its worker is waited for.

        A route resolved a moment ago for the same key and model is reused (the route
        cache); otherwise it is resolved in a thread. Loading takes seconds (the worker
        fetches the adapter at its next heartbeat), less than most clients' retry budget:
        holding the request spares them a 503 round trip.
        """
        cached, flight = self._cached(credentials, raw, endpoint)
        if cached is not None:
            return cached
        # One resolution per key and model at a time: when a route's entry expires under
        # load, the requests that find it missing wait for the first one's answer.
        waiting = self._resolving.get(flight) if flight is not None else None
        if waiting is not None:
            await waiting.wait()
            cached, _ = self._cached(credentials, raw, endpoint)
            if cached is not None:
                return cached
        done = asyncio.Event()
        if flight is not None and flight not in self._resolving:
            self._resolving[flight] = done
        try:
            return await self._resolve_waiting_for_load(credentials, raw, endpoint)
        finally:
            if flight is not None and self._resolving.get(flight) is done:
                del self._resolving[flight]
            done.set()

    async def _resolve_waiting_for_load(
        self, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> _Routed:
        deadline = time.monotonic() + self.settings.gateway_loading_wait_s
        while True:
            try:
                return await anyio.to_thread.run_sync(
                    self._resolve, credentials, raw, endpoint, limiter=self.resolvers
                )
            except Unavailable as exc:
                if exc.state != "loading" or time.monotonic() >= deadline:
                    raise
            await anyio.sleep(LOADING_POLL_S)

    def _cached(
        self, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> tuple[_Routed | None, tuple[bytes, str] | None]:
        """The request routed from the cache, or None (not cached, or a body the full path
        should judge: an error must come after the key is checked); and the cache's key for
        it, when the body could be read here."""
        if credentials is None or len(raw) > INLINE_PARSE_BYTES:
            return None, None
        try:
            body = _parse_body(raw, endpoint)
        except InvalidRequest:
            return None, None
        key = (_key_digest(credentials), body["model"])
        resolved = self.routes.get(key)
        if resolved is None:
            return None, key
        cost = _cost(
            body, size=len(raw), counted_max_tokens=self.settings.gateway_counted_max_tokens
        )
        _check_fits(resolved.limits, cost)
        routed = _Routed(
            tenant_id=resolved.tenant_id,
            limits=resolved.limits,
            body=body,
            cost=cost,
            route=resolved.route,
        )
        return routed, key

    def _resolve(
        self, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> _Routed:
        """Authenticate, parse and route in one session, held only for these few queries (a
        connection held across the request would starve the pool under concurrent streams)."""
        generation = self.routes.generation
        with self._sessions() as session:
            tenant = get_tenant(session, credentials)
            tenant_id, limits = tenant.id, tenants.limits_of(tenant, self.settings)
            body = _parse_body(raw, endpoint)
            cost = _cost(
                body, size=len(raw), counted_max_tokens=self.settings.gateway_counted_max_tokens
            )
            _check_fits(limits, cost)
            route = resolve_route(
                session,
                tenant_id=tenant_id,
                model=body["model"],
                idle_timeout_s=self.settings.worker_idle_timeout_s,
                limits=limits,
                on_unplaced=self._on_unplaced,
            )
        assert credentials is not None  # get_tenant refuses a request without a key
        self.routes.put(
            (_key_digest(credentials), body["model"]),
            _Resolved(tenant_id=tenant_id, limits=limits, route=route),
            generation=generation,
        )
        return _Routed(tenant_id=tenant_id, limits=limits, body=body, cost=cost, route=route)

    async def _proxy(self, request: Request, *, routed: _Routed, endpoint: Endpoint) -> Response:
        body, route = routed.body, routed.route
        upstream_body = {**body, "model": route.engine_model}
        endpoint.ask_for_logprobs(upstream_body)
        headers = {
            "X-Skytrain-Model-Id": route.model_id,
            "X-Skytrain-Step": str(route.step),
            "X-Skytrain-Worker": route.worker_id,
        }
        stream = bool(body.get("stream"))

        async def exchange() -> tuple[_Upstream, Any]:
            # The engine's answer, read whole (parsed) unless it streams or refused: one
            # watch for the caller leaving covers the request and the answer.
            upstream = await self._send(
                route=route, path=endpoint.path, body=upstream_body, tenant_id=routed.tenant_id
            )
            if stream or upstream.status_code != 200:
                return upstream, None
            return upstream, await _read_json(upstream, route=route)

        exchanged = await until_disconnected(request.receive, exchange())
        if exchanged is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        upstream, content = exchanged
        if upstream.status_code != 200:
            return await _refusal(upstream, route=route)
        if stream:
            return _EventStream(upstream, model=body["model"], headers=headers)
        if isinstance(content, dict) and "model" in content:
            content["model"] = body["model"]
            _prompt_ids_onto_choices(content)
        # msgspec read it, so every number is finite: written back as JSONResponse would.
        return Response(_JSON.encode(content), headers=headers, media_type="application/json")

    async def complete_tokens(
        self, *, tenant_id: str, model: str, body: dict[str, Any]
    ) -> dict[str, Any]:
        """A non-streamed ``/v1/completions`` answer for the tenant's ``model`` (a checkpoint
        being loaded is waited for, as for ``forward``), counted in the tenant's limit. The
        Tinker protocol's sampling calls it; an engine's refusal raises ``InvalidRequest``."""
        deadline = time.monotonic() + self.settings.gateway_loading_wait_s

        def resolve() -> tuple[EngineRoute, TenantLimits]:
            with self._sessions() as session:
                limits = tenants.limits_of(session.get_one(Tenant, tenant_id), self.settings)
                route = resolve_route(
                    session,
                    tenant_id=tenant_id,
                    model=model,
                    idle_timeout_s=self.settings.worker_idle_timeout_s,
                    on_unplaced=self._on_unplaced,
                )
            return route, limits

        while True:
            try:
                route, limits = await anyio.to_thread.run_sync(resolve, limiter=self.resolvers)
                break
            except Unavailable as exc:
                if exc.state != "loading" or time.monotonic() >= deadline:
                    raise
            await anyio.sleep(LOADING_POLL_S)
        cost = _cost(
            body,
            size=len(json.dumps(body)),
            counted_max_tokens=self.settings.gateway_counted_max_tokens,
        )
        _check_fits(limits, cost)
        release = await self.loads.admit(tenant_id, limits=limits, cost=cost)
        try:
            upstream_body = {**body, "model": route.engine_model}
            COMPLETIONS.ask_for_logprobs(upstream_body)
            upstream = await self._send(
                route=route, path=COMPLETIONS.path, body=upstream_body, tenant_id=tenant_id
            )
            if upstream.status_code != 200:
                await _refusal(upstream, route=route)  # raises unless the request was refused
                raise InvalidRequest(f"the engine refused the request: {_engine_message(upstream)}")
            content = await _read_json(upstream, route=route)
        finally:
            release()
        if not isinstance(content, dict):
            raise EngineError(f"the engine of worker {route.worker_id} answered no JSON object")
        return content

    async def _send(
        self, *, route: EngineRoute, path: str, body: dict[str, Any], tenant_id: str
    ) -> _Upstream:
        """The engine's answer, its body not read yet."""
        client = self._client_of(route)
        url = route.engine_endpoint + path
        data = _JSON.encode(body)
        headers = {
            "Authorization": f"Bearer {route.engine_secret}",
            "Content-Type": "application/json",
            TENANT_HEADER: tenant_id,
        }
        try:
            try:
                return await client.post(url, body=data, headers=headers)
            except STALE_CONNECTION_ERRORS as exc:
                if isinstance(exc, aiohttp.ClientConnectorError):
                    raise
                return await client.post(url, body=data, headers=headers)
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


def _key_digest(credentials: HTTPAuthorizationCredentials) -> bytes:
    return hashlib.sha256(credentials.credentials.encode()).digest()


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


def _parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The caller's JSON, its options checked against their ranges (``endpoint.schema``)."""
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name)

    try:
        body = json.loads(raw, parse_constant=constant)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object (an OpenAI request)")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest(
            "model is required: pass '<entity>/<project>/<name>' or "
            "'<entity>/<project>/<name>:step<N>' (GET /v1/models lists yours)"
        )
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise InvalidRequest(f"stream must be true or false, not {body['stream']!r}")
    try:
        endpoint.schema.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc)) from None
    if constants:
        raise InvalidRequest(
            f"the body holds {constants[0]}, which is not a JSON number: send finite numbers"
        )
    return body


def _cost(body: dict[str, Any], *, size: int, counted_max_tokens: int) -> Load:
    """What the request holds while in flight. Values the engine will refuse (a negative
    ``n``, a string ``max_tokens``) count as their defaults: the engine's 400 follows."""
    n = _positive_int(body.get("n")) or 1
    prompt = body.get("prompt")
    prompts = (
        len(prompt) if isinstance(prompt, list) and prompt and not _is_token_ids(prompt) else 1
    )
    max_tokens = (
        _positive_int(body.get("max_completion_tokens"))
        or _positive_int(body.get("max_tokens"))
        or counted_max_tokens
    )
    sequences = n * prompts
    return Load(requests=1, sequences=sequences, tokens=size + sequences * max_tokens)


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _is_token_ids(prompt: list[Any]) -> bool:
    """A completion prompt given as one list of token ids (not a list of prompts)."""
    return all(isinstance(item, int) for item in prompt)


def _check_fits(limits: TenantLimits, cost: Load) -> None:
    """A request larger than its tenant's whole allowance can never be admitted: 400."""
    if cost.sequences > limits.max_sequences_in_flight:
        raise InvalidRequest(
            f"this request asks for {cost.sequences} sequences (n times the number of "
            f"prompts), more than the {limits.max_sequences_in_flight} your tenant may have "
            "in flight (max_sequences_in_flight): lower n, or split the request"
        )
    if cost.tokens > limits.max_tokens_in_flight:
        raise InvalidRequest(
            f"this request counts {cost.tokens} tokens (its body's bytes plus n x max_tokens), "
            "more than the "
            f"{limits.max_tokens_in_flight} your tenant may have in flight "
            "(max_tokens_in_flight): send a shorter prompt, or lower n or max_tokens"
        )


_JSON = msgspec.json.Encoder()


async def _read_json(upstream: _Upstream, *, route: EngineRoute) -> Any:
    """The engine's whole answer, parsed by msgspec (NaN, Infinity and numbers out of a
    float's range are not JSON: an answer holding them is refused as not JSON)."""
    try:
        return msgspec.json.decode(await upstream.read())
    except msgspec.DecodeError as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} answered what is not JSON ({exc}): retry"
        ) from exc
    except TimeoutError as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} did not finish in time: retry, with a "
            "smaller max_tokens if it keeps happening"
        ) from exc
    except (aiohttp.ClientError, ValueError) as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer "
            f"({type(exc).__name__}): retry"
        ) from exc
    finally:
        upstream.close()


async def _refusal(upstream: _Upstream, *, route: EngineRoute) -> Response:
    """The caller's answer to an engine that did not answer 200."""
    try:
        await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer "
            f"({upstream.status_code}, {type(exc).__name__}): retry"
        ) from exc
    finally:
        upstream.close()
    status = upstream.status_code
    said = _engine_message(upstream)
    worker = f"worker {route.worker_id}"
    if status in (401, 403):
        raise EngineError(
            f"the engine of {worker} refused the control plane's credentials ({status}: "
            f"{said}): the worker's engine secret is out of date; restart the worker"
        )
    if status == 404:
        raise Unavailable(
            f"{worker} does not serve step {route.step} of this model right now (its engine "
            f"said: {said}); it is being loaded again: retry shortly",
            retry_after_s=2.0,
        )
    if status == 503:
        raise Unavailable(f"the engine of {worker} cannot serve now: {said}", retry_after_s=5.0)
    if status >= 500:
        raise EngineError(f"the engine of {worker} failed ({status}): {said}")
    if 300 <= status < 400:
        raise EngineError(
            f"the engine of {worker} answered with a redirect ({status}), which the control "
            "plane does not follow: its operator must check what answers at its address"
        )
    return Response(
        upstream.content,
        status_code=status,
        media_type=upstream.headers.get("content-type", "application/json"),
    )


def _engine_message(upstream: _Upstream) -> str:
    try:
        body = json.loads(upstream.content)
    except ValueError:
        return upstream.text().strip() or upstream.reason
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)


class _EventStream(StreamingResponse):
    """The engine's server-sent events, passed on one event at a time with ``model``
    rewritten; the upstream request is closed as soon as the caller leaves."""

    def __init__(
        self,
        upstream: _Upstream,
        *,
        model: str,
        headers: dict[str, str],
    ) -> None:
        super().__init__(
            _events(upstream, model=model),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._upstream = upstream
        # Set by the route: counts the request out of its tenant's limit.
        self.on_close: Callable[[], None] = lambda: None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # OSError: the caller left while an event was being written.
            with contextlib.suppress(OSError):
                await until_disconnected(receive, self.stream_response(send))
        finally:
            self._upstream.close()
            self.on_close()


async def _events(upstream: _Upstream, *, model: str) -> AsyncIterator[str]:
    """The engine's events, rewritten, and an error event if it breaks off (events that came
    in the same instant as the broken connection may be lost with it: the caller retries)."""
    event: list[str] = []
    try:
        async for line in upstream.lines():
            if line:
                event.append(_rewrite_data_line(line, model=model))
                continue
            if event:
                yield "\n".join(event) + "\n\n"
                event = []
        if event:
            yield "\n".join(event) + "\n\n"
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
        # The status line is long sent: the failure can only be told as a last event.
        message = f"the engine broke off the stream ({type(exc).__name__}): retry the request"
        payload = {"error": {"type": EngineError.type, "message": message}}
        yield f"data: {json.dumps(payload)}\n\n"


def _rewrite_data_line(line: str, *, model: str) -> str:
    if not line.startswith("data:"):
        return line
    payload = line.removeprefix("data:").strip()
    if not payload.startswith("{"):
        return line
    try:
        data = json.loads(payload)
    except ValueError:
        return line
    if not isinstance(data, dict) or "model" not in data:
        return line
    data["model"] = model
    _prompt_ids_onto_choices(data)
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _prompt_ids_onto_choices(data: dict[str, Any]) -> None:
    """vLLM gives a chat answer's prompt ids once, at the top (a stream: in its first chunk);
    a client keeps only the choice, so each choice gets them too (where ART reads them)."""
    prompt_ids = data.get("prompt_token_ids")
    choices = data.get("choices")
    if not isinstance(prompt_ids, list) or not isinstance(choices, list):
        return
    for choice in choices:
        if isinstance(choice, dict) and choice.get("prompt_token_ids") is None:
            choice["prompt_token_ids"] = prompt_ids

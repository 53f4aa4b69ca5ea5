"""The worker's front door: the only port of a worker that anything outside it reaches.

The engine (vLLM or the CPU engine) listens on 127.0.0.1 only, where its control routes
(adapter loading, sleep and wake-up, and vLLM's dev-mode routes) serve the worker agent
alone. The front door listens on the worker's public address and:

- speaks HTTPS only, with a certificate the worker made at start and registered with the
  control plane, which pins it (``skytrain_backend.tls``); plain HTTP gets no answer;
- refuses every request that lacks the worker's engine secret (compared in constant time),
  before looking at anything else;
- forwards only what the gateway needs: chat completions, completions, the model list and
  health. Every other path is a 404, with or without the secret;
- streams the engine's answer back as it comes, and closes the request to the engine as soon
  as the caller leaves (the engine then stops generating);
- counts the requests in flight for each model (adapter) the engine serves, from the moment
  their body is read until their answer ends: the agent unloads no adapter that a request
  is still for (``EngineHost.sync_adapters``), whichever control plane sent it.

The engine is called with its own secret, which never leaves the worker.
"""

from __future__ import annotations

import json
import logging
import secrets
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager

import httpx
import msgspec
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

from skytrain_backend.asgi import CLIENT_CLOSED_REQUEST, until_disconnected
from skytrain_backend.observability import logs
from skytrain_backend.protocol import TENANT_HEADER

logger = logging.getLogger(__name__)

_INFERENCE_PATHS = ("/v1/chat/completions", "/v1/completions")

# (method, path) pairs forwarded to the engine; anything else is not found.
FORWARDED_ROUTES = frozenset(
    {
        ("POST", "/v1/chat/completions"),
        ("POST", "/v1/completions"),
        ("GET", "/v1/models"),
        ("GET", "/health"),
    }
)
# The engine's answer headers worth passing on; hop-by-hop and length headers are the
# front door's own business.
PASSED_HEADERS = ("content-type", "cache-control")
# Generation on a CPU engine can take minutes before a non-streamed answer's first byte.
ENGINE_TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)
# The engine's server (uvicorn, under vLLM and the CPU engine) closes a connection idle for 5 s.
# An idle connection kept as long would be reused just as the engine closes it, and the request
# lost: it is dropped after 2 s instead, well before the engine's close.
ENGINE_LIMITS = httpx.Limits(
    max_connections=None, max_keepalive_connections=64, keepalive_expiry=2.0
)
# What reusing a kept connection the engine has closed all the same looks like (the engine
# restarted, or closed it as the request arrived): the request is sent once more. The same
# errors also come from an engine that took the request and then dropped the connection
# while generating: a completion has no side effects, so the worst case is a generation done
# twice (and an engine that is gone fails the second try at once, as unreachable).
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)


class _Addressed(msgspec.Struct):
    """What the front door reads of an inference request's body: the model it is for."""

    model: str = ""


_ADDRESSED = msgspec.json.Decoder(_Addressed)


def _error(status: int, type_: str, message: str) -> JSONResponse:
    """An error in the engines' own shape, so the gateway reads it like any engine error."""
    return JSONResponse(
        {"error": {"message": message, "type": type_, "param": None, "code": status}},
        status_code=status,
    )


class FrontDoor:
    """The front door's ASGI app; see the module docstring."""

    def __init__(
        self,
        *,
        engine_url: str,
        engine_api_key: str | None,
        secret: str,
        max_body_bytes: int,
    ) -> None:
        self._secret = secret.encode()
        self._max_body_bytes = max_body_bytes
        headers = {"Authorization": f"Bearer {engine_api_key}"} if engine_api_key else {}
        self._engine = httpx.AsyncClient(
            base_url=engine_url.rstrip("/"),
            headers=headers,
            timeout=ENGINE_TIMEOUT,
            limits=ENGINE_LIMITS,
        )

        # Requests being answered now (the engine's batch, as the heartbeat reports it).
        self.in_flight = 0
        # The same, per model asked for (the engine's name for it: an adapter or the base).
        self._in_flight_for: Counter[str] = Counter()

    def requests_for(self, model: str) -> int:
        """Requests in flight for ``model`` (its name in the engine) now."""
        return self._in_flight_for[model]

    async def aclose(self) -> None:
        await self._engine.aclose()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "lifespan":
            await self._lifespan(receive, send)
            return
        if scope["type"] != "http":
            return
        # Running requests as the operator's metrics show them: inference, not health checks
        # or adapter loads.
        counted = scope.get("path") in _INFERENCE_PATHS
        self.in_flight += counted
        try:
            await self._serve(Request(scope, receive), send)
        finally:
            self.in_flight -= counted

    async def _lifespan(self, receive: Receive, send: Send) -> None:
        while True:
            message = await receive()
            if message["type"] == "lifespan.startup":
                await send({"type": "lifespan.startup.complete"})
            elif message["type"] == "lifespan.shutdown":
                await self.aclose()
                await send({"type": "lifespan.shutdown.complete"})
                return

    def _authorized(self, request: Request) -> bool:
        scheme, _, token = request.headers.get("authorization", "").partition(" ")
        return scheme.lower() == "bearer" and secrets.compare_digest(token.encode(), self._secret)

    async def _serve(self, request: Request, send: Send) -> None:
        refusal = self._refusal(request)
        if refusal is None:
            body = await self._body(request)
            if body is not None:
                with self._counted(_model_of(request.url.path, body)):
                    response = await self._answer(request, body)
                    await response(request.scope, request.receive, send)
                return
            refusal = _error(
                413, "payload_too_large", f"the request body is over {self._max_body_bytes} bytes"
            )
        await refusal(request.scope, request.receive, send)

    def _refusal(self, request: Request) -> Response | None:
        """The answer to a request that goes no further than the door, None for the others."""
        if not self._authorized(request):
            return _error(
                401,
                "authentication_error",
                "missing or wrong engine secret: send 'Authorization: Bearer <secret>'",
            )
        if (request.method, request.url.path) not in FORWARDED_ROUTES:
            return _error(404, "not_found_error", f"{request.method} {request.url.path} not found")
        return None

    @contextmanager
    def _counted(self, model: str | None) -> Iterator[None]:
        if model is None:
            yield
            return
        self._in_flight_for[model] += 1
        try:
            yield
        finally:
            self._in_flight_for[model] -= 1
            if not self._in_flight_for[model]:
                del self._in_flight_for[model]

    async def _answer(self, request: Request, body: bytes) -> Response:
        try:
            upstream = await until_disconnected(
                request.receive,
                self._send(
                    self._engine.build_request(
                        request.method,
                        request.url.path,
                        params=request.query_params,
                        content=body,
                        headers=_forwarded_headers(request),
                    )
                ),
            )
        except httpx.TransportError as exc:
            if isinstance(exc, httpx.TimeoutException) and not isinstance(
                exc, httpx.ConnectTimeout
            ):
                return _error(
                    504, "timeout", f"the engine did not answer in time ({type(exc).__name__})"
                )
            # Starting, restarting, gone or not accepting: the gateway takes a 503 as "retry
            # shortly".
            logger.warning("the engine cannot be reached: %s: %s", type(exc).__name__, exc)
            return _error(
                503,
                "service_unavailable",
                f"the engine cannot be reached ({type(exc).__name__}): it may be starting or "
                "restarting; retry shortly",
            )
        if upstream is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        headers = {k: v for k in PASSED_HEADERS if (v := upstream.headers.get(k)) is not None}
        return StreamingResponse(
            _relay(upstream), status_code=upstream.status_code, headers=headers
        )

    async def _send(self, request: httpx.Request) -> httpx.Response:
        """The engine's response, its body not read yet."""
        try:
            return await self._engine.send(request, stream=True)
        except STALE_CONNECTION_ERRORS:
            return await self._engine.send(request, stream=True)

    async def _body(self, request: Request) -> bytes | None:
        """The request body, or None once it passes the limit (read no further)."""
        chunks: list[bytes] = []
        size = 0
        async for chunk in request.stream():
            size += len(chunk)
            if size > self._max_body_bytes:
                return None
            chunks.append(chunk)
        return b"".join(chunks)


async def _relay(upstream: httpx.Response) -> AsyncIterator[bytes]:
    """The engine's body as it arrives; closing it (the caller left) closes the upstream."""
    try:
        async for chunk in upstream.aiter_raw():
            yield chunk
    except httpx.HTTPError as exc:
        # The status line is long sent: say what happened as a last server-sent event.
        message = f"the engine broke off its answer ({type(exc).__name__})"
        yield f"data: {json.dumps({'error': {'message': message}})}\n\n".encode()
    finally:
        await upstream.aclose()


def _model_of(path: str, body: bytes) -> str | None:
    """The model an inference request is for (None for other routes, or a body that is not
    a JSON object naming one: the engine answers that with its own 400)."""
    if path not in _INFERENCE_PATHS:
        return None
    try:
        return _ADDRESSED.decode(body).model or None
    except msgspec.DecodeError:
        return None


def _forwarded_headers(request: Request) -> dict[str, str]:
    """What the engine needs of the caller's headers: the body's type, and whose request it is
    (the engine takes turns between tenants)."""
    headers = {"Content-Type": request.headers.get("content-type", "")}
    if (tenant := request.headers.get(TENANT_HEADER)) is not None:
        headers[TENANT_HEADER] = tenant
    # The id the gateway gave the request (observability.http bound it), for the engine's
    # lines too; made unique for this hop, since vLLM takes it as its own request id and a
    # caller may send the same id twice.
    if (request_id := logs.current_request_id()) is not None:
        headers[logs.REQUEST_ID_HEADER] = logs.engine_request_id(request_id)
    return headers

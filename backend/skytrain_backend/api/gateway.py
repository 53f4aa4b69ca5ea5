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

Streams are passed through event by event as the engine sends them. When the caller goes
away (mid-stream, or while a non-streamed request is still generating) the upstream request
is closed at once, which makes the engine stop generating for it.

Engine refusals of the request itself (4xx) pass through with the engine's status and
OpenAI-style body. Failures that are not the caller's doing are said in skytrain's words: an
unreachable engine or one that no longer serves the checkpoint is a 503 to retry, an engine
that rejects the control plane's credentials or fails is a 502.

Each tenant may have ``tenant_max_concurrent_requests`` requests in flight in this process
(streams count until they end); the next one gets 429.
"""

from __future__ import annotations

import contextlib
import json
import time
from collections import Counter
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import anyio
import httpx
from fastapi import Request, Response
from fastapi.responses import JSONResponse, StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session, sessionmaker
from starlette.types import Receive, Scope, Send

from skytrain_backend.api.deps import get_tenant
from skytrain_backend.asgi import CLIENT_CLOSED_REQUEST, until_disconnected
from skytrain_backend.config import Settings
from skytrain_backend.errors import (
    EngineError,
    InvalidRequest,
    RateLimited,
    Unavailable,
)
from skytrain_backend.scheduler.routing import EngineRoute, resolve_route

# Generation on a CPU engine can take minutes before a non-streamed answer's first byte.
ENGINE_TIMEOUT = httpx.Timeout(connect=10.0, read=900.0, write=60.0, pool=60.0)
# Connections are bounded by the per-tenant limit, not by the pool. Idle connections are
# dropped well before engines close them (uvicorn, under vLLM and the CPU engine: after 5 s).
ENGINE_LIMITS = httpx.Limits(
    max_connections=None, max_keepalive_connections=256, keepalive_expiry=2.0
)
# What reusing a keep-alive connection the engine has just closed looks like; nothing reached
# the engine, so the request is sent once more on a new connection.
STALE_CONNECTION_ERRORS = (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError)

# How often a request waiting for its checkpoint to load looks again.
LOADING_POLL_S = 0.25

# Requests resolved in threads at once: fewer than the database pool's 5 kept connections, so
# a burst reuses them instead of opening (and configuring) a connection per request.
RESOLVE_CONCURRENCY = 4


@dataclass(frozen=True)
class Endpoint:
    path: str
    ask_for_logprobs: Callable[[dict[str, Any]], None]


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


CHAT = Endpoint("/v1/chat/completions", _chat_logprobs)
COMPLETIONS = Endpoint("/v1/completions", _completion_logprobs)


@dataclass(frozen=True)
class _Routed:
    tenant_id: str
    body: dict[str, Any]
    route: EngineRoute


class Gateway:
    """One per app, opened in its lifespan: the pooled HTTP client to worker engines, requests
    in flight per tenant, and the forwarding of one request."""

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
        self.http = httpx.AsyncClient(timeout=ENGINE_TIMEOUT, limits=ENGINE_LIMITS)
        self.resolvers = anyio.CapacityLimiter(RESOLVE_CONCURRENCY)
        self.max_in_flight_per_tenant = settings.tenant_max_concurrent_requests
        self._in_flight: Counter[str] = Counter()

    async def aclose(self) -> None:
        await self.http.aclose()

    def admit(self, tenant_id: str) -> Callable[[], None]:
        """Count a request in; returns the function that counts it out (safe to call twice).

        Only the event loop calls this, so the counter needs no lock.
        """
        if self._in_flight[tenant_id] >= self.max_in_flight_per_tenant:
            raise RateLimited(
                f"{self.max_in_flight_per_tenant} inference requests of yours are in flight, "
                "the most allowed at once (SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS): wait for "
                "some to finish, or lower your client's concurrency"
            )
        self._in_flight[tenant_id] += 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight[tenant_id] -= 1
                if not self._in_flight[tenant_id]:
                    del self._in_flight[tenant_id]

        return release

    async def forward(
        self,
        request: Request,
        *,
        credentials: HTTPAuthorizationCredentials | None,
        endpoint: Endpoint,
    ) -> Response:
        """The engine's answer to the caller's request, or the reason there is none."""
        raw = await request.body()
        routed = await self._route(credentials=credentials, raw=raw)
        release = self.admit(routed.tenant_id)
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
        self, *, credentials: HTTPAuthorizationCredentials | None, raw: bytes
    ) -> _Routed:
        """Where the request goes; a checkpoint being loaded onto its worker is waited for.

        Loading takes seconds (the worker fetches the adapter at its next heartbeat), less
        than most clients' retry budget: holding the request spares them a 503 round trip.
        """
        deadline = time.monotonic() + self.settings.gateway_loading_wait_s
        while True:
            try:
                return await anyio.to_thread.run_sync(
                    self._resolve, credentials, raw, limiter=self.resolvers
                )
            except Unavailable as exc:
                if exc.state != "loading" or time.monotonic() >= deadline:
                    raise
            await anyio.sleep(LOADING_POLL_S)

    def _resolve(self, credentials: HTTPAuthorizationCredentials | None, raw: bytes) -> _Routed:
        """Authenticate, parse and route in one session, held only for these few queries (a
        connection held across the request would starve the pool under concurrent streams)."""
        with self._sessions() as session:
            tenant_id = get_tenant(session, credentials).id
            body = _parse_body(raw)
            route = resolve_route(
                session,
                tenant_id=tenant_id,
                model=body["model"],
                idle_timeout_s=self.settings.worker_idle_timeout_s,
                on_unplaced=self._on_unplaced,
            )
        return _Routed(tenant_id=tenant_id, body=body, route=route)

    async def _proxy(self, request: Request, *, routed: _Routed, endpoint: Endpoint) -> Response:
        body, route = routed.body, routed.route
        upstream_body = {**body, "model": route.engine_model}
        endpoint.ask_for_logprobs(upstream_body)
        headers = {
            "X-Skytrain-Model-Id": route.model_id,
            "X-Skytrain-Step": str(route.step),
            "X-Skytrain-Worker": route.worker_id,
        }
        upstream = await until_disconnected(
            request.receive, self._send(route=route, path=endpoint.path, body=upstream_body)
        )
        if upstream is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if upstream.status_code != 200:
            return await _refusal(upstream, route=route)
        if body.get("stream"):
            return _EventStream(upstream, model=body["model"], headers=headers)
        content = await until_disconnected(request.receive, _read_json(upstream, route=route))
        if content is None:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if isinstance(content, dict) and "model" in content:
            content["model"] = body["model"]
            _prompt_ids_onto_choices(content)
        return JSONResponse(content, headers=headers)

    async def _send(self, *, route: EngineRoute, path: str, body: dict[str, Any]) -> httpx.Response:
        """The engine's response, its body not read yet."""
        request = self.http.build_request(
            "POST",
            route.engine_endpoint + path,
            json=body,
            headers={"Authorization": f"Bearer {route.engine_secret}"},
        )
        try:
            try:
                return await self.http.send(request, stream=True)
            except STALE_CONNECTION_ERRORS:
                return await self.http.send(request, stream=True)
        except httpx.TimeoutException as exc:
            raise EngineError(
                f"the engine of worker {route.worker_id} did not answer in time "
                f"({type(exc).__name__}): retry, with a smaller max_tokens if it keeps happening"
            ) from exc
        except httpx.TransportError as exc:
            raise Unavailable(
                f"the engine of worker {route.worker_id} at {route.engine_endpoint} cannot be "
                f"reached ({type(exc).__name__}: {exc}); the worker may be restarting: retry "
                "shortly",
                retry_after_s=5.0,
            ) from exc


def _parse_body(raw: bytes) -> dict[str, Any]:
    try:
        body = json.loads(raw)
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
    return body


async def _read_json(upstream: httpx.Response, *, route: EngineRoute) -> Any:
    try:
        await upstream.aread()
        return upstream.json()
    except httpx.TimeoutException as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} did not finish in time: retry, with a "
            "smaller max_tokens if it keeps happening"
        ) from exc
    except (httpx.TransportError, ValueError) as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer ({exc}): retry"
        ) from exc
    finally:
        with anyio.CancelScope(shield=True):
            await upstream.aclose()


async def _refusal(upstream: httpx.Response, *, route: EngineRoute) -> Response:
    """The caller's answer to an engine that did not answer 200."""
    try:
        await upstream.aread()
    except httpx.HTTPError as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer "
            f"({upstream.status_code}, {type(exc).__name__}): retry"
        ) from exc
    finally:
        await upstream.aclose()
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
    return Response(
        upstream.content,
        status_code=status,
        media_type=upstream.headers.get("content-type", "application/json"),
    )


def _engine_message(upstream: httpx.Response) -> str:
    try:
        body = upstream.json()
    except ValueError:
        return upstream.text.strip() or upstream.reason_phrase
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)


class _EventStream(StreamingResponse):
    """The engine's server-sent events, passed on one event at a time with ``model``
    rewritten; the upstream request is closed as soon as the caller leaves."""

    def __init__(
        self,
        upstream: httpx.Response,
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
            with anyio.CancelScope(shield=True):
                await self._upstream.aclose()
                self.on_close()


async def _events(upstream: httpx.Response, *, model: str) -> AsyncIterator[str]:
    event: list[str] = []
    try:
        async for line in upstream.aiter_lines():
            if line:
                event.append(_rewrite_data_line(line, model=model))
                continue
            if event:
                yield "\n".join(event) + "\n\n"
                event = []
        if event:
            yield "\n".join(event) + "\n\n"
    except httpx.HTTPError as exc:
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

"""One place that turns errors into HTTP answers: ``{"error": {"type", "message"}}``.

``SkytrainError`` subclasses carry their status (a storage error's own words, which name
buckets, directories and tenants' keys, go to the log only); FastAPI's request validation
errors become 400 with one line per problem naming the field; Starlette's own HTTP errors
(unknown route, wrong method) keep their status and get the same body shape. The database
driver's errors about the database's operation (PEP 249's OperationalError and
InterfaceError: refused, dropped or closed connections, a server shutting down) become
``DatabaseUnavailable``, 503 with ``Retry-After``; its words (host, port) go to the log.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from sqlalchemy.exc import DBAPIError, InterfaceError, OperationalError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skytrain_backend.errors import (
    DatabaseUnavailable,
    ObjectMissing,
    RateLimited,
    SkytrainError,
    StorageError,
    StoreUnavailable,
    Unavailable,
)
from skytrain_backend.observability import metrics

logger = logging.getLogger(__name__)

_LOCATION_NAMES = {"query": "query parameter ", "path": "path parameter ", "header": "header "}


def error_response(status_code: int, type: str, message: str, **headers: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"type": type, "message": message}}, status_code=status_code, headers=headers
    )


def describe_validation_errors(errors: Sequence[Any]) -> str:
    """``trajectory_groups[0].reward: Input should be a finite number; ...``"""
    lines = []
    for item in errors:
        location = list(item.get("loc", ()))
        prefix = ""
        if location and location[0] in _LOCATION_NAMES:
            prefix = _LOCATION_NAMES[location.pop(0)]
        elif location and location[0] == "body":
            location.pop(0)
        path = ""
        for part in location:
            path += f"[{part}]" if isinstance(part, int) else (f".{part}" if path else str(part))
        message = item.get("msg", "is not valid")
        if item.get("type") == "json_invalid":
            reason = item.get("ctx", {}).get("error", message)
            lines.append(f"the body is not valid JSON ({reason} at character {path.strip('[]')})")
            continue
        lines.append(f"{prefix}{path}: {message}" if path else message)
    return "; ".join(lines)


async def _skytrain_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SkytrainError)
    if exc.status_code >= 429:
        metrics.count_refusal(path=request.url.path, status=exc.status_code, reason=exc.type)
    return skytrain_error_response(exc)


def skytrain_error_response(exc: SkytrainError) -> JSONResponse:
    """The answer to ``exc``: its status, type and message (``Retry-After`` where it has one);
    a storage error's own words go to the log instead."""
    headers = {}
    if (limit := getattr(exc, "limit", None)) is not None:
        metrics.TENANT_LIMITS_HIT.labels(limit=limit).inc()
    if isinstance(exc, Unavailable | RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
    if isinstance(exc, StorageError | ObjectMissing | DatabaseUnavailable):
        # The store's and the driver's own words name buckets, directories, tenants' keys and
        # database hosts: the operator's.
        reference = secrets.token_hex(4)
        logger.error("%s [%s]: %s", type(exc).__name__, reference, exc.message)
        if isinstance(exc, DatabaseUnavailable):
            what = "the database cannot be reached"
        elif isinstance(exc, StoreUnavailable):
            what = "the object store cannot be reached"
            headers["Retry-After"] = str(round(exc.retry_after_s))
        elif isinstance(exc, StorageError):
            what = "the object store failed"
        else:
            what = "the object store lacks an object this needs"
        return error_response(
            exc.status_code,
            exc.type,
            f"{what} (reference {reference} in the control plane's log): "
            "retry shortly; if it keeps failing, tell the operator",
            **headers,
        )
    if exc.status_code >= 500:
        logger.error("%s: %s", type(exc).__name__, exc.message)
    return error_response(exc.status_code, exc.type, exc.message, **headers)


async def _validation_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, RequestValidationError)
    return error_response(400, "invalid_request_error", describe_validation_errors(exc.errors()))


async def _http_error(request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, StarletteHTTPException)
    route = f"{request.method} {request.url.path}"
    if exc.status_code == 404:
        type_, message = "not_found_error", f"no such route: {route} (the API is listed at /docs)"
    elif exc.status_code == 405:
        type_, message = "invalid_request_error", f"method not allowed: {route}"
    else:
        type_, message = "invalid_request_error", str(exc.detail)
    return error_response(exc.status_code, type_, message, **(exc.headers or {}))


def database_outage(exc: BaseException) -> DatabaseUnavailable | None:
    """``exc`` as a DatabaseUnavailable when the database cannot serve now, else None."""
    if isinstance(exc, OperationalError | InterfaceError) or (
        isinstance(exc, DBAPIError) and exc.connection_invalidated
    ):
        return DatabaseUnavailable(f"{type(exc.orig).__name__}: {exc.orig}", retry_after_s=5.0)
    return None


async def _database_error(request: Request, exc: Exception) -> JSONResponse:
    outage = database_outage(exc)
    if outage is None:
        return await _unexpected_error(request, exc)
    return await _skytrain_error(request, outage)


async def _unexpected_error(request: Request, exc: Exception) -> JSONResponse:
    # A driver's error not raised in a route: AnswerMiddlewareErrors hands it here.
    outage = database_outage(exc)
    if outage is not None:
        return await _skytrain_error(request, outage)
    logger.exception("unexpected error", exc_info=exc)
    return error_response(500, "internal_error", "internal error: see the control plane's log")


class AnswerMiddlewareErrors:
    """Answers an error a middleware raises (a tenant's REST admission or a worker's token
    check meeting a database outage) as a route's is, and nothing more.

    The handlers answer errors raised in routes; one raised in a middleware would reach
    Starlette's outermost layer, which answers it and raises it again for the server, and
    uvicorn then closes the connection (the client's next request on it is reset). Placed
    just inside the request log, so the log shows the answer sent. Errors of any other kind,
    and any raised once an answer has started, go on as before.
    """

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def sending(message: Message) -> None:
            nonlocal started
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, receive, sending)
        except (SkytrainError, DBAPIError) as exc:
            if started:
                raise
            request = Request(scope, receive)
            if isinstance(exc, SkytrainError):
                response = await _skytrain_error(request, exc)
            else:
                response = await _database_error(request, exc)
            await response(scope, receive, send)


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SkytrainError, _skytrain_error)
    app.add_exception_handler(DBAPIError, _database_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

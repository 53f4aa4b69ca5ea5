"""One place that turns errors into HTTP answers: ``{"error": {"type", "message"}}``.

``SkytrainError`` subclasses carry their status; FastAPI's request validation errors become
400 with one line per problem naming the field; Starlette's own HTTP errors (unknown route,
wrong method) keep their status and get the same body shape.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from skytrain_backend.errors import RateLimited, SkytrainError, Unavailable

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


async def _skytrain_error(_request: Request, exc: Exception) -> JSONResponse:
    assert isinstance(exc, SkytrainError)
    headers = {}
    if isinstance(exc, Unavailable | RateLimited):
        headers["Retry-After"] = str(max(1, round(exc.retry_after_s)))
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


async def _unexpected_error(_request: Request, exc: Exception) -> JSONResponse:
    logger.exception("unexpected error", exc_info=exc)
    return error_response(500, "internal_error", "internal error: see the control plane's log")


def install_error_handlers(app: FastAPI) -> None:
    app.add_exception_handler(SkytrainError, _skytrain_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(StarletteHTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)

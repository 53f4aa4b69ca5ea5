"""Requests with large JSON bodies (trajectory batches): how the OpenAPI document describes
their bodies, which ``api.ingest`` reads itself, and the cyclic GC paused while they run.

Parsing and validating a batch of 10,000 trajectories (60 MB of JSON) allocates millions of
small containers, and CPython's generational collector, triggered by those allocations, scans
the growing heap again and again: it cost 2-3x the parsing and validation themselves
(`bench/ingest_trajectories.py`). Reference counting still frees everything as usual while
the collector is paused; only cyclic garbage waits until the last large request has ended.
"""

from __future__ import annotations

import gc
import threading
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from typing import Any

from pydantic import BaseModel
from starlette.requests import Request
from starlette.responses import Response

from skytrain_backend.api.deps import SessionRoute
from skytrain_backend.json_types import JSONObject

LARGE_BODY_BYTES = 256 * 1024


class _CollectorPause:
    """Pauses shared by overlapping requests: the collector resumes when the last one ends,
    and only if it was running before the first began."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._holders = 0
        self._resume = False

    @contextmanager
    def __call__(self) -> Iterator[None]:
        with self._lock:
            if self._holders == 0:
                self._resume = gc.isenabled()
                gc.disable()
            self._holders += 1
        try:
            yield
        finally:
            with self._lock:
                self._holders -= 1
                if self._holders == 0 and self._resume:
                    gc.enable()


gc_paused = _CollectorPause()


def _content_length(request: Request) -> int:
    value = request.headers.get("content-length", "")
    return int(value) if value.isdigit() else 0


class LargeBodyRoute(SessionRoute):
    """A route whose requests with a body of 256 KiB or more are handled with the GC paused."""

    def get_route_handler(self) -> Callable[[Request], Coroutine[Any, Any, Response]]:
        handle = super().get_route_handler()

        async def handle_large_bodies(request: Request) -> Response:
            if _content_length(request) < LARGE_BODY_BYTES:
                return await handle(request)
            with gc_paused():
                return await handle(request)

        return handle_large_bodies


# Bodies the routes read themselves, by schema name: ``add_json_body_docs`` adds them
# (and the schemas they use) to the OpenAPI document's components.
_JSON_BODIES: dict[str, type[BaseModel]] = {}
_COMPONENTS = "#/components/schemas/{model}"


def json_body_doc(schema: type[BaseModel]) -> JSONObject:
    """The ``openapi_extra`` of a route that reads its JSON body itself: the body is
    documented as ``schema``, as if FastAPI had parsed it."""
    _JSON_BODIES[schema.__name__] = schema
    reference = {"$ref": _COMPONENTS.format(model=schema.__name__)}
    return {
        "requestBody": {"required": True, "content": {"application/json": {"schema": reference}}}
    }


def add_json_body_docs(openapi: JSONObject) -> None:
    """Add the schemas of the streamed bodies to an OpenAPI document's components."""
    components = openapi.setdefault("components", {}).setdefault("schemas", {})
    for name, schema in _JSON_BODIES.items():
        document = schema.model_json_schema(ref_template=_COMPONENTS, mode="validation")
        for def_name, definition in document.pop("$defs", {}).items():
            components.setdefault(def_name, definition)
        components.setdefault(name, document)

"""What the inference gateway tells operators, in calls of one line each from its code:
its log context and line per routed request, the request id it passes on, streams open.
``metrics`` is re-exported so the gateway needs one import."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Iterator
from typing import Protocol

from skytrain_backend.observability import logs, metrics

__all__ = ["metrics", "note_routed", "request_id_header", "stream_open"]

logger = logging.getLogger("skytrain_backend.api.gateway")


class _Route(Protocol):
    @property
    def model_id(self) -> str: ...
    @property
    def worker_id(self) -> str: ...
    @property
    def step(self) -> int: ...


def note_routed(tenant_id: str, route: _Route, path: str) -> None:
    """Bind the request's tenant, model and worker to its log lines, and log where it goes."""
    logs.set_context(tenant_id=tenant_id, model_id=route.model_id, worker_id=route.worker_id)
    logger.info("%s routed to worker %s, step %d", path, route.worker_id, route.step)


def request_id_header() -> dict[str, str]:
    """The request's id, for the worker's front door (which passes it to the engine)."""
    request_id = logs.current_request_id()
    return {logs.REQUEST_ID_HEADER: request_id} if request_id else {}


@contextlib.contextmanager
def stream_open() -> Iterator[None]:
    metrics.GATEWAY_STREAMS_OPEN.inc()
    try:
        yield
    finally:
        metrics.GATEWAY_STREAMS_OPEN.dec()

"""The ASGI middleware every HTTP request of the control plane passes through first.

It gives the request its id (the caller's ``X-Request-Id`` when sane, else a new one), answers
it in ``X-Request-Id``, binds it to the request's log lines, writes one access line, and counts
the request in ``skytrain_http_*`` by route template (``/v1/models/{model_id}``, never the
path), route class, status and tenant class. A long-poll says so when it starts to wait
(``mark_long_poll``): from then on it counts in ``skytrain_http_long_polls_waiting`` instead of
the in-flight gauge, and under ``route_class="long_poll"``, so that waits of 15-30 s by design
neither read as load nor fill the latency percentiles. The worker's front door and the CPU engine use the same
middleware without the counting (``count=False``): their requests come from the gateway.
"""

from __future__ import annotations

import logging
import time

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skytrain_backend.observability import logs, metrics

access_logger = logging.getLogger("skytrain.access")
_METHODS = frozenset({"GET", "HEAD", "POST", "PUT", "PATCH", "DELETE", "OPTIONS"})
# Where the middleware leaves its request's record in the ASGI scope (the routes see the same
# scope).
_SCOPE_KEY = "skytrain.observed"


class _Observed:
    """One request's class, as counted now."""

    __slots__ = ("counted", "route_class")

    def __init__(self, *, counted: bool) -> None:
        self.counted = counted
        self.route_class = metrics.REQUEST


def mark_long_poll(scope: Scope) -> None:
    """Count the request ``scope`` belongs to as a long-poll from now on (once it waits)."""
    observed = scope.get(_SCOPE_KEY)
    if not isinstance(observed, _Observed) or observed.route_class == metrics.LONG_POLL:
        return
    observed.route_class = metrics.LONG_POLL
    if observed.counted:
        metrics.HTTP_IN_FLIGHT.dec()
        metrics.HTTP_LONG_POLLS_WAITING.inc()


class Observe:
    def __init__(self, app: ASGIApp, *, count: bool = True) -> None:
        self.app = app
        self.count = count

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        incoming = None
        for name, value in scope.get("headers", []):
            if name == b"x-request-id":
                incoming = value.decode("latin-1")
                break
        request_id = logs.accept_request_id(incoming)
        header = (b"x-request-id", request_id.encode())
        status = 500
        start = time.perf_counter()

        async def send_with_id(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
                message["headers"] = [
                    *(h for h in message.get("headers", []) if h[0].lower() != b"x-request-id"),
                    header,
                ]
            await send(message)

        observed = _Observed(counted=self.count)
        scope[_SCOPE_KEY] = observed
        if self.count:
            metrics.HTTP_IN_FLIGHT.inc()
        try:
            # Every field is the request's own: none is left from another request.
            with logs.bind(**{**dict.fromkeys(logs.CONTEXT_FIELDS), "request_id": request_id}):
                try:
                    await self.app(scope, receive, send_with_id)
                finally:
                    elapsed = time.perf_counter() - start
                    with logs.bind(job_id=_job_id(scope)):
                        access_logger.info(
                            "%s %s %d %.1fms",
                            scope["method"],
                            scope["path"],
                            status,
                            elapsed * 1000,
                        )
        finally:
            if self.count:
                route_class = observed.route_class
                if route_class == metrics.LONG_POLL:
                    metrics.HTTP_LONG_POLLS_WAITING.dec()
                else:
                    metrics.HTTP_IN_FLIGHT.dec()
                route = _route(scope)
                method = scope["method"] if scope["method"] in _METHODS else "other"
                who = metrics.tenant_class(scope["path"], scope.get("headers", []))
                metrics.HTTP_REQUESTS.labels(
                    method=method,
                    route=route,
                    route_class=route_class,
                    status=str(status),
                    tenant_class=who,
                ).inc()
                metrics.HTTP_DURATION.labels(
                    method=method, route=route, route_class=route_class, tenant_class=who
                ).observe(time.perf_counter() - start)


def _job_id(scope: Scope) -> str | None:
    """The job a route's path names (``{job_id}``: the workers' job and Tinker run routes),
    for the access line; else the one the request bound, if any."""
    job_id = (scope.get("path_params") or {}).get("job_id")
    return job_id if isinstance(job_id, str) else logs.current("job_id")


def _route(scope: Scope) -> str:
    """The template of the route that answered (``/v1/models/{model_id}``); ``unmatched``
    for a path no route has (a 404), so scanners cannot make new series.

    A route of an included router knows its template below the router's prefix only: the
    prefix is the path's leading segments that the template does not cover (a router's
    literal prefix, as bounded as the routes)."""
    route = scope.get("route")
    template = getattr(route, "path_format", None) or getattr(route, "path", None)
    if not isinstance(template, str):
        return "unmatched"
    path = scope["path"]
    if ":path}" in template or path.count("/") < template.count("/"):
        return template
    depth = template.count("/")
    prefix = "/".join(path.split("/")[: path.count("/") + 1 - depth]) if depth else path
    return prefix.rstrip("/") + template if template != "/" else (prefix or "/")

"""Limits every request meets before anything reads its body.

- **Size.** A declared ``Content-Length`` over the route's limit is refused at once (413); a
  body sent in chunks is counted as the route reads it and refused as soon as it passes the
  limit, so an oversize request costs at most the limit in memory. Inference requests have
  their own, smaller limit (``SKYTRAIN_MAX_INFERENCE_REQUEST_BYTES``): a prompt is not a
  batch of trajectories.
- **Time.** A client that has not sent its whole body within
  ``SKYTRAIN_REQUEST_BODY_TIMEOUT_S`` of the request's start is cut off with 408, however
  slowly it trickles.

Checkpoint uploads from workers (gigabytes, ``PUT /v1/worker/jobs/{id}/files/{name}``) have no
size or time limit: the route streams them to the object store. Their worker token, as every
worker route's, has been checked before they get here (``api/admission/rest_admission.py``): a
request without a valid worker token gets 401 having cost nothing.
"""

from __future__ import annotations

import re
import time

import anyio
from starlette.responses import Response
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skytrain_backend.api.errors import error_response
from skytrain_backend.config import Settings
from skytrain_backend.observability.metrics import CONNECTIONS_REFUSED

WORKER_PREFIX = "/v1/worker/"
CHECKPOINT_UPLOAD = re.compile(r"^/v1/worker/jobs/[^/]+/files/[^/]+$")
INFERENCE_PATH = re.compile(r"^/v1(/preview)?/(chat/)?completions$")


class _Refused(Exception):
    """Raised into the app from ``receive`` when the body broke a limit."""


class RequestLimits:
    """The size and time limits above, as ASGI middleware."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        if scope["method"] == "PUT" and CHECKPOINT_UPLOAD.match(path):
            await self.app(scope, receive, send)
            return
        if INFERENCE_PATH.match(path):
            limit, setting = (
                self.settings.server.max_inference_request_bytes,
                "INFERENCE_REQUEST_BYTES",
            )
        else:
            limit, setting = self.settings.server.max_request_bytes, "REQUEST_BYTES"
        declared = dict(scope["headers"]).get(b"content-length", b"")
        if declared.isdigit() and int(declared) > limit:
            await _too_large(f"declares {int(declared)} bytes", limit, setting)(
                scope, receive, send
            )
            return
        await _Limited(self.app, limit, setting, self.settings.server.request_body_timeout_s)(
            scope, receive, send
        )


class _Limited:
    """One request whose body is counted and timed as the app reads it; when it breaks a
    limit, the app's own answer (whatever it made of the broken body) is replaced by ours."""

    def __init__(self, app: ASGIApp, limit: int, setting: str, timeout_s: float) -> None:
        self.app = app
        self.limit = limit
        self.setting = setting
        self.timeout_s = timeout_s
        self.received = 0
        self.body_done = False
        self.refusal: Response | None = None
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        deadline = time.monotonic() + self.timeout_s

        async def limited_receive() -> Message:
            if self.body_done:  # past the body: waiting for a disconnect has no deadline
                return await receive()
            try:
                with anyio.fail_after(max(deadline - time.monotonic(), 0)):
                    message = await receive()
            except TimeoutError:
                CONNECTIONS_REFUSED.labels(reason="body_timeout").inc()
                self.refusal = _timed_out(self.received, self.timeout_s)
                raise _Refused from None
            if message["type"] != "http.request":
                self.body_done = True
                return message
            self.received += len(message.get("body", b""))
            if self.received > self.limit:
                self.refusal = _too_large(
                    f"sent more than {self.limit} bytes", self.limit, self.setting
                )
                raise _Refused
            self.body_done = not message.get("more_body", False)
            return message

        async def guarded_send(message: Message) -> None:
            if self.refusal is not None and not self.started:
                return
            if message["type"] == "http.response.start":
                self.started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, guarded_send)
        except Exception:
            if self.refusal is None or self.started:
                raise
        if self.refusal is not None and not self.started:
            await self.refusal(scope, receive, send)


def _too_large(what: str, limit: int, setting: str) -> Response:
    return error_response(
        413,
        "payload_too_large",
        f"the request body {what}, over the limit of {limit} bytes (SKYTRAIN_MAX_{setting}): "
        + (
            "shorten the prompt"
            if setting == "INFERENCE_REQUEST_BYTES"
            else "send fewer trajectories per request"
        ),
    )


def _timed_out(received: int, timeout_s: float) -> Response:
    return error_response(
        408,
        "request_timeout",
        f"the request body did not arrive within {timeout_s:g} s (SKYTRAIN_REQUEST_BODY_"
        f"TIMEOUT_S; {received} bytes came): send it faster, or in smaller requests",
        Connection="close",
    )

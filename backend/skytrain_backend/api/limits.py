"""The request body size limit, enforced before anything parses the body.

A declared ``Content-Length`` over the limit is refused at once; a body sent in chunks is
counted as it arrives and refused as soon as it passes the limit, so an oversize request
costs at most the limit in memory and never reaches a route.
"""

from __future__ import annotations

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skytrain_backend.api.errors import error_response


class BodySizeLimit:
    """Refuses bodies over ``max_bytes``, except on paths under ``exempt_prefixes``.

    Workers upload checkpoint files (gigabytes for large adapters) under ``/v1/worker/``;
    those routes stream the body to the object store themselves.
    """

    def __init__(
        self, app: ASGIApp, *, max_bytes: int, exempt_prefixes: tuple[str, ...] = ()
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt_prefixes = exempt_prefixes

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["path"].startswith(self.exempt_prefixes):
            await self.app(scope, receive, send)
            return
        declared = dict(scope["headers"]).get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_bytes:
            await self._refuse(scope, receive, send, f"declares {int(declared)} bytes")
            return
        chunks: list[Message] = []
        size = 0
        while True:
            message = await receive()
            chunks.append(message)
            if message["type"] != "http.request":
                break
            size += len(message.get("body", b""))
            if size > self.max_bytes:
                await self._refuse(scope, receive, send, f"sent more than {self.max_bytes} bytes")
                return
            if not message.get("more_body", False):
                break

        async def replay() -> Message:
            return chunks.pop(0) if chunks else await receive()

        await self.app(scope, replay, send)

    async def _refuse(self, scope: Scope, receive: Receive, send: Send, what: str) -> None:
        response = error_response(
            413,
            "payload_too_large",
            f"the request body {what}, over the limit of {self.max_bytes} bytes "
            "(SKYTRAIN_MAX_REQUEST_BYTES): send fewer trajectories per request",
        )
        await response(scope, receive, send)

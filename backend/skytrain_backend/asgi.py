"""Small ASGI helpers shared by the control plane's gateway and the CPU engine's server."""

from __future__ import annotations

from collections.abc import Awaitable
from typing import TypeVar

import anyio
from starlette.types import Receive

T = TypeVar("T")

# Status of a request whose caller left before the answer (nginx's convention; never sent).
CLIENT_CLOSED_REQUEST = 499


async def until_disconnected(receive: Receive, work: Awaitable[T]) -> T | None:
    """``work``'s result, or None (``work`` cancelled) if the caller disconnects first.

    Cancelling ``work`` is how the callers stop what the request started: the gateway closes
    its upstream connection (the engine stops generating), the engine frees the request's
    place in its batch, a stream stops being written.
    """
    result: list[T] = []
    failure: Exception | None = None
    async with anyio.create_task_group() as group:

        async def watch() -> None:
            while (await receive())["type"] != "http.disconnect":
                pass
            group.cancel_scope.cancel()

        group.start_soon(watch)
        try:
            result.append(await work)
        except Exception as exc:  # raised below: the task group would wrap it in a group
            failure = exc
        group.cancel_scope.cancel()
    if failure is not None:
        raise failure
    return result[0] if result else None

"""Long-polls: hold a request until there is something to answer, or ``wait_s`` passed.

The answer is always a query's (``check``, run in the thread pool); a notification
(``db.notify``) only says when to run it again. Nothing is held while waiting: no session
transaction, no database connection, no thread. A client that hangs up ends the wait, so
nothing is handed to a request nobody reads any more (a worker's lease above all). A server
shutting down (``Notifier.close_threadsafe``) answers every long-poll at once.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

from starlette.concurrency import run_in_threadpool
from starlette.requests import Request

from skytrain_backend.db.notify import Notifier

T = TypeVar("T")


async def long_poll(
    request: Request,
    notifier: Notifier,
    check: Callable[[], T | None],
    *,
    channel: str,
    key: str | None = None,
    wait_s: float,
) -> T | None:
    """``check()``'s first answer that is not None, checking again at every notification of
    ``channel`` (and ``key``) and once more when ``wait_s`` runs out; None then."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    hung_up = asyncio.ensure_future(_hung_up(request)) if wait_s > 0 else None
    try:
        while True:
            # Taken before the check: a change committed during it still wakes the wait.
            ticket = notifier.ticket(channel, key)
            notifier.counts[f"checks/{channel}"] += 1
            found = await run_in_threadpool(check)
            remaining = deadline - loop.time()
            if found is not None or remaining <= 0 or notifier.closing:
                return found
            if hung_up is None or hung_up.done():
                return found
            waiting = asyncio.ensure_future(notifier.wait(ticket, remaining))
            await asyncio.wait({waiting, hung_up}, return_when=asyncio.FIRST_COMPLETED)
            if hung_up.done():  # even if woken too: nobody would read what a check claims
                waiting.cancel()
                return None
    finally:
        if hung_up is not None:
            hung_up.cancel()


async def _hung_up(request: Request) -> None:
    """Returns when the client disconnects (the request has no body left to read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass

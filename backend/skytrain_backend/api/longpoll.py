"""Long-polls: hold a request until there is something to answer, or ``wait_s`` passed.

The answer is always a query's (``check``, run in the thread pool); a notification
(``db.notify``) only says when to run it again. Nothing is held while waiting: no session
transaction, no database connection, no thread. A client that hangs up ends the wait, so
nothing is handed to a request nobody reads any more (a worker's lease above all); what a
check claimed while the client was hanging up is handed back (``release``). A server
shutting down (``Notifier.close_threadsafe``) answers every long-poll at once.

A hostile tenant could still park thousands of long-polls on one job of its own: each event
would wake them all, and their checks would fill the thread pool every other request needs.
So each tenant has at most ``max_waiting_polls`` waiting in a process (``Waiting``; past it, a
request is answered at once, as without ``wait_s``, which every client's loop copes with), and
the checks of waiting requests run under a limiter of their own (``CHECK_THREADS``), not the
pool's.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter
from collections.abc import Callable, Iterator
from typing import TypeVar

import anyio
from starlette.requests import Request

from skytrain_backend.api.admission.rest_admission import parked
from skytrain_backend.db.notify import Notifier
from skytrain_backend.observability import http as observe_http

T = TypeVar("T")

# Set on an answer given at once although the request asked to wait (why, in words).
WAIT_REFUSED_HEADER = "X-Skytrain-Wait-Refused"

# Long-poll checks running at once, per process: a notification waking many long-polls queues
# their checks here instead of taking the threads the routes share.
CHECK_THREADS = 8


class Waiting:
    """Long-polls waiting in this process, per tenant."""

    def __init__(self) -> None:
        self._by_tenant: Counter[str] = Counter()
        self.checks = anyio.CapacityLimiter(CHECK_THREADS)

    @contextlib.contextmanager
    def hold(self, tenant_id: str, *, limit: int) -> Iterator[bool]:
        """Count one long-poll of the tenant's in while the block runs, unless ``limit`` of
        them are waiting already; yields whether it was counted (may wait)."""
        if self._by_tenant[tenant_id] >= limit:
            yield False
            return
        self._by_tenant[tenant_id] += 1
        try:
            yield True
        finally:
            self._by_tenant[tenant_id] -= 1
            if not self._by_tenant[tenant_id]:
                del self._by_tenant[tenant_id]


async def long_poll(
    request: Request,
    notifier: Notifier,
    check: Callable[[], T | None],
    *,
    channel: str,
    key: str | None = None,
    wait_s: float,
    checks: anyio.CapacityLimiter | None = None,
    release: Callable[[T], None] | None = None,
) -> T | None:
    """``check()``'s first answer that is not None, checking again at every notification of
    ``channel`` (and ``key``) and once more when ``wait_s`` runs out; None then. ``check``
    runs in a thread, under ``checks`` when given (else the pool's own limiter). An answer
    found once the client has hung up is given to ``release`` (in a thread) instead."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + wait_s
    hung_up = asyncio.ensure_future(_hung_up(request)) if wait_s > 0 else None
    if wait_s > 0:
        observe_http.mark_long_poll(request.scope)  # its wait is not load, nor its latency
    try:
        while True:
            # Taken before the check: a change committed during it still wakes the wait.
            ticket = notifier.ticket(channel, key)
            notifier.counts[f"checks/{channel}"] += 1
            found = await anyio.to_thread.run_sync(check, limiter=checks)
            if found is not None and release is not None and hung_up is not None and hung_up.done():
                # Claimed for a request nobody reads any more: give it back.
                await anyio.to_thread.run_sync(release, found, limiter=checks)
                return None
            remaining = deadline - loop.time()
            if found is not None or remaining <= 0 or notifier.closing:
                return found
            if hung_up is None or hung_up.done():
                return found
            waiting = asyncio.ensure_future(notifier.wait(ticket, remaining))
            with parked(request.scope):  # no work while it waits: not load on the process
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

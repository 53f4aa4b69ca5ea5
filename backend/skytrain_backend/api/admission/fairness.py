"""Threads shared by tenants, taken in turns: ``FairLimiter``.

The control plane runs its blocking work in threads (the event loop must not block), a few at
a time so that a burst reuses the pool's kept connections. A plain limiter is a queue all
tenants share: a tenant with hundreds of calls waiting (routes of a burst, futures polled,
samples retried, routes resolved) puts every other tenant's call behind them. ``FairLimiter``
lets each key (a tenant, a client address, or an API key before it is known whose) hold at
most ``per_key`` of the ``total`` places, and when a place frees it goes to the waiting key
that holds the fewest (the one that has waited longest among equals): a call of a quiet key
waits for the next place to free, whatever the busy keys' backlog. No place stays free while a
call that may take it waits.

The routes' own threads go through one (``route_turns``, ``SKYTRAIN_THREADS`` places, made in
the app's lifespan): every plain ``def`` endpoint (``api/deps.py``'s ``SessionRoute``) runs in
the turn of the tenant that ``api/admission/rest_admission.py`` admitted (``turn_key``), so eight
tenants bursting at once take the process's threads in turns, and a ninth is served as soon
as a thread frees.
"""

from __future__ import annotations

import asyncio
import contextvars
from collections import deque
from collections.abc import AsyncIterator, Callable, Hashable
from contextlib import asynccontextmanager
from typing import TypeVar

import anyio

T = TypeVar("T")


class FairLimiter:
    """At most ``total`` calls at once, at most ``per_key`` of them one key's, places given to
    the waiting key that holds the fewest; among those, with ``rank``, to the one it ranks
    lowest (what the key holds and waits for elsewhere), then to the one waiting longest."""

    def __init__(
        self,
        *,
        total: int,
        per_key: int,
        rank: Callable[[Hashable], tuple[int, ...]] | None = None,
    ) -> None:
        if not 1 <= per_key <= total:
            raise ValueError(f"per_key={per_key} must be between 1 and total={total}")
        self.total = total
        self._per_key = per_key
        self._rank = rank
        self._threads: anyio.CapacityLimiter | None = None  # made on the event loop
        self._in_use = 0
        self._held: dict[Hashable, int] = {}
        # key -> its calls waiting, in order; keys in the order they began to wait
        self._waiting: dict[Hashable, deque[asyncio.Future[None]]] = {}

    async def run_sync(self, key: Hashable, function: Callable[[], T]) -> T:
        """``function()`` in a thread, in ``key``'s turn."""
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(self.total)
        async with self.turn(key):
            return await anyio.to_thread.run_sync(function, limiter=self._threads)

    @asynccontextmanager
    async def turn(self, key: Hashable) -> AsyncIterator[None]:
        """Hold one of ``key``'s places while the block runs."""
        await self._acquire(key)
        try:
            yield
        finally:
            self._release(key)

    async def _acquire(self, key: Hashable) -> None:
        if self._in_use < self.total and self._may_take(key) and not self._waiting.get(key):
            self._take(key)
            return
        granted: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        self._waiting.setdefault(key, deque()).append(granted)
        try:
            await granted
        except BaseException:
            if granted.done() and not granted.cancelled():
                self._release(key)  # given a place as it was cancelled: hand it on
            else:
                waiting = self._waiting.get(key)
                if waiting is not None and granted in waiting:
                    waiting.remove(granted)
                    if not waiting:
                        del self._waiting[key]
            raise

    def _may_take(self, key: Hashable) -> bool:
        return self._held.get(key, 0) < self._per_key

    def _order(self, key: Hashable) -> tuple[int, ...]:
        return self._held.get(key, 0), *(self._rank(key) if self._rank is not None else ())

    def _take(self, key: Hashable) -> None:
        self._in_use += 1
        self._held[key] = self._held.get(key, 0) + 1

    def _release(self, key: Hashable) -> None:
        self._in_use -= 1
        held = self._held[key] - 1
        if held:
            self._held[key] = held
        else:
            del self._held[key]
        self._hand_on()

    def _hand_on(self) -> None:
        while self._in_use < self.total:
            candidates = [key for key in self._waiting if self._may_take(key)]
            if not candidates:
                return
            key = min(candidates, key=self._order)
            waiting = self._waiting.pop(key)
            granted = waiting.popleft()
            if waiting:
                self._waiting[key] = waiting  # to the back of the keys' order
            self._take(key)
            granted.set_result(None)


# The routes' turns, and the key of the request being handled (its tenant, or its worker
# token's hash), both set by admission; None: not admitted (a plain thread hop).
route_turns: contextvars.ContextVar[FairLimiter | None] = contextvars.ContextVar(
    "skytrain_route_turns", default=None
)
turn_key: contextvars.ContextVar[Hashable] = contextvars.ContextVar(
    "skytrain_turn_key", default=None
)

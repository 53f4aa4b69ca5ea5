"""Threads shared by tenants, taken in turns: ``FairLimiter``.

The control plane runs its database lookups in threads (the event loop must not block), a few
at a time so that a burst reuses the pool's kept connections. A plain limiter is a queue all
tenants share: a tenant with hundreds of lookups waiting (futures polled, samples retried,
routes resolved) puts every other tenant's lookup behind them. ``FairLimiter`` lets each key
(a tenant, or an API key before it is known whose) hold at most ``per_key`` of the ``total``
threads and queue at most that many for them; its other calls wait on a queue of their own.
anyio's limiters hand out places first come, first served, so a call of a quiet key waits for
at most one turn of each busy key, whatever their backlog.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable
from typing import TypeVar

import anyio

T = TypeVar("T")


class FairLimiter:
    """At most ``total`` calls in threads at once, at most ``per_key`` of them one key's."""

    def __init__(self, *, total: int, per_key: int) -> None:
        if not 1 <= per_key <= total:
            raise ValueError(f"per_key={per_key} must be between 1 and total={total}")
        self.total = anyio.CapacityLimiter(total)
        self._per_key = per_key
        # key -> (its limiter, the calls holding or waiting for it)
        self._keys: dict[Hashable, tuple[anyio.CapacityLimiter, int]] = {}

    async def run_sync(self, key: Hashable, function: Callable[[], T]) -> T:
        """``function()`` in a thread, in ``key``'s turn."""
        limiter, users = self._keys.get(key) or (anyio.CapacityLimiter(self._per_key), 0)
        self._keys[key] = (limiter, users + 1)
        try:
            async with limiter:
                return await anyio.to_thread.run_sync(function, limiter=self.total)
        finally:
            limiter, users = self._keys[key]
            if users == 1:
                del self._keys[key]
            else:
                self._keys[key] = (limiter, users - 1)

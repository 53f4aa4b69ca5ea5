"""API keys and worker tokens checked: cached for a moment, looked up in threads of their own,
failures rate-limited per client address.

Every REST, Tinker and worker request authenticates its key or token
(``api/admission/rest_admission.py``) and under a burst that lookup was a query per request. The
answer changes only when a key, a tenant or a worker row does, so a success is kept per hash for
``SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S`` (1 s) in a ``RouteCache``, which any commit in this process
that changes a key, a tenant or a worker empties at once: a key revoked here is refused at once, one
revoked through another process (another replica, ``skytrain keys revoke``) within the TTL, as the
gateway's routes are.

Failures cost their sender, not the other tenants:

- a key or token that failed is kept as refused for ``SKYTRAIN_AUTH_FAILURE_CACHE_TTL_S``
  (``MAX_REMEMBERED`` hashes at most, the oldest forgotten first; emptied with the successes'
  cache): sending it again costs no query;
- each client address (an IPv6 one by its /64: ``rest_admission.client_address``) may fail
  ``SKYTRAIN_AUTH_FAILURES_PER_MINUTE`` authentications a minute (a token bucket: all at once,
  then one every 60/N s); past that, whatever it sends that is not a key known good gets 429
  with ``Retry-After`` and no lookup. Only a lookup that fails (or a key refused a moment ago)
  takes a token, so many tenants behind one NAT or proxy whose keys are good are never refused
  for it; an address's lookups in flight are bounded by the tokens it has left (a burst of
  random keys runs as many lookups as it may fail, the rest get 429);
- lookups run on threads of their own (``AUTH_THREADS``), never the routes' pool, each in a
  short session closed in that thread, shared by client address in turns (``FairLimiter``): an
  address sending thousands of random keys holds at most ``AUTH_THREADS_PER_ADDRESS`` of them,
  and another address's lookup waits for at most one turn of it.

Requests with the same key that miss the cache together wait for one lookup: a burst costs one
query per TTL, not one per request.
"""

from __future__ import annotations

import asyncio
import hashlib
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any, TypeVar

from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.route_cache import RouteCache
from skytrain_backend.db import api_keys, workers
from skytrain_backend.db.models import Tenant
from skytrain_backend.errors import AuthenticationFailed, RateLimited

# Threads (and so database connections) key and token lookups use at most, per process, and
# how many of them one client address may hold at once.
AUTH_THREADS = 4
AUTH_THREADS_PER_ADDRESS = 2
# Refused hashes, and client addresses' failure budgets, kept at most (each).
MAX_REMEMBERED = 10_000
# The name of the failures' limit, in a 429 and the metrics.
FAILURES_LIMIT = "auth_failures_per_minute"

NO_KEY = (
    "no API key: send the header 'Authorization: Bearer sk-st-...' "
    "(create a key with `skytrain keys create --tenant NAME`)"
)

T = TypeVar("T")


def authenticate(session: Session, credentials: HTTPAuthorizationCredentials | None) -> Tenant:
    """The tenant of the bearer key, looked up in ``session`` (the gateway's resolution,
    which authenticates in the session it routes with)."""
    if credentials is None:
        raise AuthenticationFailed(NO_KEY)
    return api_keys.authenticate(session, key=credentials.credentials)


class FailureBudget:
    """Failed authentications per client address: ``per_minute`` a minute, as a token bucket
    (the most recently failing ``MAX_REMEMBERED`` addresses are tracked).

    Only a lookup that fails takes a token. So that a burst of unknown keys cannot start more
    lookups than its address may fail, an address's lookups in flight are bounded by the
    tokens it has left (``attempt``): past them a lookup waits for one of its address's to end
    (a success gives its place on, a failure spends it), and gets 429 once none is left.
    """

    def __init__(self, *, per_minute: int) -> None:
        self.per_minute = per_minute
        self._refill_per_s = per_minute / 60
        # address -> (failures left, when counted)
        self._left: OrderedDict[str, tuple[float, float]] = OrderedDict()
        # address -> its lookups in flight; the event set when one of them ends
        self._in_flight: dict[str, int] = {}
        self._ended: dict[str, asyncio.Event] = {}

    def _now_left(self, address: str, now: float) -> float:
        held = self._left.get(address)
        if held is None:
            return float(self.per_minute)
        left, at = held
        return min(float(self.per_minute), left + (now - at) * self._refill_per_s)

    def _check(self, address: str, left: float) -> None:
        if left < 1:
            raise RateLimited(
                f"too many failed authentications from your address (at most "
                f"{self.per_minute} a minute: SKYTRAIN_AUTH_FAILURES_PER_MINUTE): check the key "
                "or token you send, and retry after the time in Retry-After",
                retry_after_s=(1 - left) / self._refill_per_s,
                limit=FAILURES_LIMIT,
            )

    def take(self, address: str | None) -> None:
        """Count a failure of ``address`` that needed no lookup (a key refused a moment
        ago); ``RateLimited`` if it has none left."""
        if address is None:
            return
        now = time.monotonic()
        left = self._now_left(address, now)
        self._check(address, left)
        self._set(address, left - 1, now)

    @asynccontextmanager
    async def attempt(self, address: str | None) -> AsyncIterator[Callable[[], None]]:
        """Hold a place for one lookup of ``address``'s while the block runs; the block calls
        what it is given if the lookup failed. ``RateLimited`` if the address has no failures
        left."""
        if address is None:
            yield lambda: None
            return
        while True:
            left = self._now_left(address, time.monotonic())
            self._check(address, left)
            in_flight = self._in_flight.get(address, 0)
            if in_flight + 1 <= left:
                break
            # Were all in flight to fail, this one could not: wait for one to end.
            await self._ended.setdefault(address, asyncio.Event()).wait()
        self._in_flight[address] = in_flight + 1
        failed = False

        def fail() -> None:
            nonlocal failed
            failed = True

        try:
            yield fail
        finally:
            still = self._in_flight.pop(address) - 1
            if still:
                self._in_flight[address] = still
            if failed:
                now = time.monotonic()
                self._set(address, self._now_left(address, now) - 1, now)
            ended = self._ended.pop(address, None)
            if ended is not None:
                ended.set()

    def _set(self, address: str, left: float, now: float) -> None:
        self._left[address] = (min(float(self.per_minute), left), now)
        self._left.move_to_end(address)
        while len(self._left) > MAX_REMEMBERED:
            self._left.popitem(last=False)


class _Refused:
    """Hashes that failed a moment ago: kept ``ttl_s``, forgotten when ``cache`` (the
    successes') is emptied by a change, ``MAX_REMEMBERED`` at most."""

    def __init__(self, *, ttl_s: float, cache: RouteCache[Any]) -> None:
        self._ttl_s = ttl_s
        self._cache = cache
        # hash -> (expires, the successes' cache generation when it failed, the refusal)
        self._held: OrderedDict[object, tuple[float, int, str]] = OrderedDict()

    def get(self, digest: object) -> str | None:
        held = self._held.get(digest)
        if held is None:
            return None
        expires, generation, message = held
        if time.monotonic() >= expires or generation != self._cache.generation:
            del self._held[digest]
            return None
        return message

    def put(self, digest: object, message: str, *, generation: int) -> None:
        if self._ttl_s <= 0:
            return
        self._held[digest] = (time.monotonic() + self._ttl_s, generation, message)
        self._held.move_to_end(digest)
        while len(self._held) > MAX_REMEMBERED:
            self._held.popitem(last=False)


class Authenticator:
    """The tenant of an API key, as ``db.api_keys.authenticate`` finds it (a detached row whose
    columns are loaded: routes read them, none writes them); whether a worker token may call a
    worker route, as ``db.workers.check_worker_token`` says."""

    def __init__(
        self,
        *,
        sessions: sessionmaker[Session],
        ttl_s: float,
        failure_ttl_s: float,
        failures_per_minute: int,
    ) -> None:
        self._sessions = sessions
        self._tenants: RouteCache[Tenant] = RouteCache(ttl_s=ttl_s)
        self._tokens: RouteCache[bool] = RouteCache(ttl_s=ttl_s)
        self._refused_keys = _Refused(ttl_s=failure_ttl_s, cache=self._tenants)
        self._refused_tokens = _Refused(ttl_s=failure_ttl_s, cache=self._tokens)
        self.failures = FailureBudget(per_minute=failures_per_minute)
        self._looking_up: dict[object, asyncio.Event] = {}
        self._threads: FairLimiter | None = None

    async def tenant(self, key: str, *, client: str | None = None) -> Tenant:
        """The key's tenant; ``AuthenticationFailed`` if the key is unknown or revoked,
        ``RateLimited`` if ``client`` (the sender's address) has failed too often."""
        digest = hashlib.sha256(key.encode()).digest()

        def look_up() -> Tenant:
            with self._sessions() as session:
                return api_keys.authenticate(session, key=key)

        return await self._checked(
            digest, look_up, cache=self._tenants, refused=self._refused_keys, client=client
        )

    async def check_worker_token(self, token: str, path: str, *, client: str | None = None) -> None:
        """Return if ``token`` may call the worker route at ``path``; ``AuthenticationFailed``
        saying why not, or ``RateLimited`` as ``tenant``."""
        join_path = path.endswith(workers.JOIN_TOKEN_PATHS)
        digest = (hashlib.sha256(token.encode()).digest(), join_path)

        def look_up() -> bool:
            with self._sessions() as session:
                workers.check_worker_token(session, token=token, path=path)
            return True

        await self._checked(
            digest, look_up, cache=self._tokens, refused=self._refused_tokens, client=client
        )

    async def _checked(
        self,
        digest: object,
        look_up: Callable[[], T],
        *,
        cache: RouteCache[T],
        refused: _Refused,
        client: str | None,
    ) -> T:
        while (cached := cache.get(digest)) is None:
            pending = self._looking_up.get(digest)
            if pending is None:
                break
            # Found and cached when it is set, unless it failed: then we look again ourselves.
            await pending.wait()
        if cached is not None:
            return cached
        message = refused.get(digest)
        if message is not None:
            self.failures.take(client)  # a failure still, though it costs no lookup
            raise AuthenticationFailed(message)
        done = asyncio.Event()
        self._looking_up[digest] = done
        try:
            async with self.failures.attempt(client) as failed:
                generation = cache.generation
                if self._threads is None:
                    self._threads = FairLimiter(
                        total=AUTH_THREADS, per_key=AUTH_THREADS_PER_ADDRESS
                    )
                try:
                    found = await self._threads.run_sync(client, look_up)
                except AuthenticationFailed as exc:
                    failed()
                    refused.put(digest, exc.message, generation=generation)
                    raise
            cache.put(digest, found, generation=generation)
            return found
        finally:
            del self._looking_up[digest]
            done.set()

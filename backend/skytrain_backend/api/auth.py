"""API keys resolved to their tenant: cached for a moment, looked up in threads of their own.

Every REST and Tinker request authenticates its key, and under a burst that lookup was a
query per request on the threads every route shares. The answer changes only when a key or a
tenant row does, so it is kept per key hash for ``SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S`` (1 s)
in a ``RouteCache``, which any commit in this process that changes a key or a tenant empties
at once: a key revoked here is refused at once, one revoked through another process (another
replica, ``skytrain keys revoke``) within the TTL, as the gateway's routes are. A refusal is
not kept.

Lookups run on threads of their own (``AUTH_THREADS``), each in a short session closed in
that thread, so authenticating neither waits behind the routes' work nor holds a database
connection once it has answered. Requests with the same key that miss the cache together
wait for one lookup: a burst costs one query per TTL, not one per request.
"""

from __future__ import annotations

import asyncio
import hashlib

import anyio
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.route_cache import RouteCache
from skytrain_backend.db import api_keys
from skytrain_backend.db.models import Tenant
from skytrain_backend.errors import AuthenticationFailed

# Threads (and so database connections) key lookups use at most, per process.
AUTH_THREADS = 4

NO_KEY = (
    "no API key: send the header 'Authorization: Bearer sk-st-...' "
    "(create a key with `skytrain keys create --tenant NAME`)"
)


def authenticate(session: Session, credentials: HTTPAuthorizationCredentials | None) -> Tenant:
    """The tenant of the bearer key, looked up in ``session`` (the gateway's resolution,
    which authenticates in the session it routes with)."""
    if credentials is None:
        raise AuthenticationFailed(NO_KEY)
    return api_keys.authenticate(session, key=credentials.credentials)


class Authenticator:
    """The tenant of an API key, as ``db.api_keys.authenticate`` finds it (a detached row whose
    columns are loaded: routes read them, none writes them)."""

    def __init__(self, *, sessions: sessionmaker[Session], ttl_s: float) -> None:
        self._sessions = sessions
        self._tenants: RouteCache[Tenant] = RouteCache(ttl_s=ttl_s)
        self._looking_up: dict[bytes, asyncio.Event] = {}
        self._threads: anyio.CapacityLimiter | None = None

    async def tenant(self, key: str) -> Tenant:
        """The key's tenant; ``AuthenticationFailed`` if the key is unknown or revoked."""
        digest = hashlib.sha256(key.encode()).digest()
        while (cached := self._tenants.get(digest)) is None:
            pending = self._looking_up.get(digest)
            if pending is None:
                break
            # Found and cached when it is set, unless it failed: then we look it up ourselves.
            await pending.wait()
        if cached is not None:
            return cached
        done = asyncio.Event()
        self._looking_up[digest] = done
        try:
            return await self._look_up(key, digest)
        finally:
            del self._looking_up[digest]
            done.set()

    async def _look_up(self, key: str, digest: bytes) -> Tenant:
        if self._threads is None:
            self._threads = anyio.CapacityLimiter(AUTH_THREADS)
        generation = self._tenants.generation

        def look_up() -> Tenant:
            with self._sessions() as session:
                return api_keys.authenticate(session, key=key)

        tenant = await anyio.to_thread.run_sync(look_up, limiter=self._threads)
        self._tenants.put(digest, tenant, generation=generation)
        return tenant

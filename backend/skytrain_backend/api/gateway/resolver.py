"""Where a gateway request goes: its key's tenant, the model, its step and the worker.

A request names one of the tenant's models (``scheduler.routing`` finds the worker engine
serving that checkpoint, or says why none does yet: 404, or 503 with ``Retry-After``); a
checkpoint being loaded onto its worker is waited for, up to
``SKYTRAIN_GATEWAY_LOADING_WAIT_S``.

Resolving a request is done once per key and model name per
``SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S`` (1 s), and at once again after any commit in this
process that changes one of those rows (``api/route_cache.py``): a step committed, a model
deleted, a worker gone. Through another control plane on the same database such a change is
seen within that TTL. The activity marks a resolution writes (``scheduler.routing``) are thus
written at most once per row per 30 s, by at most one request per TTL.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import anyio
from fastapi.security import HTTPAuthorizationCredentials
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission.auth import authenticate
from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.gateway import admission
from skytrain_backend.api.gateway.admission import Endpoint
from skytrain_backend.api.route_cache import RouteCache
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant
from skytrain_backend.db.tenant_loads import Load
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest, Unavailable
from skytrain_backend.scheduler.routing import EngineRoute, resolve_route

# How often a request waiting for its checkpoint to load looks again.
LOADING_POLL_S = 0.25

# Bodies up to this size are parsed on the event loop when their route is cached (no thread
# hop); larger ones, in a thread.
INLINE_PARSE_BYTES = 64 * 1024

# Requests resolved in threads at once: fewer than the database pool's 5 kept connections, so
# a burst reuses them instead of opening (and configuring) a connection per request. One API
# key (or tenant) holds at most RESOLVE_PER_KEY of them: its backlog queues on its own
# (``api/admission/fairness.py``), never in front of another tenant's requests.
RESOLVE_CONCURRENCY = 4
RESOLVE_PER_KEY = 2

T = TypeVar("T")


@dataclass(frozen=True)
class Routed:
    """A request ready to go: whose it is, its body, what it costs and where it goes."""

    tenant_id: str
    limits: TenantLimits
    body: dict[str, Any]
    cost: Load
    route: EngineRoute


@dataclass(frozen=True)
class _Resolved:
    """What a key and a model name resolve to: the route cache's values."""

    tenant_id: str
    limits: TenantLimits
    route: EngineRoute


class Resolver:
    """Resolves requests to routes, in threads (``RESOLVE_CONCURRENCY``, fair between keys),
    through the route cache."""

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        on_unplaced: Callable[[], None],
    ) -> None:
        self.settings = settings
        self._sessions = sessions
        # Called when a request names a model that no worker holds: wakes the scheduler.
        self._on_unplaced = on_unplaced
        self.limiter = FairLimiter(total=RESOLVE_CONCURRENCY, per_key=RESOLVE_PER_KEY)
        # (sha256 of the key, model as sent) -> _Resolved; see api/route_cache.py.
        self.routes: RouteCache[_Resolved] = RouteCache(ttl_s=settings.gateway.route_cache_ttl_s)
        self._resolving: dict[tuple[bytes, str], asyncio.Event] = {}

    async def route(
        self, *, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> Routed:
        """Where the request goes; a checkpoint being loaded onto its worker is waited for.

        A route resolved a moment ago for the same key and model is reused (the route
        cache); otherwise it is resolved in a thread. Loading takes seconds (the worker
        fetches the adapter at its next heartbeat), less than most clients' retry budget:
        holding the request spares them a 503 round trip.
        """
        cached, flight = self._cached(credentials, raw, endpoint)
        if cached is not None:
            return cached
        # One resolution per key and model at a time: when a route's entry expires under
        # load, the requests that find it missing wait for the first one's answer.
        waiting = self._resolving.get(flight) if flight is not None else None
        if waiting is not None:
            await waiting.wait()
            cached, _ = self._cached(credentials, raw, endpoint)
            if cached is not None:
                return cached
        done = asyncio.Event()
        if flight is not None and flight not in self._resolving:
            self._resolving[flight] = done
        try:
            key = _key_digest(credentials) if credentials is not None else b""
            return await self._waiting_for_load(
                key, functools.partial(self._resolve, credentials, raw, endpoint)
            )
        finally:
            if flight is not None and self._resolving.get(flight) is done:
                del self._resolving[flight]
            done.set()

    async def route_of_tenant(self, *, tenant_id: str, model: str) -> EngineRoute:
        """The route to the tenant's ``model`` (not cached: the Tinker protocol's samples,
        whose tenant is known), a checkpoint being loaded waited for."""

        def resolve() -> EngineRoute:
            with self._sessions() as session:
                limits = tenants.limits_of(session.get_one(Tenant, tenant_id), self.settings)
                return resolve_route(
                    session,
                    tenant_id=tenant_id,
                    model=model,
                    idle_timeout_s=self.settings.scheduler.resolved_model_idle_timeout_s,
                    limits=limits,
                    max_workers=self.settings.scheduler.launched_workers_limit,
                    on_unplaced=self._on_unplaced,
                )

        return await self._waiting_for_load(tenant_id, resolve)

    async def _waiting_for_load(self, key: Any, resolve: Callable[[], T]) -> T:
        deadline = time.monotonic() + self.settings.gateway.loading_wait_s
        while True:
            try:
                return await self.limiter.run_sync(key, resolve)
            except Unavailable as exc:
                if exc.state != "loading" or time.monotonic() >= deadline:
                    raise
            await anyio.sleep(LOADING_POLL_S)

    def _cached(
        self, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> tuple[Routed | None, tuple[bytes, str] | None]:
        """The request routed from the cache, or None (not cached, or a body the full path
        should judge: an error must come after the key is checked); and the cache's key for
        it, when the body could be read here."""
        if credentials is None or len(raw) > INLINE_PARSE_BYTES:
            return None, None
        try:
            body = admission.parse_body(raw, endpoint)
        except InvalidRequest:
            return None, None
        key = (_key_digest(credentials), body["model"])
        resolved = self.routes.get(key)
        if resolved is None:
            return None, key
        cost = admission.cost(
            body, size=len(raw), default_max_tokens=self.settings.gateway.default_max_tokens
        )
        admission.check_fits(resolved.limits, cost)
        routed = Routed(
            tenant_id=resolved.tenant_id,
            limits=resolved.limits,
            body=body,
            cost=cost,
            route=resolved.route,
        )
        return routed, key

    def _resolve(
        self, credentials: HTTPAuthorizationCredentials | None, raw: bytes, endpoint: Endpoint
    ) -> Routed:
        """Authenticate, parse and route in one session, held only for these few queries (a
        connection held across the request would starve the pool under concurrent streams)."""
        generation = self.routes.generation
        with self._sessions() as session:
            tenant = authenticate(session, credentials)
            tenant_id, limits = tenant.id, tenants.limits_of(tenant, self.settings)
            body = admission.parse_body(raw, endpoint)
            cost = admission.cost(
                body, size=len(raw), default_max_tokens=self.settings.gateway.default_max_tokens
            )
            admission.check_fits(limits, cost)
            route = resolve_route(
                session,
                tenant_id=tenant_id,
                model=body["model"],
                idle_timeout_s=self.settings.scheduler.resolved_model_idle_timeout_s,
                limits=limits,
                max_workers=self.settings.scheduler.launched_workers_limit,
                on_unplaced=self._on_unplaced,
            )
        assert credentials is not None  # authenticate refuses a request without a key
        self.routes.put(
            (_key_digest(credentials), body["model"]),
            _Resolved(tenant_id=tenant_id, limits=limits, route=route),
            generation=generation,
        )
        return Routed(tenant_id=tenant_id, limits=limits, body=body, cost=cost, route=route)


def _key_digest(credentials: HTTPAuthorizationCredentials) -> bytes:
    return hashlib.sha256(credentials.credentials.encode()).digest()

"""Admission: every request but inference is authenticated and counted against its sender's
requests in flight before routing, weighted by its body; past the cap, 429.

One ASGI middleware, before FastAPI routes anything, for every route family:

- ``/v1`` and ``/v1/preview`` (a bearer key) and ``/api/v1``, the Tinker protocol (the key as
  the official ``tinker`` SDK sends it, ``X-API-Key: tml-<key>``, or a bearer key): counted
  against the tenant's ``max_concurrent_rest_requests`` (``api/admission/tenant_load.py``: across
  every control-plane process on a PostgreSQL database);
- ``/v1/worker/...`` (a worker token, required: 401 without one, before the body is read):
  counted per token against ``SKYTRAIN_WORKER_MAX_CONCURRENT_REQUESTS`` in this process.

Inference (``/v1/chat/completions``, ``/v1/completions``) is admitted by the gateway itself;
its key is checked here too, so that failures there are limited as everywhere.

A request counts as one, plus one per started ``SKYTRAIN_REST_ADMISSION_BYTES_PER_REQUEST``
(1 MiB) of the body it declares (``Content-Length``; a body sent in chunks counts as the
largest allowed, ``SKYTRAIN_MAX_REQUEST_BYTES``), at most the whole cap, so a request fits when
its sender has nothing else in flight: eight 60 MB bodies at once are one in memory and seven
refusals, refused before their bodies are read. A checkpoint upload from a worker counts as one
(the route streams it to the object store). Past the cap a request waits (holding nothing, in
order of arrival) up to ``SKYTRAIN_REST_ADMISSION_WAIT_S``, then gets 429 with ``Retry-After``,
for a fraction of the CPU that routing and solving the route's dependencies cost: a hostile
burst's requests are mostly refusals, and they share the event loop with every other tenant's
requests. The request counts until the app has answered it (a long-poll counts while it
waits). Keys and tokens are checked by ``api/admission/auth.py`` (cached; failures rate-limited per
client address, off the routes' threads); an address past its failures gets its 429 after
the same wait, so a client that ignores Retry-After costs a request per wait and loop. The
admitted request's plain ``def`` route takes its thread in its tenant's turn
(``api/admission/fairness.py``).

``TenantDep`` and ``TinkerTenantDep`` take the tenant from here (``admitted``); they
authenticate and admit a request themselves where this middleware did not (a request without
a key is refused there, with the message of its protocol).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import ipaddress
from collections.abc import Callable, Iterator

import anyio
from starlette.types import ASGIApp, Receive, Scope, Send

from skytrain_backend.api.admission import fairness
from skytrain_backend.api.admission.auth import FAILURES_LIMIT, Authenticator
from skytrain_backend.api.admission.limits import CHECKPOINT_UPLOAD, INFERENCE_PATH, WORKER_PREFIX
from skytrain_backend.api.admission.tenant_load import (
    REST_REQUEST,
    Admitted,
    TenantLoads,
    rest_cost,
)
from skytrain_backend.api.errors import skytrain_error_response
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant
from skytrain_backend.errors import AuthenticationFailed, RateLimited, SkytrainError

_ADMITTED = "skytrain.admitted_tenant"
_ADMISSION = "skytrain.admission"
TINKER_PREFIX = "/api/v1/"
# The Tinker SDK's keys are "tml-" + a skytrain key, sent as X-API-Key.
TINKER_KEY_PREFIX = "tml-"
NO_WORKER_TOKEN = "no worker token: send 'Authorization: Bearer swt-...'"


def admitted(scope: Scope) -> Tenant | None:
    """The tenant this middleware admitted the request for, if it did."""
    tenant: Tenant | None = scope.get(_ADMITTED)
    return tenant


@contextlib.contextmanager
def parked(scope: Scope) -> Iterator[None]:
    """While the block runs, the request ``scope`` belongs to waits with nothing to do (a
    long-poll between its checks): it does not count against its process's shared places
    (``TenantLoads``), only against its tenant's own limit."""
    admission: Admitted | None = scope.get(_ADMISSION)
    if admission is None:
        yield
        return
    admission.park(True)
    try:
        yield
    finally:
        admission.park(False)


def client_address(scope: Scope) -> str | None:
    """The sender's address as failures are counted: an IPv4 address (an IPv4-mapped IPv6
    one as IPv4), or an IPv6 address's /64, the least a host or a site is given: one sender
    with a whole /64 would otherwise fail from 2^64 addresses."""
    client = scope.get("client")
    if not client:
        return None
    try:
        address = ipaddress.ip_address(client[0])
    except ValueError:
        return str(client[0])  # not an IP address (a Unix socket's peer): as it is
    if isinstance(address, ipaddress.IPv6Address):
        if address.ipv4_mapped is not None:
            return str(address.ipv4_mapped)
        return str(ipaddress.IPv6Network((address, 64), strict=False))
    return str(address)


async def admit(
    key: str,
    *,
    authenticator: Authenticator,
    loads: TenantLoads,
    settings: Settings,
    body_bytes: int = 0,
    client: str | None = None,
) -> tuple[Tenant, Admitted]:
    """The key's tenant, one REST request of its (weighted by ``body_bytes``) counted in; and
    what counts it out. ``AuthenticationFailed`` or ``RateLimited`` otherwise."""
    tenant = await authenticator.tenant(key, client=client)
    limits = tenants.limits_of(tenant, settings)
    cost = rest_cost(
        body_bytes,
        bytes_per_request=settings.admission.rest_admission_bytes_per_request,
        limit=limits.max_concurrent_rest_requests,
    )
    release = await loads.admit(
        tenant.id, limits=limits, cost=cost, wait_s=settings.admission.rest_admission_wait_s
    )
    return tenant, release


class RestAdmission:
    """The middleware above; the authenticator and the counters are the app's
    (``app.state.authenticator``, ``app.state.rest_loads``, ``app.state.worker_loads``), made
    in its lifespan."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings
        self.worker_limits = dataclasses.replace(
            tenants.TenantLimits.defaults(settings),
            max_concurrent_rest_requests=settings.admission.worker_max_concurrent_requests,
        )

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path: str = scope["path"]
        release: Callable[[], None] | None
        fairness.route_turns.set(scope["app"].state.route_turns)
        try:
            if path.startswith(WORKER_PREFIX):
                release = await self._admit_worker(scope)
            else:
                release = await self._admit_tenant(scope)
        except SkytrainError as exc:
            if isinstance(exc, RateLimited) and exc.limit == FAILURES_LIMIT:
                # An address past its failures waits, as a tenant past its cap does: a client
                # that ignores Retry-After sends a request per wait and loop, not per answer.
                await anyio.sleep(self.settings.admission.rest_admission_wait_s)
            response = skytrain_error_response(exc)
            if isinstance(exc, AuthenticationFailed):
                response.headers["WWW-Authenticate"] = "Bearer"
            await response(scope, receive, send)
            return
        try:
            await self.app(scope, receive, send)
        finally:
            if release is not None:
                release()

    async def _admit_tenant(self, scope: Scope) -> Callable[[], None] | None:
        path: str = scope["path"]
        if path.startswith(TINKER_PREFIX):
            key = _header(scope, b"x-api-key") or _bearer_key(scope)
            key = key.removeprefix(TINKER_KEY_PREFIX) if key else None
        elif path.startswith("/v1/"):
            key = _bearer_key(scope)
        else:
            return None
        if not key:
            return None  # the route's dependency refuses it, in its protocol's words
        state = scope["app"].state
        if INFERENCE_PATH.match(path) is not None:
            # The gateway admits inference itself; a key that fails is refused here, counted
            # against its address's failures, as on every other route.
            await state.authenticator.tenant(key, client=client_address(scope))
            return None
        tenant, release = await admit(
            key,
            authenticator=state.authenticator,
            loads=state.rest_loads,
            settings=self.settings,
            body_bytes=self._body_bytes(scope),
            client=client_address(scope),
        )
        scope[_ADMITTED] = tenant
        scope[_ADMISSION] = release
        fairness.turn_key.set(tenant.id)
        return release

    async def _admit_worker(self, scope: Scope) -> Callable[[], None]:
        token = _bearer_key(scope)
        if not token:
            raise AuthenticationFailed(NO_WORKER_TOKEN)
        authenticator: Authenticator = scope["app"].state.authenticator
        await authenticator.check_worker_token(token, scope["path"], client=client_address(scope))
        upload = scope["method"] == "PUT" and CHECKPOINT_UPLOAD.match(scope["path"])
        cost = (
            REST_REQUEST
            if upload
            else rest_cost(
                self._body_bytes(scope),
                bytes_per_request=self.settings.admission.rest_admission_bytes_per_request,
                limit=self.settings.admission.worker_max_concurrent_requests,
            )
        )
        loads: TenantLoads = scope["app"].state.worker_loads
        holder = "worker:" + hashlib.sha256(token.encode()).hexdigest()
        fairness.turn_key.set(holder)
        try:
            return await loads.admit(
                holder,
                limits=self.worker_limits,
                cost=cost,
                wait_s=self.settings.admission.rest_admission_wait_s,
            )
        except RateLimited as exc:
            raise RateLimited(
                f"this worker token's requests in flight are at the "
                f"{self.settings.admission.worker_max_concurrent_requests} allowed at once "
                "(SKYTRAIN_WORKER_MAX_CONCURRENT_REQUESTS; a request counts one more per "
                "started SKYTRAIN_REST_ADMISSION_BYTES_PER_REQUEST of its body): wait for some "
                "to finish",
                retry_after_s=exc.retry_after_s,
                limit="worker_max_concurrent_requests",
            ) from None

    def _body_bytes(self, scope: Scope) -> int:
        """The body's size as declared; a body sent in chunks as the largest allowed."""
        declared = _header(scope, b"content-length")
        if declared is not None and declared.isdigit():
            return int(declared)
        if _header(scope, b"transfer-encoding") is not None:
            return self.settings.server.max_request_bytes
        return 0


def _header(scope: Scope, name: bytes) -> str | None:
    for header, value in scope["headers"]:
        if header == name:
            return str(value.decode("latin-1")).strip()
    return None


def _bearer_key(scope: Scope) -> str | None:
    value = _header(scope, b"authorization")
    if value is None:
        return None
    scheme, _, key = value.partition(" ")
    if scheme.lower() == "bearer" and key.strip():
        return key.strip()
    return None

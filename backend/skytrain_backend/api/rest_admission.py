"""REST admission: a tenant's REST requests in flight are capped, and refused before routing.

Every request under ``/v1`` but the workers' routes and inference (which the gateway admits
itself) that carries a bearer key is authenticated (``api/auth.py``: cached) and counted in
against its tenant's ``max_concurrent_rest_requests`` (``api/tenant_load.py``: across every
control-plane process on a PostgreSQL database) by this ASGI middleware, before FastAPI
routes it. Past the cap the answer is 429 with ``Retry-After``, given for a fraction of the
CPU that routing and solving the route's dependencies cost: a hostile burst's requests are
mostly refusals, and they share the event loop with every other tenant's requests. The
request counts until the app has answered it (a long-poll counts while it waits).
``TenantDep`` takes the tenant from here (``admitted``); it authenticates and admits a request
itself where this middleware did not (a request without a key is refused there).
"""

from __future__ import annotations

from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send

from skytrain_backend.api.auth import Authenticator
from skytrain_backend.api.errors import skytrain_error_response
from skytrain_backend.api.limits import INFERENCE_PATH, WORKER_PREFIX
from skytrain_backend.api.tenant_load import REST_REQUEST, TenantLoads
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Tenant
from skytrain_backend.errors import SkytrainError

_ADMITTED = "skytrain.admitted_tenant"


def admitted(scope: Scope) -> Tenant | None:
    """The tenant this middleware admitted the request for, if it did."""
    tenant: Tenant | None = scope.get(_ADMITTED)
    return tenant


async def admit(
    key: str, *, authenticator: Authenticator, loads: TenantLoads, settings: Settings
) -> tuple[Tenant, Callable[[], None]]:
    """The key's tenant, one REST request of its counted in; and the function that counts it
    out. ``AuthenticationFailed`` or ``RateLimited`` otherwise."""
    tenant = await authenticator.tenant(key)
    limits = tenants.limits_of(tenant, settings)
    release = await loads.admit(
        tenant.id, limits=limits, cost=REST_REQUEST, wait_s=settings.rest_admission_wait_s
    )
    return tenant, release


class RestAdmission:
    """The middleware above; the authenticator and the counter are the app's
    (``app.state.authenticator``, ``app.state.rest_loads``), made in its lifespan."""

    def __init__(self, app: ASGIApp, *, settings: Settings) -> None:
        self.app = app
        self.settings = settings

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        key = _bearer_key(scope) if scope["type"] == "http" and _is_rest(scope["path"]) else None
        if key is None:
            await self.app(scope, receive, send)
            return
        state = scope["app"].state
        try:
            tenant, release = await admit(
                key,
                authenticator=state.authenticator,
                loads=state.rest_loads,
                settings=self.settings,
            )
        except SkytrainError as exc:
            await skytrain_error_response(exc)(scope, receive, send)
            return
        scope[_ADMITTED] = tenant
        try:
            await self.app(scope, receive, send)
        finally:
            release()


def _is_rest(path: str) -> bool:
    return (
        path.startswith("/v1/")
        and not path.startswith(WORKER_PREFIX)
        and INFERENCE_PATH.match(path) is None
    )


def _bearer_key(scope: Scope) -> str | None:
    for name, value in scope["headers"]:
        if name == b"authorization":
            scheme, _, key = value.decode("latin-1").partition(" ")
            if scheme.lower() == "bearer" and key.strip():
                return key.strip()
            return None
    return None

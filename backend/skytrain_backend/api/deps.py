"""Dependencies every route declares through these ``Annotated`` aliases.

The app's lifespan puts the settings, the session factory, the object store, the scheduler,
the inference gateway and the workers' wheel on ``app.state``; these functions hand them to
routes (no other module reads ``app.state`` but ``api/admission/rest_admission.py``, which runs
before routing). ``TenantDep`` is the only way a route learns whose rows it may touch: the tenant of
the bearer key (``TinkerTenantDep``: the Tinker SDK's key), whose request
``api/admission/rest_admission.py`` counted against its ``max_concurrent_rest_requests`` before
routing (429 past it).

No request holds a database connection while it waits: for a thread, a lock, a long-poll,
its body, the object store or an engine. A session's transaction never outlives the thread
hop that began it. ``SessionDep`` opens no connection itself; a plain ``def`` endpoint
(``SessionRoute``, the route class of every router) closes its session in its own thread as
it returns; a coroutine endpoint runs its queries with ``in_thread``, which ends the
transaction in that thread; authentication uses short sessions of its own
(``api/admission/auth.py``). Under a burst, threads wait for connections only while the threads
holding them run, never the other way round: the deadlock that froze the control plane (connections
held by requests waiting for a thread, every thread waiting for a connection) cannot form.
"""

from __future__ import annotations

import functools
import inspect
import weakref
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass
from typing import Annotated, Any, Literal, ParamSpec, TypeVar

import anyio
from fastapi import Depends, Header, Path, Query, Request
from fastapi.routing import APIRoute
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api.admission import fairness, rest_admission
from skytrain_backend.api.admission.auth import NO_KEY, Authenticator
from skytrain_backend.api.admission.rest_admission import TINKER_KEY_PREFIX
from skytrain_backend.api.admission.tenant_load import TenantLoads
from skytrain_backend.api.gateway import Gateway
from skytrain_backend.api.longpoll import Waiting
from skytrain_backend.config import Settings
from skytrain_backend.db import workers
from skytrain_backend.db.models import Tenant, Worker
from skytrain_backend.db.notify import Notifier
from skytrain_backend.db.pages import PageRequest
from skytrain_backend.db.tenants import TenantLimits, limits_of
from skytrain_backend.errors import AuthenticationFailed
from skytrain_backend.provision.package import WorkerPackage
from skytrain_backend.ranges import (
    EVENT_ID_PATTERN,
    ID_MAX_LENGTH,
    ID_PATTERN,
    MAX_STEP,
    MAX_WAIT_S,
    NAME_MAX_LENGTH,
    NAME_PATTERN,
    SPLIT_PATTERN,
)
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.storage import ObjectStore

_bearer = HTTPBearer(auto_error=False, description="An API key: sk-st-...")

P = ParamSpec("P")
T = TypeVar("T")


# The accessors of ``app.state`` are coroutines only so that FastAPI calls them on the event
# loop: a plain ``def`` dependency is run in the thread pool, a thread hop per request for a
# dict lookup (most of the gateway's own cost per request on a route cache hit).


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


async def get_session(request: Request) -> AsyncIterator[Session]:
    # A new session holds no connection: made on the event loop, it costs no thread hop.
    session: Session = request.app.state.sessionmaker()
    try:
        yield session
    finally:
        if session.in_transaction():
            # Left open by a coroutine endpoint that queried on the event loop: closed in a
            # thread of its own (a fresh limiter), as FastAPI closes a generator's session.
            await anyio.to_thread.run_sync(session.close, limiter=anyio.CapacityLimiter(1))
        else:
            session.close()


async def in_thread(
    session: Session, function: Callable[P, T], /, *args: P.args, **kwargs: P.kwargs
) -> T:
    """``function(*args, **kwargs)`` in a worker thread, the session's transaction ended in
    that same thread: committed when it returns (what it loaded stays loaded, and attached),
    rolled back when it raises. The connection is back in the pool before the request goes on
    to wait for anything."""

    def run() -> T:
        try:
            result = function(*args, **kwargs)
        except BaseException:
            session.rollback()
            raise
        session.commit()
        return result

    return await run_in_threadpool(run)


_closing_endpoints: weakref.WeakSet[Callable[..., Any]] = weakref.WeakSet()


def _closing_sessions(endpoint: Callable[..., Any]) -> Callable[..., Any]:
    """A plain endpoint as a coroutine that runs it in a thread, in the turn of the tenant
    admission admitted (``api/admission/fairness.py``), closing the sessions it was given before it
    returns, in that thread; a coroutine endpoint as it is."""
    if inspect.iscoroutinefunction(endpoint) or endpoint in _closing_endpoints:
        return endpoint

    def closing(*args: Any, **kwargs: Any) -> Any:
        try:
            return endpoint(*args, **kwargs)
        finally:
            for value in kwargs.values():
                if isinstance(value, Session):
                    value.close()

    @functools.wraps(endpoint)
    async def run(*args: Any, **kwargs: Any) -> Any:
        turns = fairness.route_turns.get()
        if turns is None:
            return await run_in_threadpool(closing, *args, **kwargs)
        async with turns.turn(fairness.turn_key.get()):
            return await run_in_threadpool(closing, *args, **kwargs)

    _closing_endpoints.add(run)
    return run


class SessionRoute(APIRoute):
    """The route class of every router. FastAPI runs a plain ``def`` endpoint in a worker
    thread and closes a dependency's session after the response, in another hop; here the
    endpoint closes it in its own thread as it returns (what it did not commit is rolled back,
    as closing did), so the connection is free before the answer is serialized and sent; and
    it takes that thread in its tenant's turn (``api/admission/fairness.py``), not first come, first
    served."""

    def __init__(self, path: str, endpoint: Callable[..., Any], **kwargs: Any) -> None:
        super().__init__(path, _closing_sessions(endpoint), **kwargs)


def app_state(name: str) -> Callable[[Request], Any]:
    """A dependency that hands a route ``app.state.<name>``, one the lifespan put there."""

    async def get(request: Request) -> Any:
        return getattr(request.app.state, name)

    return get


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ObjectStore, Depends(app_state("store"))]
SchedulerDep = Annotated[Scheduler, Depends(app_state("scheduler"))]
NotifierDep = Annotated[Notifier, Depends(app_state("notifier"))]
WaitingDep = Annotated[Waiting, Depends(app_state("waiting"))]
GatewayDep = Annotated[Gateway, Depends(app_state("gateway"))]
PackageDep = Annotated[WorkerPackage, Depends(app_state("worker_package"))]
AuthenticatorDep = Annotated[Authenticator, Depends(app_state("authenticator"))]
RestLoadsDep = Annotated[TenantLoads, Depends(app_state("rest_loads"))]


# The bearer key as sent; routes that authenticate in their own session (the inference
# gateway) pass it to ``api.admission.auth.authenticate`` themselves.
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


# A worker's token (``swt-...``) or an operator's join token (``swj-...``), as sent.
WorkerCredentialsDep = Annotated[
    HTTPAuthorizationCredentials | None, Depends(HTTPBearer(auto_error=False))
]


async def get_worker(session: SessionDep, credentials: WorkerCredentialsDep) -> Worker:
    """The token's worker, attached to the request's session (the route changes it), whose
    connection went back to the pool in the lookup's thread."""
    if credentials is None:
        raise AuthenticationFailed("no worker token: send 'Authorization: Bearer swt-...'")
    return await in_thread(
        session, workers.authenticate_worker, session, token=credentials.credentials
    )


WorkerDep = Annotated[Worker, Depends(get_worker)]


@dataclass(frozen=True)
class _Admission:
    """What admits a request that ``RestAdmission`` did not admit before routing."""

    request: Request
    authenticator: Authenticator
    loads: TenantLoads
    settings: Settings

    @asynccontextmanager
    async def tenant(
        self, key: str | None, *, missing: str, prefix: str = ""
    ) -> AsyncIterator[Tenant]:
        """The key's tenant (``prefix`` taken off the key), its request counted in
        (``rest_admission.admit``) while the block runs; AuthenticationFailed(``missing``)
        with no key."""
        tenant = rest_admission.admitted(self.request.scope)
        if tenant is not None:
            yield tenant
            return
        if not key:
            raise AuthenticationFailed(missing)
        tenant, release = await rest_admission.admit(
            key.removeprefix(prefix),
            authenticator=self.authenticator,
            loads=self.loads,
            settings=self.settings,
            client=rest_admission.client_address(self.request.scope),
        )
        try:
            yield tenant
        finally:
            release()


async def _admission(
    request: Request,
    authenticator: AuthenticatorDep,
    loads: RestLoadsDep,
    settings: SettingsDep,
) -> _Admission:
    return _Admission(request, authenticator, loads, settings)


_AdmissionDep = Annotated[_Admission, Depends(_admission)]


async def get_tenant(
    admission: _AdmissionDep, credentials: CredentialsDep
) -> AsyncIterator[Tenant]:
    """The key's tenant, its request counted against its REST requests until answered: by
    ``RestAdmission`` before routing (every ``/v1`` route), else here."""
    key = credentials.credentials if credentials else None
    async with admission.tenant(key, missing=NO_KEY) as tenant:
        yield tenant


TenantDep = Annotated[Tenant, Depends(get_tenant)]


@dataclass(frozen=True)
class Upload:
    """What a route that stores a tenant's upload (a file, a log, a job's batch) works with:
    the request's session and tenant, the object store, the settings that bound the upload,
    and the scheduler a new job wakes."""

    session: Session
    tenant: Tenant
    store: ObjectStore
    settings: Settings
    scheduler: Scheduler

    @property
    def limits(self) -> TenantLimits:
        """The tenant's limits: its own where set, else the settings'."""
        return limits_of(self.tenant, self.settings)


async def _upload(
    session: SessionDep,
    tenant: TenantDep,
    store: StoreDep,
    settings: SettingsDep,
    scheduler: SchedulerDep,
) -> Upload:
    return Upload(session, tenant, store, settings, scheduler)


UploadDep = Annotated[Upload, Depends(_upload)]


async def get_tinker_tenant(
    admission: _AdmissionDep,
    credentials: CredentialsDep,
    x_api_key: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> AsyncIterator[Tenant]:
    """The tenant of the Tinker SDK's key ("tml-" + a skytrain key, sent as X-API-Key; or a
    bearer key), admitted as ``get_tenant`` admits a REST request."""
    missing = (
        "no API key: set TINKER_API_KEY to 'tml-' followed by a skytrain key "
        "(`skytrain keys create --tenant NAME --tinker` prints it)"
    )
    key = x_api_key or (credentials.credentials if credentials else None)
    async with admission.tenant(key, missing=missing, prefix=TINKER_KEY_PREFIX) as tenant:
        yield tenant


TinkerTenantDep = Annotated[Tenant, Depends(get_tinker_tenant)]

Limit = Annotated[int, Query(ge=1, le=100, description="Items per page.")]
OrderQuery = Annotated[Literal["asc", "desc"], Query(description="Sort direction.")]
After = Annotated[
    str | None,
    Query(
        max_length=ID_MAX_LENGTH,
        pattern=ID_PATTERN,
        description="Cursor: the id of the last item seen.",
    ),
]


def page_query(after: After = None, limit: Limit = 20, order: OrderQuery = "asc") -> PageRequest:
    """The page a listing route is asked for: ``?after=<id>&limit=&order=``."""
    return PageRequest(after=after, limit=limit, order=order)


PageDep = Annotated[PageRequest, Depends(page_query)]
WaitS = Annotated[
    float,
    Query(
        ge=0,
        le=MAX_WAIT_S,
        description=f"Long-poll: seconds (0 to {MAX_WAIT_S:g}) to hold the request until "
        "there is something to answer; 0 answers at once.",
    ),
]
EventCursor = Annotated[
    str | None,
    Query(
        pattern=EVENT_ID_PATTERN,
        description="Cursor: the id of the last event seen (digits; event ids are integers).",
    ),
]

# Ids in paths: what skytrain issues are 32 hex digits; anything of this shape that is not one
# of yours is a 404, anything else a 400 naming the parameter.
ModelId = Annotated[str, Path(max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
JobId = Annotated[str, Path(max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
ModelIdQuery = Annotated[str | None, Query(max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
BatchId = Annotated[str, Path(max_length=ID_MAX_LENGTH, pattern=ID_PATTERN)]
StepPath = Annotated[int, Path(ge=0, le=MAX_STEP, description="A checkpoint step.")]
StepQuery = Annotated[int | None, Query(ge=0, le=MAX_STEP, description="A checkpoint step.")]
NameQuery = Annotated[str | None, Query(max_length=NAME_MAX_LENGTH, pattern=NAME_PATTERN)]
SplitQuery = Annotated[str | None, Query(max_length=64, pattern=SPLIT_PATTERN)]

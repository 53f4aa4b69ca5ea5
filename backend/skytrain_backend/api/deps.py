"""Dependencies every route declares through these ``Annotated`` aliases.

The app's lifespan puts the settings, the session factory, the object store, the scheduler,
the inference gateway and the workers' wheel on ``app.state``; these functions hand them to
routes (no other module reads ``app.state``). ``TenantDep`` authenticates the bearer key
and is the only way a route learns whose rows it may touch.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Annotated, Literal

from fastapi import Depends, Header, Path, Query, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from sqlalchemy.orm import Session

from skytrain_backend.api.longpoll import Waiting
from skytrain_backend.config import Settings
from skytrain_backend.db import keys
from skytrain_backend.db.models import Tenant
from skytrain_backend.db.notify import Notifier
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

if TYPE_CHECKING:
    from skytrain_backend.api.gateway import Gateway
    from skytrain_backend.api.tinker import TinkerService

_bearer = HTTPBearer(auto_error=False, description="An API key: sk-st-...")


# The accessors of ``app.state`` are coroutines only so that FastAPI calls them on the event
# loop: a plain ``def`` dependency is run in the thread pool, a thread hop per request for a
# dict lookup (most of the gateway's own cost per request on a route cache hit).


async def get_settings(request: Request) -> Settings:
    settings: Settings = request.app.state.settings
    return settings


def get_session(request: Request) -> Iterator[Session]:
    with request.app.state.sessionmaker() as session:
        yield session


async def get_store(request: Request) -> ObjectStore:
    store: ObjectStore = request.app.state.store
    return store


async def get_scheduler(request: Request) -> Scheduler:
    scheduler: Scheduler = request.app.state.scheduler
    return scheduler


async def get_notifier(request: Request) -> Notifier:
    notifier: Notifier = request.app.state.notifier
    return notifier


async def get_waiting(request: Request) -> Waiting:
    waiting: Waiting = request.app.state.waiting
    return waiting


async def get_gateway(request: Request) -> Gateway:
    gateway: Gateway = request.app.state.gateway
    return gateway


async def get_worker_package(request: Request) -> WorkerPackage:
    worker_package: WorkerPackage = request.app.state.worker_package
    return worker_package


async def get_tinker(request: Request) -> TinkerService:
    tinker: TinkerService = request.app.state.tinker
    return tinker


SettingsDep = Annotated[Settings, Depends(get_settings)]
SessionDep = Annotated[Session, Depends(get_session)]
StoreDep = Annotated[ObjectStore, Depends(get_store)]
SchedulerDep = Annotated[Scheduler, Depends(get_scheduler)]
NotifierDep = Annotated[Notifier, Depends(get_notifier)]
WaitingDep = Annotated[Waiting, Depends(get_waiting)]
GatewayDep = Annotated["Gateway", Depends(get_gateway)]
PackageDep = Annotated[WorkerPackage, Depends(get_worker_package)]
TinkerDep = Annotated["TinkerService", Depends(get_tinker)]


# The bearer key as sent; routes that authenticate in their own session (the inference
# gateway) pass it to ``get_tenant`` themselves.
CredentialsDep = Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]


def get_tenant(session: SessionDep, credentials: CredentialsDep) -> Tenant:
    if credentials is None:
        raise AuthenticationFailed(
            "no API key: send the header 'Authorization: Bearer sk-st-...' "
            "(create a key with `skytrain keys create --tenant NAME`)"
        )
    return keys.authenticate(session, key=credentials.credentials)


TenantDep = Annotated[Tenant, Depends(get_tenant)]

# The Tinker SDK's keys are "tml-" + a skytrain key, sent as X-API-Key.
TINKER_KEY_PREFIX = "tml-"


def get_tinker_tenant(
    session: SessionDep,
    credentials: CredentialsDep,
    x_api_key: Annotated[str | None, Header(include_in_schema=False)] = None,
) -> Tenant:
    key = x_api_key or (credentials.credentials if credentials else None)
    if not key:
        raise AuthenticationFailed(
            "no API key: set TINKER_API_KEY to 'tml-' followed by a skytrain key "
            "(`skytrain keys create --tenant NAME --tinker` prints it)"
        )
    return keys.authenticate(session, key=key.removeprefix(TINKER_KEY_PREFIX))


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

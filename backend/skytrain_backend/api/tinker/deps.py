"""What the Tinker route modules share (``api/tinker/*.py``): the service (``TinkerDep``),
path ids, the futures they answer, and the run a request names."""

from __future__ import annotations

from typing import Annotated, Any

from fastapi import Depends, Path, Request
from sqlalchemy.orm import Session

from skytrain_backend.api.tinker.service import TinkerService
from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import (
    Tenant,
    TinkerRequest,
    TinkerRun,
)
from skytrain_backend.db.tenants import limits_of
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.ranges import NO_NUL_PATTERN
from skytrain_backend.scheduler.tinker import runs
from skytrain_backend.storage.base import ObjectStore


async def get_tinker(request: Request) -> TinkerService:
    tinker: TinkerService = request.app.state.tinker
    return tinker


TinkerDep = Annotated[TinkerService, Depends(get_tinker)]
# An id in the path: refused (400) before it reaches SQL if it holds NUL or is too long.
PathId = Annotated[str, Path(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]


def future(row: TinkerRequest, **extra: Any) -> schemas.UntypedAPIFuture:
    return schemas.UntypedAPIFuture(request_id=row.id, model_id=row.run_id, **extra)


def queued(
    tinker: TinkerService, session: Session, operation: TinkerRequest
) -> schemas.UntypedAPIFuture:
    """The future of a queued operation, its run's worker told at once."""
    if operation.run_id is not None:
        run = session.get_one(TinkerRun, operation.run_id)
        tinker.notify(f"job:{run.job_id}")
    return future(operation)


def submit(
    tinker: TinkerService,
    session: Session,
    store: ObjectStore,
    *,
    run: TinkerRun,
    seq_id: int | None,
    kind: str,
    params: dict[str, Any],
    refused: str | None = None,
    body: bytes | None = None,
) -> schemas.UntypedAPIFuture:
    """How every operation of a live run ends: queued in the run's order (or recorded failed,
    ``refused`` saying why), and its future answered, the run's worker told."""
    operation = runs.submit(
        session,
        store=store,
        limits=limits_of(session.get_one(Tenant, run.tenant_id), tinker.settings),
        run=run,
        seq_id=seq_id,
        kind=kind,
        params=params,
        body=body,
        refused=refused,
    )
    return queued(tinker, session, operation)


def tenant_run(session: Session, tenant: Tenant, model_id: str) -> TinkerRun:
    """The tenant's run ``model_id`` (404 otherwise), marked active."""
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=model_id)
    tinker_rows.touch_run(session, run=run)
    return run

"""What the Tinker route modules share (``api/tinker/*.py``): the service (``TinkerDep``),
path ids, and the run a request names."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Path
from sqlalchemy.orm import Session

from skytrain_backend.api.deps import app_state
from skytrain_backend.api.tinker.service import TinkerService
from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import Tenant, TinkerRun
from skytrain_backend.ranges import NO_NUL_PATTERN

TinkerDep = Annotated[TinkerService, Depends(app_state("tinker"))]

# An id in the path: refused (400) before it reaches SQL if it holds NUL or is too long.
PathId = Annotated[str, Path(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]


def tenant_run(session: Session, tenant: Tenant, model_id: str) -> TinkerRun:
    """The tenant's run ``model_id`` (404 otherwise), marked active."""
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=model_id)
    tinker_rows.touch_run(session, run=run)
    return run

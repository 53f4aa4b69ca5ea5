"""What the Tinker route modules share (``api/tinker/*.py``): the service (``TinkerDep``),
path ids, and the training routes' way to the tenant's runs (``TrainingDep``)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated

from fastapi import Depends, Path
from sqlalchemy.orm import Session

from skytrain_backend.api.deps import TinkerTenantDep, app_state
from skytrain_backend.api.tinker.service import TinkerService
from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import Tenant, TinkerRun
from skytrain_backend.ranges import NO_NUL_PATTERN

TinkerDep = Annotated[TinkerService, Depends(app_state("tinker"))]

# An id in the path: refused (400) before it reaches SQL if it holds NUL or is too long.
PathId = Annotated[str, Path(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]


@dataclass(frozen=True)
class Training:
    """What a training route needs: ``run`` finds the tenant's run it names, and the service
    (``tinker.submit`` queues its typed operation there)."""

    tenant: Tenant
    tinker: TinkerService

    def run(self, session: Session, model_id: str) -> TinkerRun:
        """The tenant's run ``model_id`` (404 otherwise), marked active."""
        run = tinker_rows.get_run(session, tenant_id=self.tenant.id, run_id=model_id)
        tinker_rows.touch_run(session, run=run)
        return run


async def _training(tenant: TinkerTenantDep, tinker: TinkerDep) -> Training:
    return Training(tenant, tinker)


TrainingDep = Annotated[Training, Depends(_training)]

"""Liveness without a key, for load balancers and `skytrain serve` users."""

from __future__ import annotations

from fastapi import APIRouter

from skytrain_backend import __version__
from skytrain_backend.api.deps import SchedulerDep
from skytrain_backend.api.schemas import HealthPublic

router = APIRouter(tags=["health"])


# A coroutine: it reads no database, so it needs no thread (and no turn behind other requests'
# work in the thread pool).
@router.get("/health", response_model=HealthPublic)
async def health(scheduler: SchedulerDep) -> HealthPublic:
    return HealthPublic(
        status="ok",
        version=__version__,
        scheduler="leader" if scheduler.is_leader else "follower",
    )

"""The routers, one per resource, gathered in ``api_router`` (mounted under /v1 and
/v1/preview by the app)."""

from __future__ import annotations

from fastapi import APIRouter

from skytrain_backend.api.routes import (
    checkpoints,
    files,
    inference,
    logs,
    models,
    training_jobs,
    usage,
)

api_router = APIRouter()
# The inference routes first: FastAPI tries routes in order, twice per request, and these
# take most requests (no other route's path can be theirs).
for module in (inference, models, checkpoints, logs, training_jobs, files, usage):
    api_router.include_router(module.router)

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
)

api_router = APIRouter()
for module in (models, checkpoints, logs, training_jobs, files, inference):
    api_router.include_router(module.router)

"""The Tinker REST client's routes: training runs, their checkpoints, and weights info."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from sqlalchemy.orm import Session

from skytrain_backend.api.deps import (
    SessionDep,
    SessionRoute,
    TinkerTenantDep,
)
from skytrain_backend.api.tinker.deps import PathId
from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRun,
)
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.ranges import INT32_MAX
from skytrain_backend.scheduler.tinker import runs

# Included by the main Tinker router (api/tinker/training.py), under its /api/v1 prefix.
router = APIRouter(tags=["tinker"], route_class=SessionRoute)


def _checkpoint_public(
    named: TinkerCheckpoint, checkpoint: Checkpoint
) -> schemas.TinkerCheckpointPublic:
    segment = "weights" if named.kind == "training" else "sampler_weights"
    return schemas.TinkerCheckpointPublic(
        checkpoint_id=f"{segment}/{named.name}",
        checkpoint_type=named.kind,
        time=named.created_at,
        tinker_path=runs.TinkerPath.of(named.run_id, named.kind, named.name),  # type: ignore[arg-type]
        size_bytes=checkpoint.size_bytes,
        user_metadata=named.user_metadata or None,
    )


def _run_public(session: Session, tenant: Tenant, run: TinkerRun) -> schemas.TrainingRunPublic:
    model = session.get_one(Model, run.model_id)
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id, run_id=run.id)
    latest = {
        kind: next((item for item in named if item[0].kind == kind), None)
        for kind in ("training", "sampler")
    }
    job = runs.run_job(session, run=run)
    return schemas.TrainingRunPublic(
        training_run_id=run.id,
        base_model=model.base_model,
        model_owner=tenant.name,
        corrupted=job.status == "failed",
        lora_rank=ModelConfig.model_validate(model.config).lora_rank,
        last_request_time=run.last_request_at,
        last_checkpoint=_checkpoint_public(*latest["training"]) if latest["training"] else None,
        last_sampler_checkpoint=(
            _checkpoint_public(*latest["sampler"]) if latest["sampler"] else None
        ),
        user_metadata={k: str(v) for k, v in run.user_metadata.items()} or None,
    )


Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]


@router.get("/training_runs")
def list_training_runs(
    tenant: TinkerTenantDep, session: SessionDep, limit: Limit = 20, offset: Offset = 0
) -> schemas.TrainingRunsResponse:
    found, total = tinker_rows.list_runs(session, tenant_id=tenant.id, limit=limit, offset=offset)
    return schemas.TrainingRunsResponse(
        training_runs=[_run_public(session, tenant, run) for run in found],
        cursor=schemas.Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get("/training_runs/{run_id}")
def get_training_run(
    run_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.TrainingRunPublic:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=run_id)
    return _run_public(session, tenant, run)


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(
    run_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.CheckpointsListResponse:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=run_id)
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id, run_id=run.id)
    return schemas.CheckpointsListResponse(
        checkpoints=[_checkpoint_public(*item) for item in named]
    )


@router.get("/checkpoints")
def list_checkpoints(
    tenant: TinkerTenantDep, session: SessionDep, limit: Limit = 100, offset: Offset = 0
) -> schemas.CheckpointsListResponse:
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id)
    page = named[offset : offset + limit]
    return schemas.CheckpointsListResponse(
        checkpoints=[_checkpoint_public(*item) for item in page],
        cursor=schemas.Cursor(offset=offset, limit=limit, total_count=len(named)),
    )


@router.post("/weights_info")
def weights_info(
    body: schemas.WeightsInfoRequest, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.WeightsInfoResponse:
    run, _ = runs.resolve_path(session, tenant_id=tenant.id, path=body.tinker_path)
    model = session.get_one(Model, run.model_id)
    config = ModelConfig.model_validate(model.config)
    return schemas.WeightsInfoResponse(
        base_model=model.base_model,
        lora_rank=config.lora_rank,
        train_mlp=bool(set(runs.MLP_MODULES) & set(config.lora_target_modules)),
        train_attn=bool(set(runs.ATTENTION_MODULES) & set(config.lora_target_modules)),
    )

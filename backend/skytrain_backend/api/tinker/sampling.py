"""The Tinker protocol's sampling routes: sampling sessions, samplers and ``asample`` (the
sample itself is a task of this process: ``api.tinker.service``)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.api.admission.model_rules import check_new_model
from skytrain_backend.api.deps import (
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    TinkerTenantDep,
)
from skytrain_backend.api.tinker.deps import PathId, TinkerDep
from skytrain_backend.config import Settings
from skytrain_backend.db import registry, tinker_rows
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerSampler,
)
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.scheduler.tinker import runs

# Included by the main Tinker router (api/tinker/training.py), under its /api/v1 prefix.
router = APIRouter(tags=["tinker"], route_class=SessionRoute)


def _base_model_sampler_model(
    session: Session, tenant: Tenant, settings: Settings, scheduler: Scheduler, base_model: str
) -> Model:
    """The tenant's model that stands for ``base_model`` itself (step 0), created once, under
    the rules of any new model."""
    config = ModelConfig()
    limits = check_new_model(
        session, tenant, base_model, config, settings=settings, scheduler=scheduler
    )
    name = "base-" + uuid.uuid5(uuid.NAMESPACE_URL, base_model).hex[:16]
    model = session.scalar(
        select(Model).where(
            Model.tenant_id == tenant.id,
            Model.entity == tenant.name,
            Model.project == runs.PROJECT,
            Model.name == name,
        )
    )
    if model is not None:
        return model
    model, _ = registry.create_model(
        session,
        tenant=tenant,
        entity=tenant.name,
        project=runs.PROJECT,
        name=name,
        base_model=base_model,
        config=config.model_dump(mode="json"),
        return_existing=True,
        max_models=limits.max_models,
    )
    return model


@router.post("/create_sampling_session")
def create_sampling_session(
    body: schemas.CreateSamplingSessionRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
    scheduler: SchedulerDep,
) -> schemas.CreateSamplingSessionResponse:
    tinker_rows.open_session(session, tenant_id=tenant.id, session_id=body.session_id)
    if body.model_path is not None:
        run, checkpoint = runs.resolve_path(session, tenant_id=tenant.id, path=body.model_path)
        model = session.get_one(Model, run.model_id)
        step = checkpoint.step
    elif body.base_model is not None:
        model = _base_model_sampler_model(session, tenant, settings, scheduler, body.base_model)
        step = 0
    else:
        raise InvalidRequest("create_sampling_session needs model_path or base_model")
    sampler = TinkerSampler(
        tenant_id=tenant.id,
        base_model=model.base_model,
        model_id=model.id,
        step=step,
        model_path=body.model_path,
    )
    session.add(sampler)
    session.commit()
    return schemas.CreateSamplingSessionResponse(sampling_session_id=sampler.id)


@router.get("/samplers/{sampler_id}")
def get_sampler(
    sampler_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.GetSamplerResponse:
    sampler = tinker_rows.get_sampler(session, tenant_id=tenant.id, sampler_id=sampler_id)
    return schemas.GetSamplerResponse(
        sampler_id=sampler.id, base_model=sampler.base_model, model_path=sampler.model_path
    )


@router.post("/asample")
async def asample(
    body: schemas.SampleRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    """Queue a sampling request; its task (in this process) asks the sampler's engine. It
    counts against the tenant's requests in flight from now until it is answered: past its
    limit, 429 (the SDK backs off and sends it again)."""
    return await tinker.asample(session, tenant=tenant, body=body)

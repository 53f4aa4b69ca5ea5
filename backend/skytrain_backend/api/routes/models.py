"""Models: create (or get, with return_existing), list, get, delete with everything they own."""

from __future__ import annotations

from fastapi import APIRouter, Response, status

from skytrain_backend.api.admission.model_rules import check_new_model
from skytrain_backend.api.deps import (
    Limit,
    ModelId,
    NameQuery,
    PageDep,
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from skytrain_backend.api.schemas import (
    DemandPublic,
    ModelCreate,
    ModelEventPublic,
    ModelEventsPublic,
    ModelPublic,
    ModelReplicasUpdate,
    ModelsPublic,
    ReplicaPublic,
    ServingPublic,
)
from skytrain_backend.db import registry, tenants
from skytrain_backend.db.models import Model
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.scheduler import placement, replicas
from skytrain_backend.scheduler.demand import DemandMeter
from skytrain_backend.scheduler.serving import ServingStatus, serving_status
from skytrain_backend.storage import keys

router = APIRouter(prefix="/models", tags=["models"], route_class=SessionRoute)


def replicas_public(
    session: SessionDep, *, model: Model, demand: DemandMeter
) -> list[ReplicaPublic]:
    """The model's home and replicas, each as its worker can answer now, with the model's
    requests in flight on it."""
    return [
        ReplicaPublic(
            worker_id=item.worker_id,
            role=item.role,
            status=item.status,
            in_flight=demand.in_flight(model.id, item.worker_id),
        )
        for item in replicas.placed_on(session, model=model)
    ]


def model_public(
    model: Model,
    *,
    latest_step: int,
    serving: ServingStatus | None = None,
    replicas: list[ReplicaPublic] | None = None,
    demand: DemandPublic | None = None,
) -> ModelPublic:
    return ModelPublic(
        id=model.id,
        entity=model.entity,
        project=model.project,
        name=model.name,
        base_model=model.base_model,
        config=model.config,
        inference_name=f"{model.entity}/{model.project}/{model.name}",
        latest_step=latest_step,
        run_id=model.run_id,
        created_at=model.created_at,
        last_active_at=model.last_active_at,
        serving=ServingPublic(**serving.public()) if serving else None,
        replicas=replicas,
        demand=demand,
    )


@router.post("", status_code=status.HTTP_201_CREATED, response_model=ModelPublic)
def create_model(
    body: ModelCreate,
    session: SessionDep,
    tenant: TenantDep,
    response: Response,
    scheduler: SchedulerDep,
    settings: SettingsDep,
) -> ModelPublic:
    """Register a model; 200 with the existing one when ``return_existing`` is set.

    ``base_model`` is a Hugging Face model id, or a directory inside one the operator allows.
    Registering makes the model active: the scheduler places it on a worker (starting one if
    needed); ``serving`` says how far that got. A LoRA rank no worker would load is refused,
    and so is a base model that fits none of the GPUs workers may get (the memory plan's
    reasons in the message).
    """
    config = body.config or ModelConfig()
    replicas.check_bounds(config, limits=tenants.limits_of(tenant, settings))
    limits = check_new_model(
        session, tenant, body.base_model, config, settings=settings, scheduler=scheduler
    )
    model, created = registry.create_model(
        session,
        tenant=tenant,
        entity=body.entity or tenant.name,
        project=body.project,
        name=body.name,
        base_model=body.base_model,
        config=config.model_dump(mode="json"),
        return_existing=body.return_existing,
        max_models=limits.max_models,
    )
    if not created:
        response.status_code = status.HTTP_200_OK
    placement.mark_model_active(session, model=model, min_interval_s=0)
    scheduler.wake()
    return model_public(
        model,
        latest_step=registry.latest_step(session, model_id=model.id),
        serving=serving_status(
            session,
            model=model,
            limits=limits,
            max_workers=settings.scheduler.launched_workers_limit,
        ),
        replicas=replicas_public(session, model=model, demand=scheduler.demand),
    )


@router.get("", response_model=ModelsPublic)
def list_models(
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    entity: NameQuery = None,
    project: NameQuery = None,
    name: NameQuery = None,
) -> ModelsPublic:
    models, has_more = registry.list_models(
        session,
        tenant_id=tenant.id,
        entity=entity,
        project=project,
        name=name,
        page=page,
    )
    steps = registry.latest_steps(session, model_ids=[model.id for model in models])
    return ModelsPublic(
        data=[model_public(model, latest_step=steps.get(model.id, 0)) for model in models],
        has_more=has_more,
    )


@router.get("/{model_id}", response_model=ModelPublic)
def get_model(
    model_id: ModelId,
    session: SessionDep,
    tenant: TenantDep,
    scheduler: SchedulerDep,
    settings: SettingsDep,
) -> ModelPublic:
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    return model_public(
        model,
        latest_step=registry.latest_step(session, model_id=model.id),
        serving=serving_status(
            session,
            model=model,
            limits=tenants.limits_of(tenant, settings),
            max_workers=settings.scheduler.launched_workers_limit,
            idle_timeout_s=settings.scheduler.resolved_model_idle_timeout_s,
        ),
        replicas=replicas_public(session, model=model, demand=scheduler.demand),
        demand=DemandPublic.model_validate(
            replicas.demand_of(
                session,
                model=model,
                demand=scheduler.demand,
                window_s=settings.scheduler.replica_window_s,
            )
        ),
    )


@router.patch("/{model_id}", response_model=ModelPublic)
def update_model(
    model_id: ModelId,
    body: ModelReplicasUpdate,
    session: SessionDep,
    tenant: TenantDep,
    scheduler: SchedulerDep,
    settings: SettingsDep,
) -> ModelPublic:
    """Change how many workers may serve the model (``min_replicas``, ``max_replicas``;
    ``max_replicas`` at most the tenant's ``max_workers``). The scheduler adds replicas up to
    ``min_replicas`` at its next pass, and drains those above ``max_replicas`` (their
    requests in flight are answered first)."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    replicas.set_bounds(
        session,
        model=model,
        min_replicas=body.min_replicas,
        max_replicas=body.max_replicas,
        limits=tenants.limits_of(tenant, settings),
    )
    scheduler.wake()
    return get_model(model_id, session, tenant, scheduler, settings)


@router.get("/{model_id}/events", response_model=ModelEventsPublic)
def model_events(
    model_id: ModelId, session: SessionDep, tenant: TenantDep, limit: Limit = 20
) -> ModelEventsPublic:
    """The scheduler's decisions about the model's replicas, newest first, with reasons."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    return ModelEventsPublic(
        data=[
            ModelEventPublic.model_validate(event, from_attributes=True)
            for event in replicas.events(session, model_id=model.id, limit=limit)
        ]
    )


@router.delete("/{model_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_model(
    model_id: ModelId, session: SessionDep, tenant: TenantDep, store: StoreDep
) -> None:
    """Delete the model's objects, then its rows (so a failed delete can simply be retried)."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    registry.check_deletable(session, model=model)
    session.commit()  # no transaction open while the store deletes
    store.delete_prefix(keys.model_prefix(tenant_id=tenant.id, model_id=model.id))
    registry.delete_model_rows(session, model=model)

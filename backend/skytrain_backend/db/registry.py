"""Models: create (with their step-0 checkpoint), find, list and delete, always per tenant.

Every lookup filters on the caller's tenant, so another tenant's model id is simply not
found: the API answers 404 and never says the id exists. An entity name belongs to the tenant
that used it first (claimed with its first model), so no tenant's ``<entity>/...`` models pass for
another's.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sqlalchemy import delete, func, select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skytrain_backend.db import tenants
from skytrain_backend.db.models import Checkpoint, Entity, Model, Tenant, TrainingJob
from skytrain_backend.db.pages import PageRequest, list_page, where_given
from skytrain_backend.errors import Conflict, NotFound, QuotaExceeded


def _find(
    session: Session, *, tenant_id: str, entity: str, project: str, name: str
) -> Model | None:
    return session.scalar(
        select(Model).where(
            Model.tenant_id == tenant_id,
            Model.entity == entity,
            Model.project == project,
            Model.name == name,
        )
    )


def _existing(model: Model, *, base_model: str, return_existing: bool) -> Model:
    label = f"{model.entity}/{model.project}/{model.name}"
    if not return_existing:
        raise Conflict(
            f"model {label} exists already (id {model.id}): pass return_existing=true to get it"
        )
    if model.base_model != base_model:
        raise Conflict(
            f"model {label} exists with base model {model.base_model!r}, not {base_model!r}: "
            "choose another name, or delete the model first"
        )
    return model


def create_model(
    session: Session,
    *,
    tenant: Tenant,
    entity: str,
    project: str,
    name: str,
    base_model: str,
    config: dict[str, Any],
    return_existing: bool,
    max_models: int | None = None,
) -> tuple[Model, bool]:
    """The model and whether it was created; its step-0 checkpoint is created with it.

    A tenant that owns ``max_models`` models already gets ``QuotaExceeded``. A new entity
    name becomes the tenant's in the model's own transaction, after the quota check: a create
    that is refused claims nothing.
    """
    found = _find(session, tenant_id=tenant.id, entity=entity, project=project, name=name)
    if found is not None:
        return _existing(found, base_model=base_model, return_existing=return_existing), False
    owner = entity_owner(session, entity=entity)
    _check_owner(owner, tenant=tenant, entity=entity)
    if max_models is not None:
        try:
            check_model_quota(session, tenant_id=tenant.id, max_models=max_models)
        except QuotaExceeded:
            # A concurrent request may have created this very model: that one is not refused.
            found = _find(session, tenant_id=tenant.id, entity=entity, project=project, name=name)
            if found is None:
                raise
            return _existing(found, base_model=base_model, return_existing=return_existing), False
        # Under the tenant's lock: another tenant may have claimed the name since.
        owner = entity_owner(session, entity=entity)
        _check_owner(owner, tenant=tenant, entity=entity)
        if owner is None:
            _check_entity_quota(session, tenant=tenant, entity=entity, max_models=max_models)
    if owner is None:
        session.add(Entity(name=entity, tenant_id=tenant.id))
    model = Model(
        tenant_id=tenant.id,
        entity=entity,
        project=project,
        name=name,
        base_model=base_model,
        config=config,
    )
    session.add(model)
    try:
        session.flush()
        # Step 0 is the base model itself: a fresh LoRA adapter changes nothing, so no files.
        session.add(Checkpoint(model_id=model.id, step=0, uri=None, metrics={}))
        session.commit()
    except IntegrityError:
        # Another request created the same model, or claimed the same new entity, between
        # our lookups and our insert (the entity's name is its primary key).
        session.rollback()
        found = _find(session, tenant_id=tenant.id, entity=entity, project=project, name=name)
        if found is not None:
            return _existing(found, base_model=base_model, return_existing=return_existing), False
        owner = entity_owner(session, entity=entity)
        if owner is None:
            raise
        _check_owner(owner, tenant=tenant, entity=entity)
        # Our own concurrent create claimed it: create again, the entity ours now.
        return create_model(
            session,
            tenant=tenant,
            entity=entity,
            project=project,
            name=name,
            base_model=base_model,
            config=config,
            return_existing=return_existing,
            max_models=max_models,
        )
    return model, True


def _check_owner(owner: str | None, *, tenant: Tenant, entity: str) -> None:
    """``Conflict`` if ``entity`` belongs to another tenant: the one that used it first, or
    the one named so (a tenant's own name is always its entity, and ``skytrain tenants
    create`` refuses a name another tenant has used as an entity)."""
    if owner is not None and owner != tenant.id:
        raise Conflict(
            f"entity {entity!r} belongs to another tenant: create the model under your own "
            f"entity ({tenant.name!r}, the default) or a name no other tenant has used"
        )


def _check_entity_quota(session: Session, *, tenant: Tenant, entity: str, max_models: int) -> None:
    """``QuotaExceeded`` if the tenant has claimed ``max_models`` entity names already (its
    own name aside): a name stays claimed when its models are deleted, so creating and
    deleting in a loop would otherwise claim names without end. Called under the tenant's
    lock (``check_model_quota``)."""
    claimed = int(
        session.scalar(
            select(func.count())
            .select_from(Entity)
            .where(Entity.tenant_id == tenant.id, Entity.name != tenant.name)
        )
        or 0
    )
    if claimed >= max_models:
        session.rollback()
        raise QuotaExceeded(
            f"your tenant has claimed {claimed} entity names, the most its quota allows "
            f"(max_models: {max_models}); a name stays yours when its models are deleted: "
            f"create {entity!r}'s model under one of your entities (your own, {tenant.name!r}, "
            "or one you used before), or ask the operator to raise the quota "
            "(`skytrain tenants limits TENANT --max-models N`)",
            limit="max_models",
        )


def entity_owner(session: Session, *, entity: str) -> str | None:
    """The id of the tenant ``entity`` belongs to (named so, or the first to use it)."""
    named = session.scalar(select(Tenant.id).where(Tenant.name == entity))
    return named or session.scalar(select(Entity.tenant_id).where(Entity.name == entity))


def check_model_quota(session: Session, *, tenant_id: str, max_models: int) -> None:
    """``QuotaExceeded`` if the tenant owns ``max_models`` models already: the one check every
    way of creating a model goes through (REST, and Tinker's training runs and samplers).

    It locks the tenant's row (``tenants.enforce_quota``) until the caller commits the model it
    inserts, so concurrent creates count one after the other.
    """

    def refusal(owned: int) -> QuotaExceeded:
        return QuotaExceeded(
            f"your tenant owns {owned} models, the most its quota allows ({max_models}): "
            "delete one with DELETE /v1/models/{id}, or ask the operator to raise it "
            "(`skytrain tenants limits TENANT --max-models N`)",
            limit="max_models",
        )

    tenants.enforce_quota(
        session,
        tenant_id=tenant_id,
        used=select(func.count(Model.id)).where(Model.tenant_id == tenant_id),
        adding=1,
        allowed=max_models,
        refusal=refusal,
    )


def get_model(session: Session, *, tenant_id: str, model_id: str) -> Model:
    model = session.scalar(select(Model).where(Model.id == model_id, Model.tenant_id == tenant_id))
    if model is None:
        raise NotFound(f"model {model_id!r} not found: list yours with GET /v1/models")
    return model


def list_models(
    session: Session,
    *,
    tenant_id: str,
    entity: str | None = None,
    project: str | None = None,
    name: str | None = None,
    page: PageRequest,
) -> tuple[list[Model], bool]:
    return list_page(
        session,
        where_given(
            select(Model).where(Model.tenant_id == tenant_id),
            (Model.entity, entity),
            (Model.project, project),
            (Model.name, name),
        ),
        keys=(Model.created_at, Model.id),
        page=page,
        anchor=select(Model.created_at, Model.id).where(
            Model.id == page.after, Model.tenant_id == tenant_id
        ),
        missing="the id of one of your models",
    )


def latest_steps(session: Session, *, model_ids: Sequence[str]) -> dict[str, int]:
    """The newest checkpoint step that still exists, per model.

    This is the one definition of a model's latest step: what requests without ``:step<N>``
    are served, what workers are asked to load, and what the next training job starts from.
    A deleted checkpoint is never the latest.
    """
    if not model_ids:
        return {}
    rows = session.execute(
        select(Checkpoint.model_id, func.max(Checkpoint.step))
        .where(Checkpoint.model_id.in_(model_ids), Checkpoint.deleted_at.is_(None))
        .group_by(Checkpoint.model_id)
    )
    return {model_id: step for model_id, step in rows}


def latest_step(session: Session, *, model_id: str) -> int:
    return latest_steps(session, model_ids=[model_id]).get(model_id, 0)


def next_step(session: Session, *, model_id: str) -> int:
    """The step the model's next checkpoint gets: above every step it ever had.

    A deleted step's number is never given again, so ``:step<N>`` always names the same
    weights (training after deleting the latest step starts from the live latest, and
    skips the deleted number).
    """
    newest = session.scalar(
        select(func.max(Checkpoint.step)).where(Checkpoint.model_id == model_id)
    )
    return int(newest or 0) + 1


def check_deletable(session: Session, *, model: Model) -> None:
    running = session.scalar(
        select(TrainingJob.id).where(
            TrainingJob.model_id == model.id, TrainingJob.status == "running"
        )
    )
    if running is not None:
        raise Conflict(
            f"model {model.id} has a running training job ({running}): cancel it with "
            f"POST /v1/training-jobs/{running}/cancel and delete the model once it has stopped"
        )


def delete_model_rows(session: Session, *, model: Model) -> None:
    """Delete the model and, through ON DELETE CASCADE, its checkpoints, logs and jobs; their
    bytes leave its tenant's stored total in the same transaction. The tenant's lock is taken
    first, so no row that holds bytes (inserted under it) is added between the count and the
    delete."""
    tenants.lock_tenant(session, tenant_id=model.tenant_id)
    freed = tenants.model_storage(session, model_id=model.id)
    session.execute(delete(Model).where(Model.id == model.id))
    tenants.release_storage(session, tenant_id=model.tenant_id, freed=freed)
    session.commit()

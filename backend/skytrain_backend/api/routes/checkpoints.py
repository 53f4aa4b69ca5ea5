"""Checkpoints of a model: list (deleted ones too, on request), get, delete (rows marked, then
objects removed), files download."""

from __future__ import annotations

from typing import Annotated

from fastapi import APIRouter, Query
from fastapi.responses import RedirectResponse, StreamingResponse
from sqlalchemy.orm import Session

from skytrain_backend.api.deps import (
    ModelId,
    PageDep,
    SessionDep,
    SessionRoute,
    StepPath,
    StoreDep,
    TenantDep,
)
from skytrain_backend.api.schemas import (
    CheckpointFilePublic,
    CheckpointFilesPublic,
    CheckpointPublic,
    CheckpointsDelete,
    CheckpointsDeleted,
    CheckpointsPublic,
    page_public,
)
from skytrain_backend.db import checkpoints, registry
from skytrain_backend.db.models import Model
from skytrain_backend.errors import NotFound
from skytrain_backend.scheduler import garbage, integrity
from skytrain_backend.storage import ObjectStore

router = APIRouter(
    prefix="/models/{model_id}/checkpoints", tags=["checkpoints"], route_class=SessionRoute
)


@router.get("", response_model=CheckpointsPublic)
def list_checkpoints(
    model_id: ModelId,
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    include_deleted: Annotated[
        bool,
        Query(description="Also list deleted steps (their metrics stay; their files are gone)."),
    ] = False,
) -> CheckpointsPublic:
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    found = checkpoints.list_checkpoints(
        session, model_id=model.id, page=page, include_deleted=include_deleted
    )
    return page_public(CheckpointsPublic, found)


@router.delete("", response_model=CheckpointsDeleted)
def delete_checkpoints(
    model_id: ModelId,
    body: CheckpointsDelete,
    session: SessionDep,
    tenant: TenantDep,
    store: StoreDep,
) -> CheckpointsDeleted:
    """Mark the steps deleted, then remove their files; rows stay, so pinned requests can say
    so. Files the store fails to remove now are removed by the scheduler's next sweep."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    steps = sorted(set(body.steps))
    found = checkpoints.mark_deleted(session, model_id=model.id, steps=steps)
    deleted = {checkpoint.step for checkpoint in found}
    garbage.purge_deleted_checkpoints(session, store=store, model_id=model.id)
    return CheckpointsDeleted(
        deleted_count=len(deleted), not_found_steps=[s for s in steps if s not in deleted]
    )


@router.get("/{step}", response_model=CheckpointPublic)
def get_checkpoint(
    model_id: ModelId, step: StepPath, session: SessionDep, tenant: TenantDep
) -> CheckpointPublic:
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    return CheckpointPublic.model_validate(
        checkpoints.get_checkpoint(session, model_id=model.id, step=step)
    )


def _files(
    session: Session, store: ObjectStore, *, model: Model, step: int
) -> tuple[str, dict[str, int]]:
    """Where the step's files lie, and their sizes as the store holds them
    (``ObjectDamaged`` if they are not what was committed), listed with no transaction
    open."""
    expected = integrity.committed(
        checkpoints.get_checkpoint(session, model_id=model.id, step=step)
    )
    tenant_id, model_id = model.tenant_id, model.id
    session.rollback()
    files = integrity.checkpoint_files(
        store, tenant_id=tenant_id, model_id=model_id, step=step, expected=expected
    )
    prefix = integrity.files_prefix(
        tenant_id=tenant_id, model_id=model_id, step=step, expected=expected
    )
    return prefix, {name: int(item["size"]) for name, item in files.items()}


@router.get("/{step}/files", response_model=CheckpointFilesPublic)
def list_checkpoint_files(
    model_id: ModelId, step: StepPath, session: SessionDep, tenant: TenantDep, store: StoreDep
) -> CheckpointFilesPublic:
    """The checkpoint's files (none for step 0, which is the base model)."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    _, files = _files(session, store, model=model, step=step)
    return CheckpointFilesPublic(
        data=[CheckpointFilePublic(name=name, size=size) for name, size in sorted(files.items())]
    )


@router.get(
    "/{step}/files/{name:path}",
    response_model=None,
    response_class=StreamingResponse,
    responses={200: {"content": {"application/octet-stream": {}}}, 307: {}},
)
def download_checkpoint_file(
    model_id: ModelId,
    step: StepPath,
    name: str,
    session: SessionDep,
    tenant: TenantDep,
    store: StoreDep,
    redirect: bool = True,
) -> StreamingResponse | RedirectResponse:
    """The file's bytes, or a 307 to a presigned URL when the store has them (S3).

    Pass ``redirect=false`` to have the control plane stream the bytes itself, e.g. when the
    client cannot reach the object store.
    """
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    model_id = model.id
    prefix, files = _files(session, store, model=model, step=step)
    if name not in files:
        available = ", ".join(sorted(files)) or "none"
        raise NotFound(f"step {step} of model {model_id} has no file {name!r} (files: {available})")
    key = prefix + name
    url = store.presigned_get_url(key) if redirect else None
    if url is not None:
        return RedirectResponse(url, status_code=307)
    return StreamingResponse(
        store.iter_chunks(key),
        media_type="application/octet-stream",
        headers={
            "Content-Length": str(files[name]),
            "Content-Disposition": f'attachment; filename="{name.rpartition("/")[2]}"',
        },
    )

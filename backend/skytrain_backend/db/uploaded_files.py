"""Uploaded SFT files (``UploadedFile``): recorded with their bytes in the tenant's storage
quota, listed by page, deleted with their bytes released."""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import tenants
from skytrain_backend.db.models import UploadedFile
from skytrain_backend.db.pages import PageRequest, list_page
from skytrain_backend.db.session import staged
from skytrain_backend.errors import NotFound


def add_file(
    session: Session,
    *,
    file_id: str,
    tenant_id: str,
    num_trajectories: int,
    size_bytes: int,
    sha256: str,
) -> UploadedFile:
    """Record a file whose object is written (``size_bytes`` of SHA-256 ``sha256``); its
    bytes were taken from the tenant's storage quota as it was read
    (``tenants.StorageReservation``), which the caller commits with the row."""
    return staged(
        session,
        UploadedFile(
            id=file_id,
            tenant_id=tenant_id,
            num_trajectories=num_trajectories,
            size_bytes=size_bytes,
            sha256=sha256,
        ),
    )


def get_file(session: Session, *, tenant_id: str, file_id: str) -> UploadedFile:
    row = session.get(UploadedFile, file_id)
    if row is None or row.tenant_id != tenant_id:
        raise NotFound(f"file {file_id!r} not found: upload it with POST /v1/files")
    return row


def list_files(
    session: Session, *, tenant_id: str, page: PageRequest
) -> tuple[list[UploadedFile], bool]:
    keys = (UploadedFile.created_at, UploadedFile.id)
    return list_page(
        session,
        select(UploadedFile).where(UploadedFile.tenant_id == tenant_id),
        keys=keys,
        page=page,
        anchor=select(*keys).where(
            UploadedFile.id == page.after, UploadedFile.tenant_id == tenant_id
        ),
        missing="the id of a file of yours",
    )


def delete_file(session: Session, *, tenant_id: str, file_id: str) -> None:
    """Delete the file's row and release its bytes (its object is deleted first, by the
    caller: a row never outlives what it counts uncounted); the caller commits."""
    row = session.scalar(
        select(UploadedFile)
        .where(UploadedFile.id == file_id, UploadedFile.tenant_id == tenant_id)
        .with_for_update()
    )
    if row is None:
        raise NotFound(f"file {file_id!r} not found: upload it with POST /v1/files")
    session.delete(row)
    tenants.release_storage(session, tenant_id=tenant_id, freed=row.size_bytes)

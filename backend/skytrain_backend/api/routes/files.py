"""Uploaded files: JSONL training data for SFT jobs, referenced as ``skytrain-file://<id>``;
held in the tenant's storage quota until deleted."""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterable, Iterator
from typing import Annotated

from fastapi import APIRouter, Path, Response, UploadFile, status
from sqlalchemy.orm import Session

from skytrain_backend.api import ingest
from skytrain_backend.api.deps import (
    PageDep,
    SessionDep,
    SessionRoute,
    StoreDep,
    TenantDep,
    UploadDep,
)
from skytrain_backend.api.schemas import FilePublic, FilesPublic
from skytrain_backend.db import tenants, uploaded_files
from skytrain_backend.db.models import UploadedFile, new_id
from skytrain_backend.errors import InvalidRequest, NotFound, ObjectDamaged
from skytrain_backend.storage import ObjectStore, keys

router = APIRouter(prefix="/files", tags=["files"], route_class=SessionRoute)

FILE_SCHEME = "skytrain-file://"
_FILE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


FileId = Annotated[
    str, Path(pattern=_FILE_ID_RE.pattern, description="The file's id (the end of its uri).")
]


def _public(row: UploadedFile) -> FilePublic:
    return FilePublic(
        id=row.id,
        uri=f"{FILE_SCHEME}{row.id}",
        bytes=row.size_bytes,
        num_trajectories=row.num_trajectories,
        created_at=row.created_at,
    )


@router.post("", status_code=201, response_model=FilePublic)
def upload_file(file: UploadFile, upload: UploadDep) -> FilePublic:
    """Upload JSONL, one trajectory per line; every line is validated before it is stored,
    and its bytes count in your storage quota (403 past it, before anything is stored) until
    you delete it."""
    session, tenant, limits = upload.session, upload.tenant, upload.limits
    reservation = tenants.reserve_as_it_streams(
        session, tenant_id=tenant.id, limits=limits, what="this file"
    )
    batch = ingest.IngestBatch(
        limit=upload.settings.server.max_trajectories_per_request, reservation=reservation
    )
    try:
        ingest.parse_trajectory_lines(file.file, batch)
        file_id = new_id()
        with batch.spool.view() as stored:
            sha256 = hashlib.sha256(stored).hexdigest()  # for `skytrain storage check --read`

        def insert(_uri: str) -> FilePublic:
            row = uploaded_files.add_file(
                session,
                file_id=file_id,
                tenant_id=tenant.id,
                num_trajectories=batch.num_trajectories,
                size_bytes=batch.num_bytes,
                sha256=sha256,
            )
            return _public(row)

        key = keys.file_key(tenant_id=tenant.id, file_id=file_id)
        return ingest.store_then_commit(
            upload.store,
            session,
            key=key,
            data=batch.spool,
            insert=insert,
            reservation=reservation,
        )
    finally:
        batch.close()


@router.get("", response_model=FilesPublic)
def list_files(session: SessionDep, tenant: TenantDep, page: PageDep) -> FilesPublic:
    """Your uploaded files, oldest first (``order=desc``: newest first)."""
    rows, has_more = uploaded_files.list_files(session, tenant_id=tenant.id, page=page)
    return FilesPublic(data=[_public(row) for row in rows], has_more=has_more)


@router.delete("/{file_id}", status_code=status.HTTP_204_NO_CONTENT)
def delete_file(
    file_id: FileId, session: SessionDep, tenant: TenantDep, store: StoreDep
) -> Response:
    """Delete the file and free its bytes. Jobs already queued with it keep their own copy."""
    key = keys.file_key(tenant_id=tenant.id, file_id=file_id)
    try:
        uploaded_files.get_file(session, tenant_id=tenant.id, file_id=file_id)
    except NotFound:
        session.rollback()
        # A file uploaded before files were recorded (i38u) has no row and counts in no
        # quota, but jobs read it: it is the tenant's to delete all the same.
        if not store.exists(key):
            raise
        store.delete(key)
        return Response(status_code=status.HTTP_204_NO_CONTENT)
    session.commit()  # ends the read: no transaction is held across the store
    store.delete(key)
    uploaded_files.delete_file(session, tenant_id=tenant.id, file_id=file_id)
    session.commit()
    return Response(status_code=status.HTTP_204_NO_CONTENT)


def read_uploaded_file(
    session: Session, store: ObjectStore, *, tenant_id: str, url: str
) -> Iterator[bytes]:
    """The lines of a ``skytrain-file://<id>`` file, if the file is the tenant's, as uploaded:
    a file the store lost, or holds with another size or (once read) SHA-256 than its row
    records, raises ``ObjectDamaged`` rather than be read as fewer or other trajectories."""
    if not url.startswith(FILE_SCHEME):
        raise InvalidRequest(
            f"training_data_url {url!r} is not supported: skytrain reads skytrain-file://<id> "
            "URLs; upload the JSONL with POST /v1/files and pass the uri it returns "
            "(wandb-artifact:// and other URLs are not fetched)"
        )
    file_id = url.removeprefix(FILE_SCHEME)
    if not _FILE_ID_RE.match(file_id):
        raise NotFound(f"file {file_id!r} not found: upload it with POST /v1/files")
    try:
        row = uploaded_files.get_file(session, tenant_id=tenant_id, file_id=file_id)
        recorded: tuple[int, str | None] | None = (row.size_bytes, row.sha256)
    except NotFound:
        recorded = None  # uploaded before files had rows (i38u): read as it is
    session.rollback()  # ends the read: no transaction is held while the file is read
    key = keys.file_key(tenant_id=tenant_id, file_id=file_id)
    if recorded is None:
        try:
            return _lines(store.iter_chunks(key))
        except NotFound:
            raise NotFound(f"file {file_id!r} not found: upload it with POST /v1/files") from None
    size, sha256 = recorded
    stored = next((info.size for info in store.list(key) if info.key == key), None)
    if stored is None:
        raise _damaged(file_id, "it is gone")
    if stored != size:
        raise _damaged(file_id, f"it holds {stored} bytes, not the {size} uploaded")
    return _lines(_checked(store.iter_chunks(key), file_id=file_id, sha256=sha256))


def _checked(chunks: Iterable[bytes], *, file_id: str, sha256: str | None) -> Iterator[bytes]:
    """``chunks``, then ``ObjectDamaged`` if they are not the SHA-256 recorded (where one was)."""
    digest = hashlib.sha256()
    for chunk in chunks:
        digest.update(chunk)
        yield chunk
    if sha256 is not None and digest.hexdigest() != sha256:
        raise _damaged(file_id, "its bytes are not the ones uploaded: their SHA-256 differs")


def _damaged(file_id: str, what: str) -> ObjectDamaged:
    return ObjectDamaged(
        f"file {file_id} is damaged in the object store since its upload ({what}): upload "
        "it again (POST /v1/files) and use the new uri; the operator's `skytrain storage "
        "check` lists every such file"
    )


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        *complete, rest = (rest + chunk).split(b"\n")
        yield from complete
    if rest:
        yield rest

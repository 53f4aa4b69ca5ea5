"""Uploaded files: JSONL training data for SFT jobs, referenced as ``skytrain-file://<id>``."""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator

from fastapi import APIRouter, UploadFile

from skytrain_backend.api import ingest
from skytrain_backend.api.deps import SessionRoute, SettingsDep, StoreDep, TenantDep
from skytrain_backend.api.schemas import FilePublic
from skytrain_backend.db.models import new_id
from skytrain_backend.errors import InvalidRequest, NotFound
from skytrain_backend.storage import ObjectStore, keys

router = APIRouter(prefix="/files", tags=["files"], route_class=SessionRoute)

FILE_SCHEME = "skytrain-file://"
_FILE_ID_RE = re.compile(r"^[0-9a-f]{32}$")


@router.post("", status_code=201, response_model=FilePublic)
def upload_file(
    file: UploadFile, tenant: TenantDep, store: StoreDep, settings: SettingsDep
) -> FilePublic:
    """Upload JSONL, one trajectory per line; every line is validated before it is stored."""
    batch = ingest.IngestBatch(limit=settings.max_trajectories_per_request)
    try:
        ingest.parse_trajectory_lines(file.file, batch)
        file_id = new_id()
        batch.spool.put(store, keys.file_key(tenant_id=tenant.id, file_id=file_id))
        return FilePublic(id=file_id, uri=f"{FILE_SCHEME}{file_id}", bytes=batch.spool.size)
    finally:
        batch.close()


def read_uploaded_file(store: ObjectStore, *, tenant_id: str, url: str) -> Iterator[bytes]:
    """The lines of a ``skytrain-file://<id>`` file, if the file is the tenant's."""
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
        chunks = store.iter_chunks(keys.file_key(tenant_id=tenant_id, file_id=file_id))
    except NotFound:
        raise NotFound(f"file {file_id!r} not found: upload it with POST /v1/files") from None
    return _lines(chunks)


def _lines(chunks: Iterable[bytes]) -> Iterator[bytes]:
    rest = b""
    for chunk in chunks:
        *complete, rest = (rest + chunk).split(b"\n")
        yield from complete
    if rest:
        yield rest

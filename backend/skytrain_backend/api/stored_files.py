"""A stored checkpoint's (or a job's saved state's) files as the worker routes serve them.

A file is named by one path segment the caller sends: anything else (empty, ``.``, ``..``, a
``/``) is refused with a 400 before the store is asked, so no name reaches outside its
prefix and a bad one is never taken for a store failure.
"""

from __future__ import annotations

from fastapi.responses import StreamingResponse

from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol.worker import FileListing, ListedFile
from skytrain_backend.storage import ObjectStore


def file_name(name: str) -> str:
    """``name`` if it is one file name; a 400 naming it otherwise."""
    if not name or "/" in name or "\\" in name or name in (".", ".."):
        raise InvalidRequest(
            f"{name!r} is not a checkpoint file name: send one name such as "
            "'adapter_model.safetensors', as the file listing gives it"
        )
    return name


def listing(store: ObjectStore, prefix: str) -> FileListing:
    """``{"data": [{"name", "size"}]}`` of the files under ``prefix``."""
    return FileListing(
        data=[
            ListedFile(name=info.key.removeprefix(prefix), size=info.size)
            for info in store.list(prefix)
        ]
    )


def download(store: ObjectStore, prefix: str, name: str) -> StreamingResponse:
    """The bytes of the file ``name`` under ``prefix``."""
    return StreamingResponse(
        store.iter_chunks(prefix + file_name(name)), media_type="application/octet-stream"
    )

"""What an object store is: payloads (trajectory batches, checkpoints, uploaded files) by key.

SQL holds the small rows that are queried; the object store holds the bytes. Keys are built
server-side only (``storage.keys``), never taken from a request, and every implementation
refuses a key that could point outside its root.

Errors: a missing object raises ``ObjectMissing`` (a ``NotFound``); anything else the backing
store does wrong raises ``StorageError`` (HTTP 502), so callers never see boto3's or the OS's
own exceptions. Both messages name keys and the store's location: the API shows them to the
operator's log only.
"""

from __future__ import annotations

import abc
import hashlib
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import BinaryIO

from skytrain_backend.errors import StorageError

CHUNK_BYTES = 1024 * 1024


@dataclass(frozen=True)
class ObjectInfo:
    key: str
    size: int
    # When the object was last written (UTC), as the store reports it.
    modified: datetime


@dataclass(frozen=True)
class ObjectDigest:
    size: int
    # Lowercase hex, as ``hashlib``'s ``hexdigest`` writes it.
    sha256: str


def check_key(key: str) -> str:
    """Refuse keys that are empty, absolute or climb out of the store with ``..``."""
    parts = key.split("/")
    if not key or key.startswith("/") or "\\" in key or any(p in ("", ".", "..") for p in parts):
        raise StorageError(f"object key {key!r} is not a clean relative path")
    return key


class ObjectWriter(abc.ABC):
    """An object written in pieces as they are made: nobody sees it until ``commit``, and
    ``abort`` (or any error) leaves nothing behind. Memory stays bounded whatever its size."""

    @abc.abstractmethod
    def write(self, data: bytes) -> None: ...

    @abc.abstractmethod
    def commit(self) -> None:
        """Make the object, with everything written, visible at its key."""

    @abc.abstractmethod
    def abort(self) -> None:
        """Drop what was written; nothing is stored. Safe to call twice or after commit
        failed; a no-op after commit succeeded."""


class ObjectStore(abc.ABC):
    """Put, read, list and delete objects under one root (a bucket prefix or a directory)."""

    @property
    @abc.abstractmethod
    def url(self) -> str:
        """The store's root as a URL (``s3://bucket/prefix``, ``file:///dir``), no secrets."""

    def uri(self, key: str) -> str:
        """Where ``key`` lives, as recorded in the database (``<url>/<key>``)."""
        return f"{self.url.rstrip('/')}/{check_key(key)}"

    @abc.abstractmethod
    def put_bytes(self, key: str, data: bytes) -> None: ...

    @abc.abstractmethod
    def put_stream(self, key: str, stream: BinaryIO) -> None:
        """Write everything ``stream`` yields; large streams go up in parts."""

    def put_file(self, key: str, path: Path) -> None:
        with path.open("rb") as stream:
            self.put_stream(key, stream)

    @abc.abstractmethod
    def open_writer(self, key: str) -> ObjectWriter:
        """A writer that streams an object to ``key`` (``ObjectWriter``)."""

    @abc.abstractmethod
    def get_bytes(self, key: str) -> bytes: ...

    @abc.abstractmethod
    def iter_chunks(self, key: str, *, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        """The object's bytes in chunks, for streaming responses. Raises NotFound up front."""

    @abc.abstractmethod
    def download_file(self, key: str, path: Path) -> None: ...

    def digest(self, key: str) -> ObjectDigest:
        """The object's size and SHA-256, read back from the store in chunks (memory stays
        bounded whatever its size): what is really stored, not what a writer meant to store.
        Raises ObjectMissing if there is none."""
        sha256 = hashlib.sha256()
        size = 0
        for chunk in self.iter_chunks(key):
            sha256.update(chunk)
            size += len(chunk)
        return ObjectDigest(size=size, sha256=sha256.hexdigest())

    @abc.abstractmethod
    def copy(self, source_key: str, dest_key: str) -> int:
        """Copy an object inside the store without passing it through this process; returns
        its size in bytes."""

    @abc.abstractmethod
    def exists(self, key: str) -> bool: ...

    @abc.abstractmethod
    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Objects whose key starts with ``prefix`` (a plain string prefix, as in S3)."""

    @abc.abstractmethod
    def delete(self, key: str) -> None:
        """Remove one object; a key that does not exist is not an error."""

    def delete_prefix(self, prefix: str) -> int:
        """Remove every object under ``prefix``; returns how many were removed."""
        if not prefix.endswith("/"):
            raise StorageError(f"refusing to delete prefix {prefix!r}: it must end with '/'")
        objects = self.list(prefix)
        for info in objects:
            self.delete(info.key)
        return len(objects)

    def presigned_get_url(self, key: str, *, expires_s: int = 3600) -> str | None:
        """A URL anyone can GET the object from for a while, or None if the store has none."""
        return None

    @abc.abstractmethod
    def abort_stale_uploads(self, *, started_before: datetime) -> int:
        """Remove the writes under ``keys.TENANTS_PREFIX`` started before ``started_before`` that
        never finished: what a process killed mid-write leaves (an S3 multipart upload, a local
        temporary file), invisible to ``list`` and never completed. How many were removed."""

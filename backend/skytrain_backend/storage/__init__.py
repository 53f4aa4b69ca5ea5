"""The object store: S3 (any S3-compatible endpoint) or a local directory, one interface.

``open_object_store(url, settings)`` picks the implementation from the URL's scheme.
"""

from __future__ import annotations

from pathlib import Path
from urllib.parse import unquote, urlparse

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.storage.base import (
    ObjectDigest,
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    check_key,
)
from skytrain_backend.storage.local import LocalObjectStore

__all__ = [
    "LocalObjectStore",
    "ObjectDigest",
    "ObjectInfo",
    "ObjectStore",
    "ObjectWriter",
    "check_key",
    "open_object_store",
]


def open_object_store(url: str, settings: Settings) -> ObjectStore:
    """The store at ``url``: ``file:///dir`` or ``s3://bucket/prefix``."""
    parsed = urlparse(url)
    if parsed.scheme == "file":
        if parsed.netloc not in ("", "localhost"):
            raise ConfigurationError(
                f"object store URL {url!r} names host {parsed.netloc!r}: "
                "use file:///absolute/path for a local directory"
            )
        return LocalObjectStore(Path(unquote(parsed.path)))
    if parsed.scheme == "s3":
        if not parsed.netloc:
            raise ConfigurationError(
                f"object store URL {url!r} has no bucket: use s3://bucket or s3://bucket/prefix"
            )
        # boto3 is imported only when S3 is configured: the embedded default does without.
        from skytrain_backend.storage.s3 import S3ObjectStore

        return S3ObjectStore(
            bucket=parsed.netloc,
            prefix=parsed.path,
            endpoint_url=settings.storage.s3_endpoint_url,
            region=settings.storage.s3_region,
        )
    raise ConfigurationError(
        f"object store URL {url!r} is not supported: use s3://bucket/prefix or file:///path"
    )

"""The object store on S3 or any S3-compatible service (MinIO, R2, moto), through boto3.

Retries use botocore's ``standard`` mode (exponential backoff on throttling and transient
errors); objects above ``MULTIPART_THRESHOLD`` go up in parts through boto3's transfer manager,
so one slow part is retried alone rather than the whole checkpoint.
"""

from __future__ import annotations

import io
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO

import boto3
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError

from skytrain_backend.errors import NotFound, ObjectMissing, StorageError
from skytrain_backend.storage.base import CHUNK_BYTES, ObjectInfo, ObjectStore, check_key

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

MULTIPART_THRESHOLD = 16 * 1024 * 1024
_MISSING_CODES = frozenset({"404", "NoSuchKey", "NotFound"})
_DELETE_BATCH = 1000  # the most keys one DeleteObjects call accepts


class S3ObjectStore(ObjectStore):
    def __init__(
        self,
        *,
        bucket: str,
        prefix: str = "",
        endpoint_url: str | None = None,
        region: str | None = None,
        max_attempts: int = 5,
    ) -> None:
        self.bucket = bucket
        self.prefix = prefix.strip("/")
        self.endpoint_url = endpoint_url
        config = Config(
            retries={"mode": "standard", "max_attempts": max_attempts},
            connect_timeout=10,
            read_timeout=60,
        )
        self._client: S3Client = boto3.client(
            "s3", endpoint_url=endpoint_url, region_name=region, config=config
        )
        self._transfer = TransferConfig(
            multipart_threshold=MULTIPART_THRESHOLD, multipart_chunksize=MULTIPART_THRESHOLD
        )

    @property
    def url(self) -> str:
        return f"s3://{self.bucket}/{self.prefix}" if self.prefix else f"s3://{self.bucket}"

    def _key(self, key: str) -> str:
        check_key(key)
        return f"{self.prefix}/{key}" if self.prefix else key

    def _fail(self, action: str, key: str, exc: Exception) -> Exception:
        """Translate boto3's exceptions: a missing object is NotFound, the rest StorageError."""
        if isinstance(exc, ClientError):
            code = str(exc.response.get("Error", {}).get("Code", ""))
            if code in _MISSING_CODES:
                return ObjectMissing(f"object {key!r} does not exist in {self.url}")
            if code == "NoSuchBucket":
                return StorageError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}: "
                    "create it or fix SKYTRAIN_OBJECT_STORE_URL"
                )
        return StorageError(f"could not {action} object {key!r} in {self.url}: {exc}")

    def put_bytes(self, key: str, data: bytes) -> None:
        if len(data) >= MULTIPART_THRESHOLD:
            self.put_stream(key, io.BytesIO(data))
            return
        try:
            self._client.put_object(Bucket=self.bucket, Key=self._key(key), Body=data)
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("write", key, exc) from exc

    def put_stream(self, key: str, stream: BinaryIO) -> None:
        try:
            self._client.upload_fileobj(stream, self.bucket, self._key(key), Config=self._transfer)
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("write", key, exc) from exc

    def put_file(self, key: str, path: Path) -> None:
        try:
            self._client.upload_file(str(path), self.bucket, self._key(key), Config=self._transfer)
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("write", key, exc) from exc

    def _get(self, key: str) -> Any:
        try:
            return self._client.get_object(Bucket=self.bucket, Key=self._key(key))["Body"]
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("read", key, exc) from exc

    def get_bytes(self, key: str) -> bytes:
        body = self._get(key)
        try:
            return bytes(body.read())
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("read", key, exc) from exc
        finally:
            body.close()

    def iter_chunks(self, key: str, *, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        body = self._get(key)

        def chunks() -> Iterator[bytes]:
            try:
                yield from body.iter_chunks(chunk_size)
            finally:
                body.close()

        return chunks()

    def download_file(self, key: str, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        try:
            self._client.download_file(
                self.bucket, self._key(key), str(path), Config=self._transfer
            )
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("download", key, exc) from exc

    def copy(self, source_key: str, dest_key: str) -> int:
        try:
            head = self._client.head_object(Bucket=self.bucket, Key=self._key(source_key))
            # The managed copy switches to multipart copy for large objects (over 5 GB the
            # single-request CopyObject refuses).
            self._client.copy(
                {"Bucket": self.bucket, "Key": self._key(source_key)},
                self.bucket,
                self._key(dest_key),
                Config=self._transfer,
            )
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("copy", source_key, exc) from exc
        return int(head["ContentLength"])

    def exists(self, key: str) -> bool:
        try:
            self._client.head_object(Bucket=self.bucket, Key=self._key(key))
        except (BotoCoreError, ClientError) as exc:
            error = self._fail("check", key, exc)
            if isinstance(error, NotFound):
                return False
            raise error from exc
        return True

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        root = f"{self.prefix}/" if self.prefix else ""
        found = []
        try:
            pages = self._client.get_paginator("list_objects_v2").paginate(
                Bucket=self.bucket, Prefix=root + prefix
            )
            for page in pages:
                for item in page.get("Contents", []):
                    found.append(
                        ObjectInfo(
                            key=item["Key"].removeprefix(root),
                            size=item["Size"],
                            modified=item["LastModified"],
                        )
                    )
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("list", prefix, exc) from exc
        return sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        try:
            self._client.delete_object(Bucket=self.bucket, Key=self._key(key))
        except (BotoCoreError, ClientError) as exc:
            error = self._fail("delete", key, exc)
            if not isinstance(error, NotFound):
                raise error from exc

    def delete_prefix(self, prefix: str) -> int:
        if not prefix.endswith("/"):
            raise StorageError(f"refusing to delete prefix {prefix!r}: it must end with '/'")
        keys = [self._key(info.key) for info in self.list(prefix)]
        for start in range(0, len(keys), _DELETE_BATCH):
            batch = keys[start : start + _DELETE_BATCH]
            try:
                response = self._client.delete_objects(
                    Bucket=self.bucket,
                    Delete={"Objects": [{"Key": key} for key in batch], "Quiet": True},
                )
            except (BotoCoreError, ClientError) as exc:
                raise self._fail("delete", prefix, exc) from exc
            if errors := response.get("Errors"):
                first = errors[0]
                raise StorageError(
                    f"could not delete {len(errors)} objects under {prefix!r} in {self.url}: "
                    f"{first.get('Key')}: {first.get('Message')}"
                )
        return len(keys)

    def presigned_get_url(self, key: str, *, expires_s: int = 3600) -> str | None:
        try:
            return self._client.generate_presigned_url(
                "get_object",
                Params={"Bucket": self.bucket, "Key": self._key(key)},
                ExpiresIn=expires_s,
            )
        except (BotoCoreError, ClientError) as exc:
            raise self._fail("sign", key, exc) from exc

"""The object store on S3 or any S3-compatible service (MinIO, R2, SeaweedFS), through boto3.

Retries use botocore's ``standard`` mode (exponential backoff on throttling and transient
errors); objects above ``MULTIPART_THRESHOLD`` go up in parts through boto3's transfer manager,
so one slow part is retried alone rather than the whole checkpoint.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Any, BinaryIO, TypedDict

import boto3
from boto3.exceptions import S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.config import Config
from botocore.exceptions import BotoCoreError, ClientError, HTTPClientError
from botocore.exceptions import ConnectionError as BotoConnectionError

from skytrain_backend.errors import NotFound, ObjectMissing, StorageError, StoreUnavailable
from skytrain_backend.storage.base import (
    CHUNK_BYTES,
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    check_key,
)
from skytrain_backend.storage.keys import TENANTS_PREFIX

if TYPE_CHECKING:
    from mypy_boto3_s3 import S3Client

logger = logging.getLogger(__name__)

MULTIPART_THRESHOLD = 16 * 1024 * 1024
# A streamed object (``open_writer``) under MULTIPART_THRESHOLD goes up in one PUT; a larger one
# in a first part of that size, then parts of this size (S3's least is 5 MiB, but for the last
# part), one uploading in a thread while the next one fills.
STREAM_PART_BYTES = 8 * 1024 * 1024
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
        """Translate boto3's exceptions: a missing object is NotFound, a store that cannot be
        reached or cannot serve now (after botocore's retries) StoreUnavailable, the rest
        StorageError."""
        # boto3's upload_file wraps the ClientError it met in an exception of its own.
        cause = exc.__context__ if isinstance(exc, S3UploadFailedError) else exc
        where = f"{self.url} at {self.endpoint_url or 'AWS'}"
        if isinstance(cause, ClientError):
            code = str(cause.response.get("Error", {}).get("Code", ""))
            if code in _MISSING_CODES:
                return ObjectMissing(f"object {key!r} does not exist in {self.url}")
            if code == "NoSuchBucket":
                return StorageError(
                    f"bucket {self.bucket!r} does not exist at {self.endpoint_url or 'AWS'}: "
                    "create it or fix SKYTRAIN_OBJECT_STORE_URL"
                )
            if cause.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0) >= 500:
                return StoreUnavailable(f"could not {action} object {key!r} in {where}: {exc}")
        if isinstance(cause, BotoConnectionError | HTTPClientError):
            return StoreUnavailable(
                f"could not {action} object {key!r}: the store {where} cannot be reached: {exc}"
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
        except (BotoCoreError, ClientError, S3UploadFailedError) as exc:
            raise self._fail("write", key, exc) from exc

    def open_writer(self, key: str) -> ObjectWriter:
        return _S3Writer(self, key)

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

    def abort_stale_uploads(self, *, started_before: datetime) -> int:
        # Only skytrain's own keys: the bucket may hold other tools' uploads.
        root = f"{self.prefix}/{TENANTS_PREFIX}" if self.prefix else TENANTS_PREFIX
        aborted = 0
        try:
            pages = self._client.get_paginator("list_multipart_uploads").paginate(
                Bucket=self.bucket, Prefix=root
            )
            for page in pages:
                for upload in page.get("Uploads", []):
                    if upload["Initiated"] >= started_before:
                        continue
                    try:
                        self._client.abort_multipart_upload(
                            Bucket=self.bucket, Key=upload["Key"], UploadId=upload["UploadId"]
                        )
                    except ClientError as exc:
                        if exc.response.get("Error", {}).get("Code") == "NoSuchUpload":
                            continue  # completed or aborted meanwhile
                        raise
                    aborted += 1
        except (BotoCoreError, ClientError) as exc:
            raise StorageError(f"could not abort stale uploads in {self.url}: {exc}") from exc
        return aborted


class _Part(TypedDict):
    """An uploaded part, as CompleteMultipartUpload lists it."""

    ETag: str
    PartNumber: int


class _S3Writer(ObjectWriter):
    """A multipart upload fed part by part: at most one part uploads (in a thread) while the
    next fills, so memory stays near two parts. An object smaller than ``MULTIPART_THRESHOLD``
    goes up in one PUT on commit, as ``put_bytes`` sends one (measured on moto only, where
    CompleteMultipartUpload of a 12 MB batch took as long as uploading it; on a real S3 the
    trade, a part sent beside the parsing against one round trip less, is not measured). Until
    the commit nothing is visible at the key; abort (and any error) aborts the upload, so S3
    keeps no parts either."""

    def __init__(self, store: S3ObjectStore, key: str) -> None:
        self._store, self._key, self._s3_key = store, key, store._key(key)
        self._chunks: list[bytes] = []
        self._size = 0
        self._upload_id: str | None = None
        self._parts: list[Future[_Part]] = []
        self._executor: ThreadPoolExecutor | None = None
        self._done = False

    def write(self, data: bytes) -> None:
        self._chunks.append(data)
        self._size += len(data)
        if self._size >= (MULTIPART_THRESHOLD if self._upload_id is None else STREAM_PART_BYTES):
            self._send_part()

    def _send_part(self) -> None:
        body = b"".join(self._chunks)
        self._chunks, self._size = [], 0
        client, bucket = self._store._client, self._store.bucket
        try:
            if self._upload_id is None:
                created = client.create_multipart_upload(Bucket=bucket, Key=self._s3_key)
                self._upload_id = created["UploadId"]
                self._executor = ThreadPoolExecutor(1, thread_name_prefix="s3-part")
            if self._parts:
                self._parts[-1].result()  # the part before this one is up: one in flight
        except (BotoCoreError, ClientError) as exc:
            raise self._store._fail("write", self._key, exc) from exc
        assert self._executor is not None
        number, upload_id = len(self._parts) + 1, self._upload_id

        def upload() -> _Part:
            answer = client.upload_part(
                Bucket=bucket, Key=self._s3_key, UploadId=upload_id, PartNumber=number, Body=body
            )
            return _Part(ETag=answer["ETag"], PartNumber=number)

        self._parts.append(self._executor.submit(upload))

    def commit(self) -> None:
        client, bucket = self._store._client, self._store.bucket
        try:
            if self._upload_id is None:
                client.put_object(Bucket=bucket, Key=self._s3_key, Body=b"".join(self._chunks))
            else:
                if self._chunks:
                    self._send_part()
                parts = [part.result() for part in self._parts]
                client.complete_multipart_upload(
                    Bucket=bucket,
                    Key=self._s3_key,
                    UploadId=self._upload_id,
                    MultipartUpload={"Parts": parts},  # type: ignore[typeddict-item]
                )
        except (BotoCoreError, ClientError) as exc:
            raise self._store._fail("write", self._key, exc) from exc
        self._done = True
        self._chunks = []
        self._shut_down()

    def abort(self) -> None:
        self._chunks = []
        if self._done:
            return
        self._shut_down()
        if self._upload_id is not None:
            upload_id, self._upload_id = self._upload_id, None
            try:
                self._store._client.abort_multipart_upload(
                    Bucket=self._store.bucket, Key=self._s3_key, UploadId=upload_id
                )
            except (BotoCoreError, ClientError):
                logger.exception("could not abort the upload of %s; S3 keeps its parts", self._key)

    def _shut_down(self) -> None:
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None

"""The object store, on a local directory and on S3 through a SeaweedFS server over HTTP."""

from __future__ import annotations

import io
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import boto3
import httpx
import pytest

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError, NotFound, StorageError, StoreUnavailable
from skytrain_backend.storage import LocalObjectStore, ObjectStore, open_object_store
from skytrain_backend.storage.s3 import MULTIPART_THRESHOLD, STREAM_PART_BYTES, S3ObjectStore
from tests.fixtures.services import MakeSettings


@pytest.fixture(params=["local", pytest.param("s3", marks=pytest.mark.s3)])
def store(request: pytest.FixtureRequest, make_settings: MakeSettings) -> ObjectStore:
    settings = make_settings(store=request.param)
    return open_object_store(settings.storage.resolved_object_store_url, settings)


def test_bytes_round_trip_and_uri(store: ObjectStore) -> None:
    store.put_bytes("a/b/c.jsonl", b"hello\n")
    assert store.get_bytes("a/b/c.jsonl") == b"hello\n"
    assert store.exists("a/b/c.jsonl")
    assert store.uri("a/b/c.jsonl") == f"{store.url}/a/b/c.jsonl"
    store.put_bytes("a/b/c.jsonl", b"replaced")
    assert store.get_bytes("a/b/c.jsonl") == b"replaced"


def test_missing_objects_raise_not_found(store: ObjectStore, tmp_path: Path) -> None:
    assert not store.exists("nothing/here")
    with pytest.raises(NotFound, match="nothing/here"):
        store.get_bytes("nothing/here")
    with pytest.raises(NotFound):
        store.iter_chunks("nothing/here")
    with pytest.raises(NotFound):
        store.download_file("nothing/here", tmp_path / "out")
    with pytest.raises(NotFound):
        store.copy("nothing/here", "elsewhere")
    store.delete("nothing/here")  # deleting what is not there is fine


def test_files_streams_and_chunks(store: ObjectStore, tmp_path: Path) -> None:
    source = tmp_path / "adapter.bin"
    source.write_bytes(os.urandom(300_000))
    store.put_file("ckpt/adapter.bin", source)
    store.download_file("ckpt/adapter.bin", tmp_path / "down" / "adapter.bin")
    assert (tmp_path / "down" / "adapter.bin").read_bytes() == source.read_bytes()
    store.put_stream("ckpt/stream.bin", io.BytesIO(b"x" * 1000))
    chunks = list(store.iter_chunks("ckpt/stream.bin", chunk_size=256))
    assert len(chunks) >= 4
    assert b"".join(chunks) == b"x" * 1000


def test_list_delete_and_delete_prefix(store: ObjectStore) -> None:
    for key in ("t/1/a", "t/1/b/c", "t/10/a", "t/2/a"):
        store.put_bytes(key, key.encode())
    assert [(i.key, i.size) for i in store.list("t/1")] == [
        ("t/1/a", 5),
        ("t/1/b/c", 7),
        ("t/10/a", 6),
    ]
    assert [i.key for i in store.list("t/1/")] == ["t/1/a", "t/1/b/c"]
    assert store.delete_prefix("t/1/") == 2
    assert [i.key for i in store.list()] == ["t/10/a", "t/2/a"]
    store.delete("t/2/a")
    assert [i.key for i in store.list("t/")] == ["t/10/a"]
    with pytest.raises(StorageError, match="must end with '/'"):
        store.delete_prefix("t/10")


def test_copy_returns_the_size(store: ObjectStore) -> None:
    store.put_bytes("staged/a", b"12345")
    assert store.copy("staged/a", "final/a") == 5
    assert store.get_bytes("final/a") == b"12345"
    assert store.exists("staged/a")


@pytest.mark.parametrize("key", ["", "/etc/passwd", "../outside", "a/../../b", "a//b", "a\\b"])
def test_keys_that_could_escape_are_refused(store: ObjectStore, key: str) -> None:
    with pytest.raises(StorageError, match="not a clean relative path"):
        store.put_bytes(key, b"x")
    with pytest.raises(StorageError):
        store.get_bytes(key)


def test_local_writes_are_atomic(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    store.put_bytes("k/v", b"old")

    def failing() -> Iterator[bytes]:
        yield b"new and half"
        raise OSError("connection dropped")

    class Broken(io.RawIOBase):
        def __init__(self) -> None:
            self.parts = failing()

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: bytearray) -> int:  # type: ignore[override]
            part = next(self.parts)
            buffer[: len(part)] = part
            return len(part)

    with pytest.raises(StorageError, match="connection dropped"):
        store.put_stream("k/v", io.BufferedReader(Broken()))
    assert store.get_bytes("k/v") == b"old"
    assert sorted(p.name for p in (tmp_path / "objects" / "k").iterdir()) == ["v"]


def test_local_store_refuses_symlinks_out_of_the_root(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    (tmp_path / "secret").write_text("s")
    (tmp_path / "objects" / "link").symlink_to(tmp_path)
    with pytest.raises(StorageError, match="outside the store"):
        store.get_bytes("link/secret")


def test_presigned_urls_on_s3_only(store: ObjectStore) -> None:
    store.put_bytes("p/file", b"signed")
    url = store.presigned_get_url("p/file")
    if isinstance(store, LocalObjectStore):
        assert url is None
        return
    assert url is not None
    assert httpx.get(url).content == b"signed"


@pytest.mark.s3
def test_large_objects_go_up_in_parts(make_bucket: Callable[[], str], s3_endpoint: str) -> None:
    bucket = make_bucket().removeprefix("s3://").split("/")[0]
    store = S3ObjectStore(bucket=bucket, endpoint_url=s3_endpoint)
    data = os.urandom(MULTIPART_THRESHOLD + 1024)
    store.put_bytes("big.bin", data)
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(Bucket=bucket, Key="big.bin")
    assert "-" in head["ETag"]  # a multipart upload's ETag ends in -<number of parts>
    assert store.get_bytes("big.bin") == data


@pytest.mark.s3
def test_a_streamed_object_under_the_multipart_threshold_goes_up_in_one_put(
    make_bucket: Callable[[], str], s3_endpoint: str
) -> None:
    bucket = make_bucket().removeprefix("s3://").split("/")[0]
    store = S3ObjectStore(bucket=bucket, endpoint_url=s3_endpoint)
    data = os.urandom(MULTIPART_THRESHOLD - 1024)  # more than one part's worth
    assert len(data) > STREAM_PART_BYTES
    writer = store.open_writer("streams/one-put.bin")
    writer.write(data)
    assert _pending_uploads(store) == []  # nothing sent yet
    writer.commit()
    head = boto3.client("s3", endpoint_url=s3_endpoint).head_object(
        Bucket=bucket, Key="streams/one-put.bin"
    )
    assert "-" not in head["ETag"]  # one PUT: no part count in the ETag
    assert store.get_bytes("streams/one-put.bin") == data


def _pending_uploads(store: ObjectStore) -> list[object]:
    """Multipart uploads S3 still holds parts of (none on a local store)."""
    if not isinstance(store, S3ObjectStore):
        return []
    answer = store._client.list_multipart_uploads(Bucket=store.bucket)
    return list(answer.get("Uploads", []))


def _leftovers(store: ObjectStore) -> list[str]:
    """Files a local store holds besides its objects (temporary files)."""
    if not isinstance(store, LocalObjectStore):
        return []
    return [path.name for path in store.root.rglob("*") if path.name.startswith(".tmp-")]


def test_a_streamed_object_appears_whole_on_commit(store: ObjectStore) -> None:
    chunk = os.urandom(1024 * 1024)
    # A first part of MULTIPART_THRESHOLD, a full part and a short one.
    parts = (MULTIPART_THRESHOLD + STREAM_PART_BYTES) // len(chunk) + 1
    writer = store.open_writer("streams/big.jsonl")
    for _ in range(parts):
        writer.write(chunk)
    assert not store.exists("streams/big.jsonl")
    writer.commit()
    assert store.get_bytes("streams/big.jsonl") == chunk * parts
    small = store.open_writer("streams/small.jsonl")
    small.write(b"one line\n")
    small.commit()
    small.abort()  # after a commit: nothing to undo
    assert store.get_bytes("streams/small.jsonl") == b"one line\n"
    assert _pending_uploads(store) == [] and _leftovers(store) == []


def test_an_aborted_stream_leaves_nothing(store: ObjectStore) -> None:
    chunk = os.urandom(1024 * 1024)
    writer = store.open_writer("streams/dropped.jsonl")
    for _ in range(MULTIPART_THRESHOLD // len(chunk) + 2):  # one part up, the next begun
        writer.write(chunk)
    writer.abort()
    writer.abort()
    assert not store.exists("streams/dropped.jsonl")
    assert store.list("streams/") == []
    assert _pending_uploads(store) == [] and _leftovers(store) == []
    if isinstance(store, LocalObjectStore):  # nor the directory made for it
        assert not (store.root / "streams").exists()


@pytest.mark.s3
def test_a_stream_that_cannot_be_written_is_a_storage_error(s3_endpoint: str) -> None:
    store = S3ObjectStore(bucket="no-such-bucket", endpoint_url=s3_endpoint, max_attempts=1)
    writer = store.open_writer("k")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        writer.write(b"x" * MULTIPART_THRESHOLD)
    writer.abort()


@pytest.mark.s3
def test_a_missing_bucket_is_a_storage_error_naming_it(s3_endpoint: str, tmp_path: Path) -> None:
    store = S3ObjectStore(bucket="no-such-bucket", endpoint_url=s3_endpoint, max_attempts=1)
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        store.put_bytes("k", b"v")
    # A file goes up through boto3's upload_file, which wraps the error in one of its own.
    (tmp_path / "batch.jsonl").write_bytes(b"v")
    with pytest.raises(StorageError, match="bucket 'no-such-bucket' does not exist"):
        store.put_file("k", tmp_path / "batch.jsonl")


def test_a_store_that_cannot_be_reached_is_unavailable_not_failed(tmp_path: Path) -> None:
    """Nothing listens on the endpoint: every call says the store cannot be reached (a 503
    the client may retry), and names neither the object nor the endpoint to a tenant."""
    store = S3ObjectStore(bucket="bucket", endpoint_url="http://127.0.0.1:9", max_attempts=1)
    (tmp_path / "f").write_bytes(b"v")
    calls = [
        lambda: store.put_bytes("k", b"v"),
        lambda: store.put_file("k", tmp_path / "f"),
        lambda: store.get_bytes("k"),
        lambda: store.copy("k", "l"),
        lambda: store.exists("k"),
    ]
    for call in calls:
        with pytest.raises(StoreUnavailable, match="cannot be reached") as raised:
            call()
        assert raised.value.status_code == 503


def test_open_object_store_picks_by_scheme(tmp_path: Path) -> None:
    settings = Settings(storage={"home": tmp_path, "s3_endpoint_url": "http://127.0.0.1:9"})
    assert isinstance(open_object_store(tmp_path.as_uri(), settings), LocalObjectStore)
    s3 = open_object_store("s3://bucket/some/prefix/", settings)
    assert isinstance(s3, S3ObjectStore)
    assert s3.url == "s3://bucket/some/prefix"
    with pytest.raises(ConfigurationError, match="no bucket"):
        open_object_store("s3:///prefix", settings)
    with pytest.raises(ConfigurationError, match="not supported"):
        open_object_store("gs://bucket", settings)

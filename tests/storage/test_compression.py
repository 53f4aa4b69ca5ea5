"""Stored batches are zstd-compressed JSONL: written through ``CompressingWriter``, read back
by content (compressed or plain, as objects written before compression are)."""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path

import pytest
import zstandard

from skytrain_backend.errors import StorageError
from skytrain_backend.storage import LocalObjectStore, compression
from skytrain_backend.storage.base import CHUNK_BYTES


def _jsonl(lines: int) -> bytes:
    rng = random.Random(0)
    return b"".join(
        json.dumps({"n": n, "logprobs": [rng.random() for _ in range(50)]}).encode() + b"\n"
        for n in range(lines)
    )


def test_a_batch_written_compressed_reads_back_as_its_lines(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    data = _jsonl(2000)  # ~2 MB: many compressed blocks, some handed out before the end
    writer = compression.CompressingWriter(store.open_writer("batch.jsonl"))
    for line in data.splitlines(keepends=True):
        writer.write(line)
    assert not store.exists("batch.jsonl")
    writer.commit()
    stored = store.get_bytes("batch.jsonl")
    assert stored.startswith(compression.MAGIC) and len(stored) < len(data) / 2
    assert compression.decompress(stored) == data
    # Any reader of zstd reads it: one frame, nothing skytrain's own.
    assert zstandard.ZstdDecompressor().stream_reader(stored).read() == data
    # Read in chunks of any size, as the stores hand them out.
    for size in (1, 7, 4096, len(stored)):
        chunks = iter([stored[i : i + size] for i in range(0, len(stored), size)])
        assert b"".join(compression.decompress_chunks(chunks)) == data
    # An empty chunk on the way is not the end.
    chunks = iter([stored[:10], b"", stored[10:]])
    assert b"".join(compression.decompress_chunks(chunks)) == data


def test_an_aborted_compressed_batch_leaves_nothing(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    writer = compression.CompressingWriter(store.open_writer("batch.jsonl"))
    writer.write(_jsonl(100))
    writer.abort()
    assert store.list() == []


def test_plain_jsonl_written_before_compression_reads_as_it_is() -> None:
    data = _jsonl(20)
    assert compression.decompress(data) == data
    chunks = iter([data[:10], data[10:]])
    assert b"".join(compression.decompress_chunks(chunks)) == data
    assert b"".join(compression.decompress_chunks(iter([]))) == b""


@pytest.mark.parametrize(
    ("header", "takes_zstd"),
    [
        ("gzip, deflate, zstd", True),  # httpx with zstandard installed
        ("gzip, deflate", False),  # httpx without it
        ("", False),
        ("ZSTD", True),
        ("br;q=1.0, zstd;q=0.5", True),
        ("zstd;q=0", False),
        ("zstd;q=0.000", False),
        ("zstd;q=nope", False),
        ("zstandard", False),
        ("*", False),  # a wildcard could mean any coding: send what every client reads
    ],
)
def test_accept_encoding_is_read_as_http_says(header: str, takes_zstd: bool) -> None:
    assert compression.accepts_zstd(header) is takes_zstd


def test_a_client_gets_the_stored_bytes_only_when_it_takes_zstd() -> None:
    data = _jsonl(50)
    stored = zstandard.ZstdCompressor().compress(data)

    chunks, encoded = compression.for_client(iter([stored]), accept_encoding="gzip, zstd")
    assert encoded and b"".join(chunks) == stored
    chunks, encoded = compression.for_client(iter([stored]), accept_encoding="gzip")
    assert not encoded and b"".join(chunks) == data
    chunks, encoded = compression.for_client(iter([data]), accept_encoding="zstd")
    assert not encoded and b"".join(chunks) == data


def test_a_batch_that_compressed_a_thousandfold_is_read_back_in_bounded_pieces() -> None:
    data = b'{"same": "group"}\n' * (3 * CHUNK_BYTES // 18)  # ~3 chunks, compressed to ~1 KB
    stored = zstandard.ZstdCompressor().compress(data)
    assert len(stored) < CHUNK_BYTES / 100
    pieces = list(compression.decompress_chunks(iter([stored])))
    assert b"".join(pieces) == data
    assert len(pieces) >= 3 and max(map(len, pieces)) <= CHUNK_BYTES


def _zstd_stream(data: bytes) -> bytes:
    compressor = zstandard.ZstdCompressor(level=compression.LEVEL, threads=1).compressobj()
    return compressor.compress(data) + compressor.flush()


def _read_whole(stored: bytes) -> bytes:
    return compression.decompress(stored)


def _read_in_chunks(stored: bytes) -> bytes:
    chunks = iter([stored[i : i + 1000] for i in range(0, len(stored), 1000)])
    return b"".join(compression.decompress_chunks(chunks))


@pytest.mark.parametrize("read", [_read_whole, _read_in_chunks])
def test_a_batch_cut_short_or_followed_by_bytes_is_a_storage_error(
    read: Callable[[bytes], bytes],
) -> None:
    data = _jsonl(500)
    frames = {  # skytrain's writer; whole-buffer frames with their size; with a checksum
        "streamed": _zstd_stream(data),
        "sized": zstandard.ZstdCompressor().compress(data),
        "checksummed": zstandard.ZstdCompressor(write_checksum=True).compress(data),
    }
    rng = random.Random(0)
    for stored in frames.values():
        assert read(stored) == data
        # zstandard's own readers would return what they could decompress, without an error.
        # (A cut before the magic number's end reads as plain JSONL, as old objects do.)
        cuts = [4, 5, 6, 9, len(stored) - 4, len(stored) - 1]
        for cut in cuts + rng.sample(range(4, len(stored)), 20):
            with pytest.raises(StorageError, match="cut short"):
                read(stored[:cut])
        with pytest.raises(StorageError, match="bytes follow its zstd frame"):
            read(stored + b"\n")
        # In a chunk of their own, after the decompressor has stopped reading.
        with pytest.raises(StorageError, match="bytes follow its zstd frame"):
            b"".join(compression.decompress_chunks(iter([stored, b"\n"])))
    with pytest.raises(StorageError, match="corrupt"):
        read(compression.MAGIC + b"\xff" * 100)  # the descriptor's reserved bit set


def test_a_flipped_bit_in_a_stored_batch_is_a_storage_error(tmp_path: Path) -> None:
    store = LocalObjectStore(tmp_path)
    writer = compression.CompressingWriter(store.open_writer("batch.jsonl"))
    writer.write(_jsonl(500))
    writer.commit()
    stored = bytearray(store.get_bytes("batch.jsonl"))
    assert zstandard.get_frame_parameters(bytes(stored)).has_checksum
    rng = random.Random(0)
    for at in rng.sample(range(20, len(stored) - 4), 10):  # inside the blocks
        flipped = bytearray(stored)
        flipped[at] ^= 1 << rng.randrange(8)
        with pytest.raises(StorageError, match="corrupt"):
            compression.decompress(bytes(flipped))


def test_a_client_is_refused_before_its_answer_starts_when_the_frame_is_corrupt() -> None:
    corrupt = compression.MAGIC + b"\xff" * 100
    with pytest.raises(StorageError, match="corrupt"):
        compression.for_client(iter([corrupt]), accept_encoding="gzip")

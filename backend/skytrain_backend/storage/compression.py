"""Stored trajectory batches are zstd-compressed JSONL.

A batch (a training job's input, a logged batch) is written once and read once or twice, and
its JSON repeats itself: field names, ``"bytes":null``, token prefixes. zstd at level 1
shrinks a batch of sampled trajectories about 7x for ~1.3 s of CPU per GB, so the control
plane sends the object store a seventh of the bytes while it validates (the upload runs beside
the parser on the same cores), and workers download a seventh.

An object is recognised by its content, not its key: a zstd frame starts with the magic
number ``28 b5 2f fd``, which no JSONL line can start with. Objects written before batches
were compressed (plain JSONL) are read as they are.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import IO, cast

import zstandard

from skytrain_backend.storage.base import CHUNK_BYTES, ObjectWriter

MAGIC = b"\x28\xb5\x2f\xfd"
# The fastest of zstd's standard levels: level 3 took twice the CPU and came out no smaller
# on a batch of sampled trajectories (bench/ingest_trajectories.py's).
LEVEL = 1


class CompressingWriter(ObjectWriter):
    """Writes one zstd frame of everything written to it into ``inner``."""

    def __init__(self, inner: ObjectWriter) -> None:
        self._inner = inner
        # threads=1: zstd compresses in a thread of its own, outside the GIL, while the
        # caller's thread goes on validating; output comes back as each job of ~2 MB is done.
        self._compressor = zstandard.ZstdCompressor(level=LEVEL, threads=1).compressobj()

    def write(self, data: bytes) -> None:
        if out := self._compressor.compress(data):
            self._inner.write(out)

    def commit(self) -> None:
        self._inner.write(self._compressor.flush())
        self._inner.commit()

    def abort(self) -> None:
        self._inner.abort()


def is_compressed(data: bytes) -> bool:
    return data.startswith(MAGIC)


def decompress(data: bytes) -> bytes:
    """A stored batch's JSONL, whether it was stored compressed or not."""
    if not is_compressed(data):
        return data
    # A streamed frame does not record its size up front: read it as a stream.
    with zstandard.ZstdDecompressor().stream_reader(data) as reader:
        return reader.read()


def decompress_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A stored batch's JSONL in chunks, from the object's chunks, compressed or not."""
    first, whole = _peek(chunks)
    if not is_compressed(first):
        yield from whole
        return
    # Pieces of at most CHUNK_BYTES out, however well the batch compressed (a batch of one
    # group repeated shrinks a thousandfold: one chunk in must not become a gigabyte out).
    yield from zstandard.ZstdDecompressor().read_to_iter(
        cast("IO[bytes]", _Reader(whole)),  # it calls read() alone
        read_size=CHUNK_BYTES,
        write_size=CHUNK_BYTES,
    )


def for_client(chunks: Iterator[bytes], *, accept_encoding: str) -> tuple[Iterator[bytes], bool]:
    """A stored batch's chunks for an HTTP client, and whether they are zstd-encoded: as
    stored when the client's ``Accept-Encoding`` takes zstd (httpx does when the
    ``zstandard`` package is installed, as it is on workers), else decompressed here."""
    first, whole = _peek(chunks)
    if not is_compressed(first):
        return whole, False
    if accepts_zstd(accept_encoding):
        return whole, True
    return decompress_chunks(whole), False


class _Reader:
    """``read(size)`` over an iterator of chunks, for zstandard's readers."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._rest = b""

    def read(self, size: int = -1) -> bytes:
        while not self._rest:  # b"" only at the end: an empty chunk is not the end
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self._rest = chunk
        if size < 0:
            size = len(self._rest)
        out, self._rest = self._rest[:size], self._rest[size:]
        return out


def _peek(chunks: Iterator[bytes]) -> tuple[bytes, Iterator[bytes]]:
    """The first bytes of ``chunks`` (at least the magic number's length, unless the object
    is shorter), and all of them again."""
    first = b""
    for chunk in chunks:
        first += chunk
        if len(first) >= len(MAGIC):
            break
    return first, itertools.chain((first,), chunks)


def accepts_zstd(accept_encoding: str) -> bool:
    """Whether an ``Accept-Encoding`` header takes zstd (``zstd``, ``zstd;q=0.5``; not
    ``zstd;q=0``)."""
    for item in accept_encoding.split(","):
        coding, _, params = item.partition(";")
        if coding.strip().lower() != "zstd":
            continue
        weight = params.strip().lower().removeprefix("q=")
        try:
            return not params.strip() or float(weight) > 0
        except ValueError:
            return False
    return False

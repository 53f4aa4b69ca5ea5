"""Stored trajectory batches are zstd-compressed JSONL.

A batch (a training job's input, a logged batch) is written once and read once or twice, and
its JSON repeats itself: field names, ``"bytes":null``, token prefixes. zstd at level 1
shrinks a batch of sampled trajectories about 7x for ~1.3 s of CPU per GB, so the control
plane sends the object store a seventh of the bytes while it validates (the upload runs beside
the parser on the same cores), and workers download a seventh.

An object is recognised by its content, not its key: a zstd frame starts with the magic
number ``28 b5 2f fd``, which no JSONL line can start with. Objects written before batches
were compressed (plain JSONL) are read as they are. A compressed object must be one whole
frame: zstandard's streaming readers end quietly where their input ends, so a frame cut short
is caught here (``_FrameCheck``) and read as a ``StorageError``, never as fewer lines.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import IO, cast

import zstandard

from skytrain_backend.errors import StorageError
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
        # The checksum (XXH64 of the content) makes a flipped bit an error, not other lines.
        self._compressor = zstandard.ZstdCompressor(
            level=LEVEL, threads=1, write_checksum=True
        ).compressobj()

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
    check = _FrameCheck()
    check.feed(data)
    check.finish()
    # A streamed frame does not record its size up front: read it as a stream.
    try:
        with zstandard.ZstdDecompressor().stream_reader(data) as reader:
            return reader.read()
    except zstandard.ZstdError as exc:
        raise StorageError(f"a stored batch is corrupt: {exc}") from None


def decompress_chunks(chunks: Iterator[bytes]) -> Iterator[bytes]:
    """A stored batch's JSONL in chunks, from the object's chunks, compressed or not."""
    first, whole = _peek(chunks)
    if not is_compressed(first):
        yield from whole
        return
    reader = _Reader(whole)
    # Pieces of at most CHUNK_BYTES out, however well the batch compressed (a batch of one
    # group repeated shrinks a thousandfold: one chunk in must not become a gigabyte out).
    try:
        yield from zstandard.ZstdDecompressor().read_to_iter(
            cast("IO[bytes]", reader),  # it calls read() alone
            read_size=CHUNK_BYTES,
            write_size=CHUNK_BYTES,
        )
    except zstandard.ZstdError as exc:
        raise StorageError(f"a stored batch is corrupt: {exc}") from None
    while reader.read():  # whatever the decompressor left unread, through the check too
        pass
    reader.check.finish()


def for_client(chunks: Iterator[bytes], *, accept_encoding: str) -> tuple[Iterator[bytes], bool]:
    """A stored batch's chunks for an HTTP client, and whether they are zstd-encoded: as
    stored when the client's ``Accept-Encoding`` takes zstd (httpx does when the
    ``zstandard`` package is installed, as it is on workers), else decompressed here."""
    first, whole = _peek(chunks)
    if not is_compressed(first):
        return whole, False
    if accepts_zstd(accept_encoding):
        return whole, True
    # The first piece decompressed now, so a frame that is corrupt from its start is an error
    # before the answer's status goes out; one found cut short later breaks the answer off.
    pieces = decompress_chunks(whole)
    return itertools.chain((next(pieces, b""),), pieces), False


class _Reader:
    """``read(size)`` over an iterator of chunks, for zstandard's readers; every chunk goes
    through ``check`` as it is taken."""

    def __init__(self, chunks: Iterator[bytes]) -> None:
        self._chunks = chunks
        self._rest = b""
        self.check = _FrameCheck()

    def read(self, size: int = -1) -> bytes:
        while not self._rest:  # b"" only at the end: an empty chunk is not the end
            chunk = next(self._chunks, None)
            if chunk is None:
                return b""
            self.check.feed(chunk)
            self._rest = chunk
        if size < 0:
            size = len(self._rest)
        out, self._rest = self._rest[:size], self._rest[size:]
        return out


class _FrameCheck:
    """Follows the layout of one zstd frame (RFC 8878) over its compressed bytes as they pass,
    without decompressing: a header, then blocks that each announce their size, the last one
    marked, then a checksum when the header says so. ``finish`` raises unless exactly one
    whole frame passed."""

    def __init__(self) -> None:
        self._wanted = 5  # the magic number and the frame header's descriptor byte
        self._head = b""  # the bytes of the header (frame or block) being read
        self._skip = 0  # bytes of a block's content (and the checksum) still to pass
        self._reading = "frame"  # "frame" header, then "block" headers, then "end"
        self._checksum = False

    def feed(self, data: bytes) -> None:
        at = 0
        while at < len(data):
            if self._skip:
                passed = min(self._skip, len(data) - at)
                self._skip -= passed
                at += passed
                continue
            if self._reading == "end":
                raise StorageError("a stored batch is corrupt: bytes follow its zstd frame")
            taken = data[at : at + self._wanted - len(self._head)]
            self._head += taken
            at += len(taken)
            if len(self._head) == self._wanted:
                self._read_head()

    def _read_head(self) -> None:
        head = self._head
        if self._reading == "frame" and self._wanted == 5:
            descriptor = head[4]
            if head[:4] != MAGIC or descriptor & 0x08:  # the reserved bit must be 0
                raise StorageError("a stored batch is corrupt: not a zstd frame")
            content_size_flag, single_segment = descriptor >> 6, bool(descriptor & 0x20)
            self._checksum = bool(descriptor & 0x04)
            self._wanted += (
                (0 if single_segment else 1)  # the window descriptor
                + (0, 1, 2, 4)[descriptor & 0x03]  # the dictionary id
                + (int(single_segment), 2, 4, 8)[content_size_flag]  # the content size
            )
            if len(head) < self._wanted:
                return
        elif self._reading == "block":
            header = int.from_bytes(head, "little")
            last, kind, size = header & 1, (header >> 1) & 3, header >> 3
            if kind == 3:
                raise StorageError("a stored batch is corrupt: a zstd block of reserved type")
            self._skip = 1 if kind == 1 else size  # an RLE block holds one byte
            if last:
                self._reading = "end"
                self._skip += 4 if self._checksum else 0
                self._head = b""
                return
        self._reading, self._wanted, self._head = "block", 3, b""

    def finish(self) -> None:
        if self._reading != "end" or self._skip:
            raise StorageError(
                "a stored batch is cut short: its zstd frame ends before its last block"
            )


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

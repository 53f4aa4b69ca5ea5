"""The object store as a local directory: the embedded default (``file://$SKYTRAIN_HOME/objects``).

Writes go to a temporary file in the destination directory and are renamed into place, so a
reader never sees half an object and a crash leaves at most a stray ``.tmp-*`` file, which
listing ignores and ``abort_stale_uploads`` removes.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import IO, BinaryIO

from skytrain_backend.errors import ObjectMissing, StorageError
from skytrain_backend.storage.base import (
    CHUNK_BYTES,
    ObjectInfo,
    ObjectStore,
    ObjectWriter,
    check_key,
)
from skytrain_backend.storage.keys import TENANTS_PREFIX

_TEMP_PREFIX = ".tmp-"


class LocalObjectStore(ObjectStore):
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    @property
    def url(self) -> str:
        return self.root.as_uri()

    def _path(self, key: str) -> Path:
        path = (self.root / check_key(key)).resolve()
        if not path.is_relative_to(self.root):
            raise StorageError(f"object key {key!r} points outside the store at {self.root}")
        return path

    def _existing(self, key: str) -> Path:
        path = self._path(key)
        if not path.is_file():
            raise ObjectMissing(f"object {key!r} does not exist in {self.url}")
        return path

    def put_bytes(self, key: str, data: bytes) -> None:
        self._write(key, lambda out: out.write(data))

    def put_stream(self, key: str, stream: BinaryIO) -> None:
        self._write(key, lambda out: shutil.copyfileobj(stream, out, CHUNK_BYTES))

    def _write(self, key: str, fill: Callable[[IO[bytes]], object]) -> None:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
            try:
                with os.fdopen(fd, "wb") as out:
                    fill(out)
                os.replace(temp_name, path)
            except BaseException:
                Path(temp_name).unlink(missing_ok=True)
                raise
        except OSError as exc:
            raise StorageError(f"could not write object {key!r} under {self.root}: {exc}") from exc

    def open_writer(self, key: str) -> ObjectWriter:
        path = self._path(key)
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            fd, temp_name = tempfile.mkstemp(dir=path.parent, prefix=_TEMP_PREFIX)
        except OSError as exc:
            raise StorageError(f"could not write object {key!r} under {self.root}: {exc}") from exc
        return _LocalWriter(
            key, path, Path(temp_name), os.fdopen(fd, "wb"), prune=self._prune_empty_dirs
        )

    def get_bytes(self, key: str) -> bytes:
        return self._existing(key).read_bytes()

    def iter_chunks(self, key: str, *, chunk_size: int = CHUNK_BYTES) -> Iterator[bytes]:
        stream = self._existing(key).open("rb")

        def chunks() -> Iterator[bytes]:
            with stream:
                while chunk := stream.read(chunk_size):
                    yield chunk

        return chunks()

    def download_file(self, key: str, path: Path) -> None:
        source = self._existing(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(source, path)

    def copy(self, source_key: str, dest_key: str) -> int:
        source = self._existing(source_key)
        with source.open("rb") as stream:
            self.put_stream(dest_key, stream)
        return source.stat().st_size

    def exists(self, key: str) -> bool:
        return self._path(key).is_file()

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        # Walk only the deepest directory the prefix names, then filter by the full prefix.
        directory = prefix.rpartition("/")[0]
        start = self._path(directory) if directory else self.root
        if not start.is_dir():
            return []
        found = []
        for dirpath, _, filenames in os.walk(start):
            for filename in filenames:
                if filename.startswith(_TEMP_PREFIX):
                    continue
                path = Path(dirpath, filename)
                key = path.relative_to(self.root).as_posix()
                if key.startswith(prefix):
                    stat = path.stat()
                    modified = datetime.fromtimestamp(stat.st_mtime, UTC)
                    found.append(ObjectInfo(key=key, size=stat.st_size, modified=modified))
        return sorted(found, key=lambda info: info.key)

    def delete(self, key: str) -> None:
        path = self._path(key)
        try:
            path.unlink(missing_ok=True)
        except OSError as exc:
            raise StorageError(f"could not delete object {key!r}: {exc}") from exc
        self._prune_empty_dirs(path.parent)

    def abort_stale_uploads(self, *, started_before: datetime) -> int:
        # A temporary file's age is its last write's: one still being written is never stale.
        removed = 0
        for dirpath, _, filenames in os.walk(self.root / TENANTS_PREFIX):
            for filename in filenames:
                if not filename.startswith(_TEMP_PREFIX):
                    continue
                path = Path(dirpath, filename)
                try:
                    if datetime.fromtimestamp(path.stat().st_mtime, UTC) >= started_before:
                        continue
                    path.unlink()
                except FileNotFoundError:
                    continue  # finished (renamed) or removed meanwhile
                except OSError as exc:
                    stale = path.relative_to(self.root).as_posix()
                    raise StorageError(f"could not remove stale upload {stale!r}: {exc}") from exc
                removed += 1
                self._prune_empty_dirs(path.parent)
        return removed

    def _prune_empty_dirs(self, directory: Path) -> None:
        """Remove directories left empty, so deleted models leave no trace behind."""
        while directory != self.root and directory.is_relative_to(self.root):
            try:
                directory.rmdir()
            except OSError:
                return
            directory = directory.parent


class _LocalWriter(ObjectWriter):
    """Writes a temporary file beside the object and renames it into place on commit."""

    def __init__(
        self, key: str, path: Path, temp: Path, out: IO[bytes], *, prune: Callable[[Path], None]
    ) -> None:
        self._key, self._path, self._temp, self._out = key, path, temp, out
        self._prune = prune
        self._done = False

    def write(self, data: bytes) -> None:
        try:
            self._out.write(data)
        except OSError as exc:
            raise StorageError(f"could not write object {self._key!r}: {exc}") from exc

    def commit(self) -> None:
        try:
            self._out.close()
            os.replace(self._temp, self._path)
        except OSError as exc:
            raise StorageError(f"could not write object {self._key!r}: {exc}") from exc
        self._done = True

    def abort(self) -> None:
        """Remove what was written, and the directories made for it if nothing else is there.
        Never raises: it runs while another error is on its way to the client."""
        if self._done:
            return
        self._done = True
        with contextlib.suppress(OSError):  # a flush failing on a full disk, say
            self._out.close()
        with contextlib.suppress(OSError):
            self._temp.unlink(missing_ok=True)
        self._prune(self._path.parent)

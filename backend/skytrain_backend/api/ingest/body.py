"""The request body of a bulk request: spooled as it arrives, split in one pass, each item
validated alone.

Its bytes are spooled (in memory up to 1 MiB, then in a temporary file); one pass of msgspec's
C parser splits it into its small fields and the raw bytes of each item of its list
(``trajectory_groups``, ``trajectories``); each item is then decoded by msgspec into the
Structs of ``api.trajectory_structs``, and an item msgspec refuses is validated by pydantic's
models, which name the problem, or accept what msgspec's stricter types did not.
"""

from __future__ import annotations

import contextlib
import functools
import io
import mmap
import re
import tempfile
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar

import ijson
import msgspec
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from typing_extensions import Buffer

from skytrain_backend.api import trajectory_structs as structs
from skytrain_backend.errors import InvalidRequest, PayloadTooLarge
from skytrain_backend.protocol import (
    Message,
    Trajectory,
    TrajectoryGroup,
    format_validation_error,
)
from skytrain_backend.storage import ObjectStore

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)
# A group or trajectory as read: msgspec's Struct, or pydantic's model when msgspec refused it.
Group = structs.TrajectoryGroup | TrajectoryGroup
AnyTrajectory = structs.Trajectory | Trajectory

# Bodies and outputs up to this size stay in memory; larger ones go to a temporary file.
SPOOL_IN_MEMORY_BYTES = 1024 * 1024
# The fields of a bulk body besides its list: a model id, a config, a split...
MAX_FIELDS_BYTES = 1024 * 1024


def check_count(num_trajectories: int, *, limit: int) -> None:
    if num_trajectories > limit:
        raise PayloadTooLarge(
            f"the request holds more than {limit} trajectories, the limit "
            "(SKYTRAIN_MAX_TRAJECTORIES_PER_REQUEST): split it into several requests"
        )


class Spool:
    """Bytes written in pieces: kept in memory up to 1 MiB, then in a temporary file."""

    def __init__(self) -> None:
        self._memory = bytearray()
        self._file: IO[bytes] | None = None
        self.size = 0

    def write(self, data: bytes) -> None:
        self.size += len(data)
        if self._file is None and self.size <= SPOOL_IN_MEMORY_BYTES:
            self._memory += data
            return
        if self._file is None:
            # Named: the store uploads it by path, reading one part at a time.
            self._file = tempfile.NamedTemporaryFile()  # noqa: SIM115 - closed by close()
            self._file.write(self._memory)
            self._memory = bytearray()
        self._file.write(data)

    @contextlib.contextmanager
    def view(self) -> Iterator[Buffer]:
        """The bytes: a copy while they are in memory, a memory map of the file after."""
        if self._file is None:
            yield bytes(self._memory)
            return
        self._file.flush()
        mapped = mmap.mmap(self._file.fileno(), 0, access=mmap.ACCESS_READ)
        try:
            yield mapped
        finally:
            # Items still referenced (by an exception's traceback) keep the map open; it
            # closes itself once they are gone.
            with contextlib.suppress(BufferError):
                mapped.close()

    def put(self, store: ObjectStore, key: str) -> None:
        """Write the bytes to ``store`` at ``key``; a file goes up part by part from disk."""
        if self._file is None:
            store.put_bytes(key, bytes(self._memory))
            return
        self._file.flush()
        store.put_file(key, Path(self._file.name))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
        self._memory = bytearray()


async def read_body(request: Request) -> Spool:
    """The request's body, spooled. Its size and time limits are the middleware's
    (``api.admission.limits``), applied as the bytes arrive."""
    spool = Spool()
    try:
        async for chunk in request.stream():
            spool.write(chunk)
    except BaseException:
        spool.close()
        raise
    return spool


def split_body(
    buffer: Buffer, *, schema: type[M], list_field: str
) -> tuple[M, list[msgspec.Raw] | None]:
    """The body's fields validated by ``schema`` (its list left empty), and the raw bytes of
    each item of ``list_field`` (None when the body has no such field)."""
    split = _split_at_once(buffer, schema=schema, list_field=list_field)
    # When the body is not as expected, the way that says why.
    fields, raw_items = _split_exactly(buffer, list_field=list_field) if split is None else split
    if raw_items is not None:
        fields.append(msgspec.json.encode(list_field) + b":[]")
    document = b"{" + b",".join(fields) + b"}"
    if len(document) > MAX_FIELDS_BYTES:
        raise PayloadTooLarge(
            f"the fields besides {list_field} take {len(document)} bytes, more than "
            f"{MAX_FIELDS_BYTES}: send the data in {list_field}"
        )
    try:
        header = schema.model_validate_json(document)
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc)) from None
    if raw_items is None or isinstance(raw_items, list):
        return header, raw_items
    try:
        return header, msgspec.json.decode(raw_items, type=list[msgspec.Raw])
    except msgspec.ValidationError:
        raise InvalidRequest(f"{list_field}: Input should be a valid list") from None


def _split_at_once(
    buffer: Buffer, *, schema: type[BaseModel], list_field: str
) -> tuple[list[bytes], list[msgspec.Raw] | None] | None:
    """The body's fields (``"name":value``, those ``schema`` knows) and the raw bytes of each
    item of its list, found in one pass of the parser; None when the body is not an object
    with a list there (or has more than the fields' limit besides its items), for
    ``_split_exactly`` to say why."""
    decoder = _top_level_struct(schema, list_field)
    if decoder is None:
        return None
    try:
        top = decoder.decode(buffer)
    except (msgspec.MsgspecError, RecursionError):
        return None
    items = getattr(top, list_field)
    # Everything besides the items (fields it ignores included) within the fields' limit.
    items_size = 0 if items is msgspec.UNSET else sum(len(item) for item in items)
    if memoryview(buffer).nbytes - items_size > MAX_FIELDS_BYTES:
        return None
    fields = [
        msgspec.json.encode(name) + b":" + bytes(value)
        for name in top.__struct_fields__
        if name != list_field and (value := getattr(top, name)) is not msgspec.UNSET
    ]
    return fields, None if items is msgspec.UNSET else items


@functools.cache
def _top_level_struct(schema: type[BaseModel], list_field: str) -> msgspec.json.Decoder[Any] | None:
    """A decoder of a body with ``schema``'s fields as raw bytes and its list as raw items;
    fields it does not know are skipped unread (as the schema ignores them: their bytes are
    not even checked to be UTF-8). None for a schema that does anything with unknown fields
    (refuses or keeps them), reads a field under other names, or validates the body as a
    whole before its fields: its bodies take the exact way."""
    config = schema.model_config
    if config.get("extra") in ("forbid", "allow") or config.get("populate_by_name"):
        return None
    if schema.__pydantic_decorators__.model_validators:
        return None
    if any(field.validation_alias is not None for field in schema.model_fields.values()):
        return None
    fields: list[tuple[str, Any, Any]] = [
        (field.alias or name, msgspec.Raw, msgspec.UNSET)
        for name, field in schema.model_fields.items()
        if name != list_field
    ]
    fields.append((list_field, list[msgspec.Raw] | msgspec.UnsetType, msgspec.UNSET))
    return msgspec.json.Decoder(msgspec.defstruct(f"{schema.__name__}Top", fields))


def _split_exactly(buffer: Buffer, *, list_field: str) -> tuple[list[bytes], msgspec.Raw | None]:
    """Every field of the body as ``"name":value``, and its list's raw bytes (None without);
    refuses a body that is not a JSON object, naming why."""
    try:
        top = msgspec.json.decode(buffer, type=dict[str, msgspec.Raw])
    except msgspec.ValidationError:
        raise InvalidRequest("the body must be a JSON object") from None
    except msgspec.DecodeError as exc:
        raise InvalidRequest(_not_json(buffer, exc)) from None
    except RecursionError:
        raise InvalidRequest(
            "the body nests arrays and objects too deeply to read (about a thousand levels): "
            "trajectories are never that deep; flatten what it holds"
        ) from None
    raw_items = top.pop(list_field, None)
    return [msgspec.json.encode(key) + b":" + bytes(value) for key, value in top.items()], raw_items


def each_item(
    items: Sequence[msgspec.Raw], parse: Callable[[Buffer, str], T], *, field: str
) -> Iterator[T]:
    """Each item parsed alone by ``parse(raw, where)`` (its bytes read where they lie in the
    body, not copied); refuses an empty list."""
    if not items:
        raise InvalidRequest(f"{field} is empty: send at least one item")
    for index, raw in enumerate(items):
        yield parse(raw, f"{field}[{index}]")


def parse_group(raw: Buffer, where: str) -> Group:
    try:
        return structs.GROUP_DECODER.decode(raw)
    except (msgspec.MsgspecError, RecursionError):
        pass  # pydantic says why, or takes what only its lax mode accepts
    try:
        return TrajectoryGroup.model_validate_json(bytes(raw))
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc, root=where)) from None


def parse_trajectory(raw: Buffer | str, where: str) -> AnyTrajectory:
    """An SFT trajectory: it must hold an assistant turn to learn from."""
    trajectory: AnyTrajectory
    try:
        trajectory = structs.TRAJECTORY_DECODER.decode(raw)
        if structs.has_assistant_turn(trajectory):
            return trajectory
    except (msgspec.MsgspecError, RecursionError):
        try:
            trajectory = Trajectory.model_validate_json(raw if isinstance(raw, str) else bytes(raw))
        except ValidationError as exc:
            raise InvalidRequest(format_validation_error(exc, root=where)) from None
        for item in trajectory.messages_and_choices:
            if not isinstance(item, Message) or item.role == "assistant":
                return trajectory
    raise InvalidRequest(
        f"{where}: messages_and_choices has no assistant turn, so there is nothing to learn: "
        "end the conversation with the assistant's answer"
    )


def _not_json(buffer: Buffer, error: msgspec.DecodeError) -> str:
    """Why the body is not JSON. NaN and Infinity (which Python's json writes) are named with
    the field that holds them, found by re-reading the body up to them."""
    found = re.search(r"\s*\(byte (\d+)\)", str(error))
    reason = str(error).replace(found.group(0), "") if found else str(error)
    if found is None:
        return f"the body is not valid JSON ({reason})"
    position = int(found.group(1))
    if bytes(memoryview(buffer)[position : position + 3]) in (b"NaN", b"Inf", b"-In"):
        path = _path_to_first_error(buffer)
        return f"{path}: Input should be a finite number (NaN and Infinity are not JSON numbers)"
    return f"the body is not valid JSON ({reason} at byte {position})"


def _path_to_first_error(buffer: Buffer) -> str:
    """The JSON path (``trajectory_groups[1].reward``) of the value the parser stopped at."""
    if isinstance(buffer, mmap.mmap):
        buffer.seek(0)
    source = buffer if isinstance(buffer, mmap.mmap) else io.BytesIO(buffer)
    path: list[str | int | None] = []

    def next_value() -> None:
        if path and isinstance(path[-1], int):
            path[-1] += 1

    with contextlib.suppress(ijson.JSONError):
        for event, value in ijson.basic_parse(source, use_float=True):
            if event == "map_key":
                path[-1] = value
            elif event in ("start_map", "start_array"):
                next_value()
                path.append(None if event == "start_map" else -1)
            elif event in ("end_map", "end_array"):
                path.pop()
            else:
                next_value()
    next_value()
    text = ""
    for part in path:
        if isinstance(part, int):
            text += f"[{part}]"
        elif part is not None:
            text += f".{part}" if text else part
    return text or "body"

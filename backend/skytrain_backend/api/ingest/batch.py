"""The batch written to the store: validated items as JSONL lines, then stored atomically.

Each item is written as one JSONL line (the model's ``model_dump_json``, or msgspec's encoder
for a Struct) straight to the object store or to a spool. A batch is stored atomically from
the client's point of view: on S3 a batch of up to 16 MiB stored goes up in one PUT once
everything is valid; a larger one goes up as it is validated, as a multipart upload that
becomes an object only then (and is aborted otherwise); then the rows are inserted in one
transaction; if the transaction fails the object is deleted again.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Iterable
from typing import Any, TypeVar

import msgspec
from pydantic import BaseModel
from sqlalchemy.orm import Session

from skytrain_backend.api import trajectory_structs as structs
from skytrain_backend.api.ingest.body import (
    AnyTrajectory,
    Group,
    Spool,
    check_count,
    parse_trajectory,
)
from skytrain_backend.db.tenants import StorageReservation
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import (
    TrajectoryGroup,
    count_trainable_turns,
)
from skytrain_backend.storage import ObjectStore, ObjectWriter, compression

logger = logging.getLogger(__name__)
T = TypeVar("T")


_ENCODER = msgspec.json.Encoder()


class IngestBatch:
    """Validated items as JSONL (``model_dump(mode="json")``, one per line), with a count of
    trajectories that refuses the request as soon as it passes ``limit``.

    The lines are spooled, or, once ``stream_to`` named the object they become, written
    straight to the store as they are made (on S3, past 16 MiB compressed, a multipart upload
    in a thread, beside the validation), and nothing is visible at the key until
    ``store_then_commit`` commits it. ``close`` drops whatever was not committed.

    With a ``reservation`` (of the tenant's storage quota), each line is reserved before it
    is written, and a batch that grows past what the tenant may still store is refused (403)
    before that line reaches the store (or the part of an S3 multipart upload it would go up
    in): a tenant at its quota costs the store nothing, and concurrent uploads of one tenant
    together never pass it. ``close`` gives back what a batch not committed had reserved.
    """

    def __init__(self, *, limit: int, reservation: StorageReservation | None = None) -> None:
        self.limit = limit
        self.reservation = reservation
        self.spool = Spool()
        self.writer: ObjectWriter | None = None
        self.num_items = 0
        self.num_trajectories = 0
        self.num_bytes = 0  # the JSONL's, what its tenant's storage quota counts

    def stream_to(self, store: ObjectStore, key: str) -> None:
        """Write every line from now on to a new object at ``key`` in ``store``."""
        self.write_to(store.open_writer(key))

    def write_to(self, writer: ObjectWriter) -> None:
        """Write every line from now on, compressed, to ``writer`` (committed or aborted with
        the batch)."""
        assert self.writer is None and self.spool.size == 0, "write_to comes before add"
        self.writer = compression.CompressingWriter(writer)

    @property
    def output(self) -> Spool | ObjectWriter:
        return self.spool if self.writer is None else self.writer

    def add(self, item: Group | AnyTrajectory) -> None:
        self.num_items += 1
        if isinstance(item, structs.TrajectoryGroup | TrajectoryGroup):
            self.num_trajectories += len(item.trajectories)
        else:
            self.num_trajectories += 1
        check_count(self.num_trajectories, limit=self.limit)
        if isinstance(item, BaseModel):
            line = item.model_dump_json().encode() + b"\n"
        else:
            line = _ENCODER.encode(item) + b"\n"
        if self.reservation is not None:
            self.reservation.check(self.num_bytes + len(line))
        self.num_bytes += len(line)
        self.output.write(line)

    def close(self) -> None:
        self.spool.close()
        if self.writer is not None:
            self.writer.abort()  # nothing, once committed
        if self.reservation is not None:
            self.reservation.release()  # nothing, once committed


def trainable_turns(group: Group, index: int, *, allow_training_without_logprobs: bool) -> int:
    """The turns of group ``index`` the RL trainer can learn from; refuses a choice it cannot."""
    if isinstance(group, structs.TrajectoryGroup):
        return structs.count_trainable_turns(
            group, index, allow_training_without_logprobs=allow_training_without_logprobs
        )
    return count_trainable_turns(
        group, index, allow_training_without_logprobs=allow_training_without_logprobs
    )


def groups_from_jsonl(data: bytes) -> list[dict[str, Any]]:
    return [json.loads(line) for line in data.splitlines() if line.strip()]


def parse_trajectory_lines(lines: Iterable[bytes], batch: IngestBatch) -> None:
    """Validate a JSONL upload into ``batch``: one trajectory per line; errors name the line."""
    for number, line in enumerate(lines, start=1):
        if line.strip():
            batch.add(parse_trajectory(line, f"line {number}"))
    if not batch.num_items:
        raise InvalidRequest("the file holds no trajectories: send one JSON trajectory per line")


def store_then_commit(
    store: ObjectStore,
    session: Session,
    *,
    key: str,
    data: bytes | Spool | ObjectWriter,
    insert: Callable[[str], T],
    reservation: StorageReservation | None = None,
) -> T:
    """Write ``data`` at ``key`` (or commit the writer streaming to it), then run
    ``insert(uri)`` and commit (with the bytes that ``reservation`` took for ``data`` kept in
    its tenant's total); undo the write on failure."""
    if isinstance(data, bytes):
        store.put_bytes(key, data)
    elif isinstance(data, Spool):
        data.put(store, key)
    else:
        data.commit()
    try:
        result = insert(store.uri(key))
        if reservation is None:
            session.commit()
        else:
            reservation.commit()
    except BaseException:
        session.rollback()
        try:
            store.delete(key)
        except Exception:
            logger.exception("could not delete %s after a failed insert; it is orphaned", key)
        raise
    return result

"""Rows whose objects are gone or damaged: found when they are read, and listed on demand.

The database says what the store should hold: a live checkpoint's files (their total size
is its ``size_bytes``), a logged batch's JSONL, a pending job's input, an uploaded file. An object deleted or
cut short after its row was committed (by hand, by a store that lost it, by a bucket rule)
would otherwise go unnoticed until a model failed to load.

- ``checkpoint_files``: the files of a checkpoint as a reader gets them, or ``ObjectDamaged``
  naming the checkpoint when what the store holds is not what was committed.
- ``check_storage``: every row of the database checked against the store, for the operator
  (``skytrain storage check``). One listing per model prefix and per tenant with files; with
  ``read``, each recorded checkpoint file and uploaded file read back and hashed.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass, replace

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import (
    Checkpoint,
    CommittedFile,
    Model,
    TrainingJob,
    TrajectoryBatch,
    UploadedFile,
)
from skytrain_backend.errors import ObjectDamaged
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES
from skytrain_backend.protocol.worker import ListedFile
from skytrain_backend.storage import ObjectStore, keys


@dataclass(frozen=True)
class Problem:
    """A row whose object is ``missing``, of the ``wrong size`` or (read back) ``corrupt``."""

    kind: str  # "checkpoint", "batch", "job input", "file"
    row_id: str
    model_id: str  # "" for a file (the tenant's, not a model's)
    key: str
    state: str
    expected_size: int | None = None
    found_size: int | None = None


@dataclass(frozen=True)
class Committed:
    """What a checkpoint was committed with: its files' total size, and each file's name,
    size and SHA-256 where the row records them (rows older than that record none)."""

    size_bytes: int
    files: tuple[CommittedFile, ...] | None
    uri: str  # where its files lie (keys.committed_prefix)


def committed(checkpoint: Checkpoint) -> Committed | None:
    """What ``checkpoint_files`` checks a checkpoint's files against: None for one with no
    files of its own (step 0 is the base model)."""
    if checkpoint.step == 0 or checkpoint.uri is None:
        return None
    files = None if checkpoint.files is None else tuple(checkpoint.files)
    return Committed(size_bytes=checkpoint.size_bytes, files=files, uri=checkpoint.uri)


def files_prefix(*, tenant_id: str, model_id: str, step: int, expected: Committed | None) -> str:
    """Where the checkpoint's files lie: the directory its row records (a committing
    attempt's own), or the step's for a checkpoint with no files."""
    if expected is None:
        return keys.checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step)
    return keys.committed_prefix(tenant_id=tenant_id, model_id=model_id, uri=expected.uri)


def checkpoint_files(
    store: ObjectStore, *, tenant_id: str, model_id: str, step: int, expected: Committed | None
) -> dict[str, ListedFile]:
    """The checkpoint's files as the store holds them, ``{name: {"name", "size"}}`` (with the
    committed ``sha256`` where recorded): ``ObjectDamaged`` when a file is gone or not the
    size committed (or, for rows that record no files, when the total differs)."""
    prefix = files_prefix(tenant_id=tenant_id, model_id=model_id, step=step, expected=expected)
    stored = {info.key.removeprefix(prefix): info.size for info in store.list(prefix)}
    files = {name: ListedFile(name=name, size=size) for name, size in stored.items()}
    if expected is None:
        return files
    wrong = []
    if expected.files is not None:
        for item in expected.files:
            size = stored.get(item["name"])
            if size is None:
                wrong.append(f"{item['name']} is missing")
            elif size != item["size"]:
                wrong.append(f"{item['name']} holds {size} bytes, not {item['size']}")
            else:
                files[item["name"]]["sha256"] = item["sha256"]
    elif sum(stored.values()) != expected.size_bytes:
        found = "no file" if not stored else f"{len(stored)} files of {sum(stored.values())} bytes"
        wrong.append(f"its files hold {expected.size_bytes} bytes, the store {found}")
    if wrong:
        raise ObjectDamaged(
            f"step {step} of model {model_id} is damaged in the object store since its commit "
            f"({'; '.join(wrong)}) and cannot be loaded. Use another step (or delete this "
            "one); the operator's `skytrain storage check` lists every such row"
        )
    return files


def check_storage(session: Session, *, store: ObjectStore, read: bool = False) -> Iterator[Problem]:
    """Every live checkpoint, logged batch and unfinished job's input whose object is
    missing or not the size recorded, model by model, then every uploaded file whose object is
    missing or not the size recorded, tenant by tenant; with ``read``, also every checkpoint
    file and uploaded file whose SHA-256 is not the one recorded (each read back). No
    transaction is open while the store works."""
    models = session.execute(select(Model.id, Model.tenant_id).order_by(Model.created_at)).all()
    for model_id, tenant_id in models:
        checkpoints = [
            (checkpoint.id, checkpoint.step, committed(checkpoint))
            for checkpoint in session.scalars(
                select(Checkpoint).where(
                    Checkpoint.model_id == model_id,
                    Checkpoint.step > 0,
                    Checkpoint.uri.is_not(None),
                    Checkpoint.deleted_at.is_(None),
                )
            )
        ]
        batches = list(
            session.scalars(select(TrajectoryBatch.id).where(TrajectoryBatch.model_id == model_id))
        )
        jobs = list(
            session.scalars(
                select(TrainingJob.id).where(
                    TrainingJob.model_id == model_id,
                    TrainingJob.kind.in_(("rl", "sft")),
                    TrainingJob.status.not_in(TERMINAL_JOB_STATUSES),
                )
            )
        )
        session.rollback()
        stored = {
            info.key: info.size
            for info in store.list(keys.model_prefix(tenant_id=tenant_id, model_id=model_id))
        }
        for row_id, step, expected in checkpoints:
            prefix = files_prefix(
                tenant_id=tenant_id, model_id=model_id, step=step, expected=expected
            )
            found = Problem("checkpoint", row_id, model_id, prefix, "")
            yield from _checkpoint(store, stored, found, expected, read=read)
        for batch_id in batches:
            key = keys.log_key(tenant_id=tenant_id, model_id=model_id, batch_id=batch_id)
            if key not in stored:
                yield Problem("batch", batch_id, model_id, key, "missing")
        for job_id in jobs:
            key = keys.job_input_key(tenant_id=tenant_id, model_id=model_id, job_id=job_id)
            if key not in stored:
                yield Problem("job input", job_id, model_id, key, "missing")
    yield from _uploaded_files(session, store=store, read=read)


def _uploaded_files(session: Session, *, store: ObjectStore, read: bool) -> Iterator[Problem]:
    """Each uploaded file whose object is missing or not the size recorded; with ``read``, also
    each one whose bytes are not the SHA-256 recorded at upload (where one was)."""
    files: defaultdict[str, list[tuple[str, int, str | None]]] = defaultdict(list)
    for file_id, tenant_id, size_bytes, sha256 in session.execute(
        select(
            UploadedFile.id, UploadedFile.tenant_id, UploadedFile.size_bytes, UploadedFile.sha256
        )
    ):
        files[tenant_id].append((file_id, size_bytes, sha256))
    session.rollback()
    for tenant_id, rows in files.items():
        stored = {info.key: info.size for info in store.list(keys.files_prefix(tenant_id))}
        for file_id, size_bytes, sha256 in rows:
            key = keys.file_key(tenant_id=tenant_id, file_id=file_id)
            size = stored.get(key)
            problem = Problem("file", file_id, "", key, "", size_bytes, size)
            if size is None:
                yield replace(problem, state="missing")
            elif size != size_bytes:
                yield replace(problem, state="wrong size")
            elif read and sha256 is not None and store.digest(key).sha256 != sha256:
                yield replace(problem, state="corrupt")


def _checkpoint(
    store: ObjectStore,
    stored: dict[str, int],
    found: Problem,
    expected: Committed | None,
    *,
    read: bool,
) -> Iterator[Problem]:
    """The checkpoint's problems: ``found`` with its key, state and sizes filled in."""
    if expected is None:
        return
    if expected.files is None:  # a row from before files were recorded: its total
        sizes = [size for key, size in stored.items() if key.startswith(found.key)]
        if not sizes or sum(sizes) != expected.size_bytes:
            state = "missing" if not sizes else "wrong size"
            yield replace(
                found,
                state=state,
                expected_size=expected.size_bytes,
                found_size=sum(sizes) if sizes else None,
            )
        return
    for item in expected.files:
        key = found.key + item["name"]
        size = stored.get(key)
        problem = replace(found, key=key, expected_size=item["size"], found_size=size)
        if size is None:
            yield replace(problem, state="missing")
        elif size != item["size"]:
            yield replace(problem, state="wrong size")
        elif read and store.digest(key).sha256 != item["sha256"]:
            yield replace(problem, state="corrupt")

"""Rows whose objects are gone or damaged: found when they are read, and listed on demand.

The database says what the store should hold: a live checkpoint's files (their total size
is its ``size_bytes``), a logged batch's JSONL, a pending job's input. An object deleted or
cut short after its row was committed (by hand, by a store that lost it, by a bucket rule)
would otherwise go unnoticed until a model failed to load.

- ``checkpoint_files``: the files of a checkpoint as a reader gets them, or ``ObjectDamaged``
  naming the checkpoint when what the store holds is not what was committed.
- ``check_storage``: every row of the database checked against the store, for the operator
  (``skytrain storage check``). One listing per model prefix, no object read.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Checkpoint, Model, TrainingJob, TrajectoryBatch
from skytrain_backend.errors import ObjectDamaged
from skytrain_backend.protocol import TERMINAL_JOB_STATUSES
from skytrain_backend.storage import ObjectStore, keys


@dataclass(frozen=True)
class Problem:
    """A row whose object is missing (``found`` None) or not the size recorded."""

    kind: str  # "checkpoint", "batch", "job input"
    row_id: str
    model_id: str
    key: str
    expected_size: int | None
    found_size: int | None

    @property
    def state(self) -> str:
        return "missing" if self.found_size is None else "wrong size"


def committed_bytes(checkpoint: Checkpoint) -> int | None:
    """What ``checkpoint_files`` checks a checkpoint's files against: None for one with no
    files of its own (step 0 is the base model)."""
    return None if checkpoint.step == 0 or checkpoint.uri is None else checkpoint.size_bytes


def checkpoint_files(
    store: ObjectStore, *, tenant_id: str, model_id: str, step: int, committed: int | None
) -> dict[str, int]:
    """The checkpoint's files and their sizes, as the store holds them: ``ObjectDamaged``
    when they are gone or do not add up to the ``committed`` size (``committed_bytes``)."""
    prefix = keys.checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step)
    files = {info.key.removeprefix(prefix): info.size for info in store.list(prefix)}
    total = sum(files.values())
    if committed is not None and total != committed:
        found = "no file" if not files else f"{len(files)} files of {total} bytes"
        raise ObjectDamaged(
            f"step {step} of model {model_id} was committed with {committed} bytes of "
            f"files, but the object store holds {found}: it was lost or damaged after its "
            "commit and cannot be loaded. Use another step (or delete this one); the "
            "operator's `skytrain storage check` lists every such row"
        )
    return files


def check_storage(session: Session, *, store: ObjectStore) -> Iterator[Problem]:
    """Every live checkpoint, logged batch and unfinished job's input whose object is
    missing or not the size recorded, model by model."""
    models = session.execute(select(Model.id, Model.tenant_id).order_by(Model.created_at)).all()
    for model_id, tenant_id in models:
        prefix = keys.model_prefix(tenant_id=tenant_id, model_id=model_id)
        stored = {info.key: info.size for info in store.list(prefix)}
        yield from _checkpoints(session, stored, tenant_id=tenant_id, model_id=model_id)
        yield from _inputs(session, stored, tenant_id=tenant_id, model_id=model_id)
    session.rollback()


def _checkpoints(
    session: Session, stored: dict[str, int], *, tenant_id: str, model_id: str
) -> Iterator[Problem]:
    rows = session.scalars(
        select(Checkpoint).where(
            Checkpoint.model_id == model_id,
            Checkpoint.step > 0,
            Checkpoint.uri.is_not(None),
            Checkpoint.deleted_at.is_(None),
        )
    )
    for checkpoint in rows:
        prefix = keys.checkpoint_prefix(
            tenant_id=tenant_id, model_id=model_id, step=checkpoint.step
        )
        sizes = [size for key, size in stored.items() if key.startswith(prefix)]
        if sizes and sum(sizes) == checkpoint.size_bytes:
            continue
        yield Problem(
            kind="checkpoint",
            row_id=checkpoint.id,
            model_id=model_id,
            key=prefix,
            expected_size=checkpoint.size_bytes,
            found_size=sum(sizes) if sizes else None,
        )


def _inputs(
    session: Session, stored: dict[str, int], *, tenant_id: str, model_id: str
) -> Iterator[Problem]:
    batches = session.scalars(
        select(TrajectoryBatch.id).where(TrajectoryBatch.model_id == model_id)
    )
    for batch_id in batches:
        key = keys.log_key(tenant_id=tenant_id, model_id=model_id, batch_id=batch_id)
        if key not in stored:
            yield Problem("batch", batch_id, model_id, key, None, None)
    jobs = session.scalars(
        select(TrainingJob.id).where(
            TrainingJob.model_id == model_id,
            TrainingJob.kind.in_(("rl", "sft")),
            TrainingJob.status.not_in(TERMINAL_JOB_STATUSES),
        )
    )
    for job_id in jobs:
        key = keys.job_input_key(tenant_id=tenant_id, model_id=model_id, job_id=job_id)
        if key not in stored:
            yield Problem("job input", job_id, model_id, key, None, None)

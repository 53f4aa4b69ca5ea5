"""Per-tenant limits and quotas: the settings' defaults, overridden per tenant by the operator.

| limit | default setting | counted | over it |
|---|---|---|---|
| ``max_concurrent_requests`` | ``SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS`` | inference requests in flight | 429 |
| ``max_concurrent_rest_requests`` | ``SKYTRAIN_TENANT_MAX_CONCURRENT_REST_REQUESTS`` | REST requests in flight | 429 |
| ``max_sequences_in_flight`` | ``SKYTRAIN_TENANT_MAX_SEQUENCES_IN_FLIGHT`` | their sequences (n x prompts) | 429 |
| ``max_tokens_in_flight`` | ``SKYTRAIN_TENANT_MAX_TOKENS_IN_FLIGHT`` | body bytes + n x max_tokens | 429 |
| ``max_waiting_polls`` | ``SKYTRAIN_TENANT_MAX_WAITING_POLLS`` | long-polls waiting, per process | answered at once |
| ``max_models`` | ``SKYTRAIN_TENANT_MAX_MODELS`` | models owned | 403 on create |
| ``max_placed_models`` | ``SKYTRAIN_TENANT_MAX_PLACED_MODELS`` | models placed on workers | waits; 429 |
| ``max_workers`` | ``SKYTRAIN_TENANT_MAX_WORKERS`` | workers holding its models | waits; 429 |
| ``max_storage_bytes`` | ``SKYTRAIN_TENANT_MAX_STORAGE_BYTES`` | bytes held (``Tenant.storage_bytes``) | 403 on store |
| ``max_sessions`` | ``SKYTRAIN_TENANT_MAX_SESSIONS`` | Tinker sessions open | 403 on create |
| ``max_metadata_bytes`` | ``SKYTRAIN_TENANT_MAX_METADATA_BYTES`` | one user_metadata, as JSON | 413 |
| ``max_queued_jobs`` | ``SKYTRAIN_TENANT_MAX_QUEUED_JOBS`` | RL/SFT jobs not ended | 429 |
| ``max_queued_operations`` | ``SKYTRAIN_TENANT_MAX_QUEUED_OPERATIONS`` | a Tinker run's undone ops | 429 |

A tenant's row keeps only the limits the operator set (``skytrain tenants limits``); every
other limit follows its setting, so changing a default changes it for every such tenant.

Quotas on what a tenant holds are counted and taken in one transaction that first locks the
tenant's row (``enforce_quota``): concurrent creates take turns, so none sees a count another
is about to change (64 concurrent creates under ``max_models`` 2 make exactly 2 models).
Stored bytes are a running total on the tenant's row, changed in the transaction that inserts
or deletes the rows holding them, so their check reads one row (``reserve_storage``).
An upload reserves its bytes as it streams, before they reach the store (``StorageReservation``:
counted with that total until the transaction that records its row moves them into it).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from dataclasses import dataclass, fields
from datetime import timedelta
from typing import Any

import msgspec
from sqlalchemy import Select, delete, func, select, update
from sqlalchemy.orm import Session

from skytrain_backend.config import Settings
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    TinkerSession,
    TrainingJob,
    TrajectoryBatch,
    UploadedFile,
    UploadReservation,
    new_id,
    utcnow,
)
from skytrain_backend.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    SkytrainError,
)
from skytrain_backend.json_types import JSONObject

logger = logging.getLogger(__name__)

# Limits of requests in flight: zero would refuse every request, so they are at least one.
_REQUEST_LIMITS = frozenset(
    {
        "max_concurrent_requests",
        "max_concurrent_rest_requests",
        "max_sequences_in_flight",
        "max_tokens_in_flight",
        "max_waiting_polls",
    }
)


@dataclass(frozen=True)
class TenantLimits:
    """The limits in force for one tenant."""

    max_concurrent_requests: int
    max_concurrent_rest_requests: int
    max_sequences_in_flight: int
    max_tokens_in_flight: int
    max_waiting_polls: int
    max_models: int
    max_placed_models: int
    max_workers: int
    max_storage_bytes: int
    max_metadata_bytes: int
    max_sessions: int
    max_queued_jobs: int
    max_queued_operations: int

    @classmethod
    @functools.cache
    def names(cls) -> tuple[str, ...]:
        return tuple(field.name for field in fields(cls))

    @classmethod
    def defaults(cls, settings: Settings) -> TenantLimits:
        return cls(**{name: getattr(settings.tenant_limits, name) for name in cls.names()})


def limits_of(tenant: Tenant, settings: Settings) -> TenantLimits:
    """The tenant's limits: the operator's values for it, the settings' for the rest."""
    defaults = TenantLimits.defaults(settings)
    overrides = {k: int(v) for k, v in (tenant.limits or {}).items() if k in defaults.names()}
    return TenantLimits(**{**vars(defaults), **overrides})


def limits_by_id(session: Session, settings: Settings) -> Callable[[str], TenantLimits]:
    """``limits(tenant_id)``, reading each tenant once (for a scheduling pass)."""
    known: dict[str, TenantLimits] = {}

    def limits(tenant_id: str) -> TenantLimits:
        if tenant_id not in known:
            known[tenant_id] = limits_of(session.get_one(Tenant, tenant_id), settings)
        return known[tenant_id]

    return limits


def lock_tenant(session: Session, *, tenant_id: str) -> None:
    """Hold the tenant's row lock until the transaction ends.

    An UPDATE that changes nothing: on PostgreSQL it takes the row lock (as ``SELECT ... FOR
    NO KEY UPDATE`` would; rows referring to the tenant can still be inserted meanwhile); on
    SQLite, where a write locks the whole database, it begins the write transaction. The
    counts read after it see every transaction that held the lock before.
    """
    session.execute(
        update(Tenant)
        .where(Tenant.id == tenant_id)
        .values(limits=Tenant.limits)
        .execution_options(synchronize_session=False)
    )


def enforce_quota(
    session: Session,
    *,
    tenant_id: str,
    used: Select[Any],
    adding: int,
    allowed: int,
    refusal: Callable[[int], SkytrainError],
) -> int:
    """Lock the tenant (``lock_tenant``), count what it holds (``used``) and raise
    ``refusal(count)`` (the transaction rolled back, its lock released) if ``adding`` more
    would pass ``allowed``: the one check of every quota. Returns the count.

    The caller inserts what it adds and commits in the same transaction, which releases the
    lock: keep the work between the two short (no object-store call).
    """
    lock_tenant(session, tenant_id=tenant_id)
    count = int(session.scalar(used) or 0)
    if count + adding > allowed:
        session.rollback()
        raise refusal(count)
    return count


def counted_storage(*, tenant_id: str) -> Select[Any]:
    """The bytes the tenant holds, summed over its rows: its checkpoints' files (until a deleted
    one's are purged), trajectory batches (logged, and training jobs' inputs), uploaded files,
    Tinker sessions' metadata and Tinker operations' payloads and outputs. What ``Tenant.storage_bytes`` keeps as a running
    total; a sum over every such row (linear in them), so only ``recount_storage`` reads it."""
    of_models = select(Model.id).where(Model.tenant_id == tenant_id).scalar_subquery()

    def total(column: Any, *where: Any) -> Any:
        return select(func.coalesce(func.sum(column), 0)).where(*where).scalar_subquery()

    return select(
        total(
            Checkpoint.size_bytes,
            Checkpoint.model_id.in_(of_models),
            Checkpoint.deleted_at.is_(None) | Checkpoint.purge_pending.is_(True),
        )
        + total(TrajectoryBatch.size_bytes, TrajectoryBatch.model_id.in_(of_models))
        + total(TrainingJob.input_bytes, TrainingJob.model_id.in_(of_models))
        + total(UploadedFile.size_bytes, UploadedFile.tenant_id == tenant_id)
        + total(TinkerSession.size_bytes, TinkerSession.tenant_id == tenant_id)
        + total(
            TinkerRequest.input_bytes + TinkerRequest.output_bytes,
            TinkerRequest.tenant_id == tenant_id,
        )
    )


def model_storage(session: Session, *, model_id: str) -> int:
    """The bytes the model's rows hold (what deleting it frees: its checkpoints, batches, jobs'
    inputs and its Tinker run's operations, all gone with it through ON DELETE CASCADE)."""

    def total(column: Any, *where: Any) -> int:
        return int(session.scalar(select(func.coalesce(func.sum(column), 0)).where(*where)) or 0)

    of_runs = select(TinkerRun.id).where(TinkerRun.model_id == model_id).scalar_subquery()
    of_samplers = select(TinkerSampler.id).where(TinkerSampler.model_id == model_id)
    return (
        total(Checkpoint.size_bytes, Checkpoint.model_id == model_id)
        + total(TrajectoryBatch.size_bytes, TrajectoryBatch.model_id == model_id)
        + total(TrainingJob.input_bytes, TrainingJob.model_id == model_id)
        + total(
            TinkerRequest.input_bytes + TinkerRequest.output_bytes,
            TinkerRequest.run_id.in_(of_runs)
            | TinkerRequest.sampler_id.in_(of_samplers.scalar_subquery()),
        )
    )


def _add_storage(session: Session, *, tenant_id: str, delta: int) -> None:
    # One UPDATE: atomic on its own (it takes the row lock), whoever else changes the total.
    session.execute(
        update(Tenant)
        .where(Tenant.id == tenant_id)
        .values(storage_bytes=Tenant.storage_bytes + delta)
        .execution_options(synchronize_session=False)
    )


def release_storage(session: Session, *, tenant_id: str, freed: int) -> None:
    """Take ``freed`` bytes off the tenant's running total, in the transaction that deletes (or
    empties) the rows that held them; the caller commits."""
    if freed:
        _add_storage(session, tenant_id=tenant_id, delta=-freed)


def reserve_storage(
    session: Session, *, tenant_id: str, limits: TenantLimits, adding: int, what: str
) -> None:
    """Take ``adding`` bytes (``what``: "this batch", ...) of the tenant's ``max_storage_bytes``
    under its lock (``lock_tenant``; ``_check_storage`` reads the running total
    ``Tenant.storage_bytes``, one row however many the tenant holds, and what its uploads in
    flight reserved) and add them to the total; the caller inserts the row that holds them and
    commits in the same transaction. ``QuotaExceeded`` (403) when they do not fit."""
    lock_tenant(session, tenant_id=tenant_id)
    _check_storage(
        session,
        tenant_id=tenant_id,
        limits=limits,
        adding=adding,
        what=what,
        takes=f"{adding} bytes",
    )
    if adding:
        _add_storage(session, tenant_id=tenant_id, delta=adding)


def _check_storage(
    session: Session,
    *,
    tenant_id: str,
    limits: TenantLimits,
    adding: int,
    what: str,
    takes: str,
    own: int = 0,
) -> int:
    """What the tenant, locked, may still store (its quota less its running total and what its
    uploads in flight reserved, ``own`` of it the caller's); ``QuotaExceeded`` (the transaction
    rolled back, its lock released) if ``adding`` more does not fit."""
    reserved = (
        select(func.coalesce(func.sum(UploadReservation.bytes), 0))
        .where(UploadReservation.tenant_id == tenant_id, UploadReservation.expires_at > utcnow())
        .scalar_subquery()
    )
    row = session.execute(
        select(Tenant.storage_bytes, reserved).where(Tenant.id == tenant_id)
    ).one()
    stored, reserved_bytes = int(row[0]), int(row[1])
    free = limits.max_storage_bytes - stored - reserved_bytes
    if adding > free:
        session.rollback()
        raise _storage_refusal(
            limits=limits, what=what, takes=takes, stored=stored, others=reserved_bytes - own
        )
    return free


def _storage_refusal(
    *, limits: TenantLimits, what: str, takes: str, stored: int, others: int
) -> QuotaExceeded:
    """The 403 of a write that does not fit: what the tenant has stored and, apart, what its
    other uploads in flight reserved (given back as they end, what they do not use)."""
    quota = f"of the {limits.max_storage_bytes} its storage quota allows (max_storage_bytes)"
    advice = (
        "delete checkpoints (DELETE /v1/models/{id}/checkpoints), uploaded files "
        "(DELETE /v1/files/{id}) or models you no longer need, or ask the operator to raise "
        "it (`skytrain tenants limits TENANT --max-storage-bytes N`)"
    )
    if not others:
        return QuotaExceeded(
            f"{what} takes {takes} and your tenant holds {stored} {quota}: {advice}",
            limit="max_storage_bytes",
        )
    return QuotaExceeded(
        f"{what} takes {takes} and your tenant has {stored} stored, {others} reserved by your "
        f"uploads in flight, {quota}: retry once those uploads end (what they do not use is "
        f"given back), {advice}",
        limit="max_storage_bytes",
    )


# What an upload's reservation takes at least, and then at least a quarter of what it holds:
# a few locked updates per upload, whatever its size, and at most a quarter of it held more
# than it needs (given back at its commit). With less than a step free, it takes only what
# its next line needs, so as not to refuse the tenant's other uploads what they need.
RESERVE_STEP_BYTES = 1024 * 1024
# How long a reservation counts after it last grew or was renewed, when no one gives it back
# (its control plane died mid-upload, or lost its database); a live upload renews it as it
# streams, so only a write to the store stalled this long lets it expire.
RESERVATION_TTL = timedelta(minutes=10)


class StorageReservation:
    """Bytes of a tenant's ``max_storage_bytes`` taken for one upload as it streams, before they
    are written to the store (``what``: "this file", ...).

    The upload calls ``check(size)`` with its size so far, the next line included, before it
    writes that line; when the size passes what is reserved, more is taken under the tenant's
    lock, in a transaction of its own (an ``UploadReservation`` row, counted against the quota
    with the tenant's running total), or the upload is refused (``QuotaExceeded``, 403).
    Concurrent uploads of the tenant take from the same quota, so the bytes that reach the
    store (the parts of an S3 multipart upload included, which are never larger than the
    lines they compress) never pass it. ``commit`` moves the upload's size into the running
    total, in the transaction recording the row that holds it, and drops the reservation;
    ``release`` drops it (an upload refused or failed). One nobody drops stops counting
    ``RESERVATION_TTL`` after it last grew or was renewed; an upload whose reservation expired
    has its whole size checked again at its next ``check`` or its ``commit``."""

    def __init__(
        self, session: Session, *, tenant_id: str, limits: TenantLimits, what: str
    ) -> None:
        self._session = session
        self.id = new_id()
        self.tenant_id = tenant_id
        self.limits = limits
        self.what = what
        self.size = 0  # the upload's bytes so far
        self.reserved = 0  # what its reservation holds
        self._renew_at = utcnow()  # when its reservation's expiry is pushed back

    def check(self, size: int) -> None:
        """Reserve enough for an upload of ``size`` bytes; ``QuotaExceeded`` if it cannot fit.
        Once half of ``RESERVATION_TTL`` has passed since the reservation last grew, it is
        renewed (or, expired meanwhile, taken again in full), so a live upload keeps it."""
        self.size = size
        if size > self.reserved or utcnow() >= self._renew_at:
            self._take(size)

    def _take(self, size: int) -> None:
        session = self._session
        lock_tenant(session, tenant_id=self.tenant_id)
        now = utcnow()
        if self.reserved and not session.scalar(
            select(UploadReservation.id).where(
                UploadReservation.id == self.id, UploadReservation.expires_at > now
            )
        ):
            # Expired (the upload stalled): what it held may be another upload's by now, so
            # the whole size is checked again.
            self.reserved = 0
        session.execute(
            delete(UploadReservation).where(
                UploadReservation.tenant_id == self.tenant_id, UploadReservation.expires_at <= now
            )
        )
        needed = size - self.reserved
        taken = 0  # a renewal: what it holds is not checked again
        if needed > 0:
            free = _check_storage(
                session,
                tenant_id=self.tenant_id,
                limits=self.limits,
                adding=needed,
                what=self.what,
                takes=f"at least {size} byte{'s' if size > 1 else ''}",
                own=self.reserved,
            )
            # A step ahead, so that an upload takes the lock a few times whatever its size;
            # with less than a step free, only what it needs, leaving the rest to the
            # tenant's other uploads.
            ahead = max(needed, RESERVE_STEP_BYTES, self.reserved // 4)
            taken = min(free, ahead) if free >= RESERVE_STEP_BYTES else needed
        grown = session.execute(
            update(UploadReservation)
            .where(UploadReservation.id == self.id)
            .values(bytes=UploadReservation.bytes + taken, expires_at=now + RESERVATION_TTL)
            .execution_options(synchronize_session=False)
        )
        if grown.rowcount == 0:  # type: ignore[attr-defined]
            session.add(
                UploadReservation(
                    id=self.id,
                    tenant_id=self.tenant_id,
                    bytes=self.reserved + taken,
                    expires_at=now + RESERVATION_TTL,
                )
            )
        session.commit()
        self.reserved += taken
        self._renew_at = now + RESERVATION_TTL / 2

    def commit(self) -> None:
        """Commit the caller's transaction (the one that records the upload's row) with the
        upload's ``size`` added to the tenant's running total and its reservation dropped (a
        reservation expired meanwhile, what it held perhaps another's by now: the size is taken
        as any write's is, or refused)."""
        assert self.size <= self.reserved, "check(size) comes before the upload is recorded"
        session = self._session
        mine = UploadReservation.id == self.id
        dropped = session.execute(
            delete(UploadReservation).where(mine, UploadReservation.expires_at > utcnow())
        ).rowcount  # type: ignore[attr-defined]
        if dropped:
            _add_storage(session, tenant_id=self.tenant_id, delta=self.size)
        else:
            session.execute(delete(UploadReservation).where(mine))
            reserve_storage(
                session,
                tenant_id=self.tenant_id,
                limits=self.limits,
                adding=self.size,
                what=self.what,
            )
        session.commit()
        self.reserved = 0

    def release(self) -> None:
        """Drop the reservation, in a transaction of its own (one that cannot be dropped now,
        the database away, expires)."""
        if not self.reserved:
            return
        self.reserved = 0
        try:
            self._session.rollback()
            self._session.execute(delete(UploadReservation).where(UploadReservation.id == self.id))
            self._session.commit()
        except Exception:
            self._session.rollback()
            logger.warning(
                "could not drop upload reservation %s of tenant %s: it expires",
                self.id,
                self.tenant_id,
                exc_info=True,
            )


def reserve_as_it_streams(
    session: Session, *, tenant_id: str, limits: TenantLimits, what: str
) -> StorageReservation:
    """A ``StorageReservation`` for an upload about to begin; ``QuotaExceeded`` at once for a
    tenant already at its quota (an upload holds at least one byte), before anything is
    written to the store."""
    reservation = StorageReservation(session, tenant_id=tenant_id, limits=limits, what=what)
    reservation._take(1)
    return reservation


@dataclass(frozen=True)
class StorageRecount:
    """One tenant's running total of stored bytes against the sum over its rows."""

    tenant: str
    recorded: int
    counted: int


def recount_storage(session: Session, *, fix: bool) -> list[StorageRecount]:
    """Every tenant whose running total differs from the sum over its rows (rows written
    around the running total: by hand, or by a version before it); ``fix`` sets the total to
    the sum, each under the tenant's lock, and commits."""
    differing = []
    for tenant_id, name in session.execute(select(Tenant.id, Tenant.name).order_by(Tenant.name)):
        lock_tenant(session, tenant_id=tenant_id)
        recorded = int(
            session.scalar(select(Tenant.storage_bytes).where(Tenant.id == tenant_id)) or 0
        )
        counted = int(session.scalar(counted_storage(tenant_id=tenant_id)) or 0)
        if recorded != counted:
            differing.append(StorageRecount(tenant=name, recorded=recorded, counted=counted))
            if fix:
                _add_storage(session, tenant_id=tenant_id, delta=counted - recorded)
        if fix:
            session.commit()
        else:
            session.rollback()
    return differing


def queued_jobs(*, tenant_id: str) -> Select[Any]:
    """How many RL and SFT jobs the tenant has queued or running (``max_queued_jobs``)."""
    return (
        select(func.count(TrainingJob.id))
        .join(Model, Model.id == TrainingJob.model_id)
        .where(
            Model.tenant_id == tenant_id,
            # A Tinker training run's job lasts as long as its session: max_models bounds them.
            TrainingJob.kind != "tinker",
            TrainingJob.status.in_(("queued", "running")),
        )
    )


@dataclass(frozen=True)
class TenantUsage:
    """What a tenant holds against its quotas."""

    models: int
    sessions: int
    queued_jobs: int
    storage_bytes: int

    def by_limit(self) -> dict[str, int]:
        """What is used of each quota, by the quota's name."""
        return {
            "max_models": self.models,
            "max_sessions": self.sessions,
            "max_queued_jobs": self.queued_jobs,
            "max_storage_bytes": self.storage_bytes,
        }


def usage_of(session: Session, *, tenant_id: str) -> TenantUsage:
    models = session.scalar(select(func.count(Model.id)).where(Model.tenant_id == tenant_id))
    sessions = session.scalar(
        select(func.count(TinkerSession.id)).where(
            TinkerSession.tenant_id == tenant_id, TinkerSession.finished_at.is_(None)
        )
    )
    jobs = session.scalar(queued_jobs(tenant_id=tenant_id))
    stored = session.scalar(select(Tenant.storage_bytes).where(Tenant.id == tenant_id))
    return TenantUsage(
        models=int(models or 0),
        sessions=int(sessions or 0),
        queued_jobs=int(jobs or 0),
        storage_bytes=int(stored or 0),
    )


def metadata_bytes(metadata: JSONObject | None, *, limits: TenantLimits, field: str) -> int:
    """The bytes of ``metadata`` as JSON; ``PayloadTooLarge`` (413) naming the tenant's
    ``max_metadata_bytes`` when it is larger (checked before anything is stored)."""
    size = len(msgspec.json.encode(metadata or {}))
    if size > limits.max_metadata_bytes:
        raise PayloadTooLarge(
            f"{field} takes {size} bytes as JSON, more than your tenant's max_metadata_bytes "
            f"({limits.max_metadata_bytes}): keep metadata small (names, ids, a few settings) and "
            "the data itself elsewhere, or ask the operator to raise it "
            "(`skytrain tenants limits TENANT --max-metadata-bytes N`)"
        )
    return size


def get_tenant_by_name(session: Session, *, name: str) -> Tenant:
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        raise NotFound(
            f"no tenant {name!r}: tenants are created with their first key "
            "(`skytrain keys create --tenant NAME`); `skytrain tenants list` shows them"
        )
    return tenant


def set_limits(
    session: Session, *, tenant_name: str, values: dict[str, int], reset: list[str]
) -> Tenant:
    """Set the tenant's own ``values`` and return the ``reset`` ones to their defaults."""
    known = TenantLimits.names()
    for name in [*values, *reset]:
        if name not in known:
            raise InvalidRequest(f"unknown limit {name!r}: the limits are {', '.join(known)}")
    for name, value in values.items():
        if value < 0 or (value == 0 and name in _REQUEST_LIMITS):
            raise InvalidRequest(f"{name} must be a positive number, not {value}")
    tenant = get_tenant_by_name(session, name=tenant_name)
    limits: dict[str, float] = {k: v for k, v in (tenant.limits or {}).items() if k not in reset}
    tenant.limits = {**limits, **values}  # a new dict: JSON columns notice assignment only
    session.commit()
    return tenant


def list_tenants(session: Session) -> list[tuple[Tenant, int]]:
    """Every tenant with the number of models it owns, by name."""
    owned = select(func.count(Model.id)).where(Model.tenant_id == Tenant.id).scalar_subquery()
    return [
        (tenant, int(count))
        for tenant, count in session.execute(select(Tenant, owned).order_by(Tenant.name))
    ]

"""Upload reservations of a tenant's storage quota (issue 38) on both databases: a reservation
that expired is checked again in full when its upload resumes or commits, a live upload's
reservation never expires, and uploads near the quota take only what they need of it."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from datetime import datetime, timedelta

import pytest
from sqlalchemy import Engine, select
from sqlalchemy.orm import Session

from skytrain_backend.config import Settings
from skytrain_backend.db import api_keys, migrations, tenants
from skytrain_backend.db.models import Tenant, UploadReservation, utcnow
from skytrain_backend.db.session import session_factory
from skytrain_backend.errors import QuotaExceeded

MiB = 1024 * 1024


@dataclasses.dataclass
class QuotaTenant:
    sessions: Callable[[], Session]
    tenant_id: str
    limits: tenants.TenantLimits

    def upload(self, what: str) -> tenants.StorageReservation:
        return tenants.reserve_as_it_streams(
            self.sessions(), tenant_id=self.tenant_id, limits=self.limits, what=what
        )

    def stored(self) -> int:
        with self.sessions() as session:
            return int(
                session.scalar(select(Tenant.storage_bytes).where(Tenant.id == self.tenant_id)) or 0
            )

    def reserved(self) -> list[int]:
        with self.sessions() as session:
            return sorted(session.scalars(select(UploadReservation.bytes)))


class Clock:
    """The clock the reservations read, moved forward by hand (no sleeping)."""

    def __init__(self) -> None:
        self.ahead = timedelta()

    def __call__(self) -> datetime:
        return utcnow() + self.ahead


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    clock = Clock()
    monkeypatch.setattr(tenants, "utcnow", clock)
    return clock


@pytest.fixture
def make_tenant(empty_engine: Engine) -> Callable[[int], QuotaTenant]:
    migrations.upgrade(empty_engine)
    sessions = session_factory(empty_engine)

    def make(quota: int) -> QuotaTenant:
        with sessions() as session:
            key_row, _ = api_keys.create_key(session, tenant_name="alice")
        limits = dataclasses.replace(
            tenants.TenantLimits.defaults(Settings()), max_storage_bytes=quota
        )
        return QuotaTenant(sessions, key_row.tenant_id, limits)

    return make


def test_an_upload_resumed_after_its_reservation_expired_is_checked_again_in_full(
    make_tenant: Callable[[int], QuotaTenant], clock: Clock
) -> None:
    """A reserves 8 MiB of 10 and stalls past the TTL; B takes the 8 MiB; A resumes: its
    whole size is checked again and refused, so the two never hold 16 MiB."""
    alice = make_tenant(10 * MiB)
    a = alice.upload("upload A")
    a.check(8 * MiB)
    clock.ahead = tenants.RESERVATION_TTL + timedelta(seconds=1)
    b = alice.upload("upload B")
    b.check(8 * MiB)  # A's reservation expired: not counted
    with pytest.raises(QuotaExceeded, match="max_storage_bytes"):
        a.check(8 * MiB + 100)
    a.release()
    b.commit()
    assert alice.stored() == 8 * MiB
    assert alice.reserved() == []


def test_an_upload_committed_after_its_reservation_expired_is_refused_if_it_no_longer_fits(
    make_tenant: Callable[[int], QuotaTenant], clock: Clock
) -> None:
    """An upload holds all of the quota, stalls past the TTL, another write takes the quota:
    the upload's commit checks its size as any write's and refuses it, nothing added."""
    alice = make_tenant(10 * MiB)
    upload = alice.upload("this batch")
    upload.check(10 * MiB)
    clock.ahead = tenants.RESERVATION_TTL + timedelta(seconds=1)
    with alice.sessions() as session:
        tenants.reserve_storage(
            session, tenant_id=alice.tenant_id, limits=alice.limits, adding=10 * MiB, what="other"
        )
        session.commit()
    with pytest.raises(QuotaExceeded, match="max_storage_bytes"):
        upload.commit()
    upload.release()
    assert alice.stored() == 10 * MiB


def test_a_live_uploads_reservation_is_renewed_and_never_expires(
    make_tenant: Callable[[int], QuotaTenant], clock: Clock
) -> None:
    """An upload that keeps streaming without growing its reservation past it still renews
    it: 12 minutes in (past the TTL of 10), its 8 MiB still count against another upload."""
    alice = make_tenant(10 * MiB)
    a = alice.upload("upload A")
    a.check(8 * MiB)
    for minutes in (3, 6, 9, 12):
        clock.ahead = timedelta(minutes=minutes)
        a.check(8 * MiB)  # a line within what it holds
    b = alice.upload("upload B")
    with pytest.raises(QuotaExceeded, match="reserved by your uploads in flight"):
        b.check(8 * MiB)
    b.release()
    a.commit()
    assert alice.stored() == 8 * MiB
    assert alice.reserved() == []


def test_concurrent_small_uploads_near_the_quota_take_only_what_they_need(
    make_tenant: Callable[[int], QuotaTenant],
) -> None:
    """With 1.5 MiB free, three 2 KB uploads in flight all fit (the first two used to take it
    all); one that does not fit is told what is stored and what the others reserved."""
    alice = make_tenant(MiB * 3 // 2)
    uploads = [alice.upload(f"upload {name}") for name in "ABC"]
    for upload in uploads:
        upload.check(2048)
    reserved = sum(alice.reserved())
    big = alice.upload("this file")
    with pytest.raises(QuotaExceeded) as refused:
        big.check(MiB)
    big.release()
    message = refused.value.message
    assert f"0 stored, {reserved} reserved by your uploads in flight" in message, message
    assert "max_storage_bytes" in message
    for upload in uploads:
        upload.commit()
    assert alice.stored() == 3 * 2048
    assert alice.reserved() == []

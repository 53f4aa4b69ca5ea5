"""Tenants' requests in flight, counted across control-plane processes (PostgreSQL).

Each counter of a process (the gateway's inference requests, the REST routes' requests) keeps
one row per tenant it has requests in flight for (``TenantLoad``), changed by deltas: ``acquire`` adds a request's cost if the sum over every live row of the tenant
stays within its limits, ``release`` takes it off. Admissions of one tenant are serialised by
a lock on its ``tenants`` row (``FOR NO KEY UPDATE``: rows that reference the tenant can
still be written meanwhile), so two processes cannot both admit the last free slot.

A row counts while its ``expires_at`` is in the future (database time); its process renews
its rows every few seconds (``renew``), so the load of a process that was killed stops
counting within ``lease_s``, and ``renew`` deletes rows long expired. A process always counts
its own rows, even late in renewing them.
"""

from __future__ import annotations

import operator
from dataclasses import asdict, astuple, dataclass

from sqlalchemy import text
from sqlalchemy.orm import Session


@dataclass(frozen=True)
class Load:
    """What a tenant's requests hold while in flight: what a row counts, what admission adds."""

    requests: int = 0
    sequences: int = 0
    tokens: int = 0
    rest_requests: int = 0

    def __add__(self, other: Load) -> Load:
        return Load(*map(operator.add, astuple(self), astuple(other)))

    def __sub__(self, other: Load) -> Load:
        return Load(*map(operator.sub, astuple(self), astuple(other)))


def held(session: Session, *, tenant_id: str, holder: str) -> Load:
    """The tenant's load over every live row, its own tenant row locked until the
    transaction ends (call ``add`` and commit, or roll back)."""
    session.execute(
        text("SELECT id FROM tenants WHERE id = :tenant_id FOR NO KEY UPDATE"),
        {"tenant_id": tenant_id},
    )
    row = session.execute(
        text(
            "SELECT coalesce(sum(requests), 0), coalesce(sum(sequences), 0), "
            "coalesce(sum(tokens), 0), coalesce(sum(rest_requests), 0) FROM tenant_loads "
            "WHERE tenant_id = :tenant_id AND (holder = :holder OR expires_at > now())"
        ),
        {"tenant_id": tenant_id, "holder": holder},
    ).one()
    return Load(*(int(value) for value in row))


def add(session: Session, *, tenant_id: str, holder: str, delta: Load, lease_s: float) -> None:
    """Add ``delta`` (negative to release) to the holder's row for the tenant."""
    session.execute(
        text(
            "INSERT INTO tenant_loads (tenant_id, holder, requests, sequences, tokens, "
            "rest_requests, expires_at) VALUES (:tenant_id, :holder, :requests, :sequences, "
            ":tokens, :rest_requests, now() + make_interval(secs => :lease_s)) "
            "ON CONFLICT (tenant_id, holder) DO UPDATE SET "
            "requests = tenant_loads.requests + excluded.requests, "
            "sequences = tenant_loads.sequences + excluded.sequences, "
            "tokens = tenant_loads.tokens + excluded.tokens, "
            "rest_requests = tenant_loads.rest_requests + excluded.rest_requests, "
            "expires_at = excluded.expires_at"
        ),
        {"tenant_id": tenant_id, "holder": holder, **asdict(delta), "lease_s": lease_s},
    )


def renew(session: Session, *, holder: str, lease_s: float) -> None:
    """Extend the holder's rows; delete every row expired for more than ten leases."""
    session.execute(
        text(
            "UPDATE tenant_loads SET expires_at = now() + make_interval(secs => :lease_s) "
            "WHERE holder = :holder"
        ),
        {"holder": holder, "lease_s": lease_s},
    )
    session.execute(
        text("DELETE FROM tenant_loads WHERE expires_at < now() - make_interval(secs => :grace_s)"),
        {"grace_s": 10 * lease_s},
    )
    session.commit()


def forget(session: Session, *, holder: str) -> None:
    """Delete the holder's rows (its process is stopping: nothing of it is in flight)."""
    session.execute(text("DELETE FROM tenant_loads WHERE holder = :holder"), {"holder": holder})
    session.commit()

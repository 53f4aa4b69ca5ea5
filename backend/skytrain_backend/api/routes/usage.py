"""The caller's tenant: its quotas and what it holds against them (the dashboard shows it)."""

from __future__ import annotations

from fastapi import APIRouter
from pydantic import BaseModel

from skytrain_backend.api.deps import SessionDep, SessionRoute, SettingsDep, TenantDep
from skytrain_backend.db import tenants

router = APIRouter(prefix="/usage", tags=["usage"], route_class=SessionRoute)


class QuotaPublic(BaseModel):
    name: str
    used: int
    limit: int


class UsagePublic(BaseModel):
    """The tenant's name and, per quota on what it holds, its usage and limit; the limits on
    requests in flight (``max_concurrent_requests``, ...) are listed with ``used`` 0."""

    tenant: str
    quotas: list[QuotaPublic]


@router.get("", response_model=UsagePublic)
def get_usage(session: SessionDep, tenant: TenantDep, settings: SettingsDep) -> UsagePublic:
    """Models owned, Tinker sessions open, training jobs queued and bytes stored against their
    quotas, with every other limit in force (``skytrain tenants limits`` sets them)."""
    limits = vars(tenants.limits_of(tenant, settings))
    used = tenants.usage_of(session, tenant_id=tenant.id).by_limit()
    return UsagePublic(
        tenant=tenant.name,
        quotas=[
            QuotaPublic(name=name, used=used.get(name, 0), limit=limit)
            for name, limit in limits.items()
        ],
    )

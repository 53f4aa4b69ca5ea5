"""Tenants and their API keys.

A key is ``sk-st-`` followed by 32 random bytes (URL-safe base64); only its sha256 is stored,
which is enough for a key with that much entropy (no salt or slow hash needed: there is
nothing to brute-force). The first characters are kept as a prefix to recognise a key in
listings, and the key itself is shown once, at creation.
"""

from __future__ import annotations

import hashlib
import re
import secrets
from datetime import timedelta

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import ApiKey, Tenant, utcnow
from skytrain_backend.errors import AuthenticationFailed, Conflict, InvalidRequest, NotFound

KEY_PREFIX = "sk-st-"
DISPLAY_PREFIX_LENGTH = len(KEY_PREFIX) + 6
# last_used_at is informative: writing it on every request would serialise SQLite writers.
LAST_USED_RESOLUTION = timedelta(minutes=1)
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def hash_key(key: str) -> str:
    return hashlib.sha256(key.encode()).hexdigest()


def get_or_create_tenant(session: Session, *, name: str) -> Tenant:
    if not TENANT_NAME_RE.match(name):
        raise InvalidRequest(
            f"tenant name {name!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes the default entity of models)"
        )
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
    return tenant


def create_key(
    session: Session, *, tenant_name: str, name: str | None = None
) -> tuple[ApiKey, str]:
    """Create a key for the tenant (creating the tenant if new); returns the row and the key."""
    tenant = get_or_create_tenant(session, name=tenant_name)
    key = KEY_PREFIX + secrets.token_urlsafe(32)
    row = ApiKey(
        tenant_id=tenant.id, name=name, prefix=key[:DISPLAY_PREFIX_LENGTH], key_hash=hash_key(key)
    )
    session.add(row)
    session.commit()
    return row, key


def list_keys(session: Session, *, tenant_name: str | None = None) -> list[tuple[ApiKey, Tenant]]:
    statement = select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at, ApiKey.id)
    if tenant_name is not None:
        statement = statement.where(Tenant.name == tenant_name)
    return [(key, tenant) for key, tenant in session.execute(statement)]


def revoke_key(session: Session, *, id_or_prefix: str) -> ApiKey:
    """Revoke the key with this id or display prefix; refuses a prefix shared by several."""
    matches = list(
        session.scalars(
            select(ApiKey).where(or_(ApiKey.id == id_or_prefix, ApiKey.prefix == id_or_prefix))
        )
    )
    if not matches:
        raise NotFound(f"no API key has id or prefix {id_or_prefix!r}: see `skytrain keys list`")
    if len(matches) > 1:
        ids = ", ".join(sorted(key.id for key in matches))
        raise Conflict(f"prefix {id_or_prefix!r} matches several keys ({ids}): revoke by id")
    key = matches[0]
    if key.revoked_at is None:
        key.revoked_at = utcnow()
        session.commit()
    return key


def authenticate(session: Session, *, key: str) -> Tenant:
    """The tenant owning ``key``; AuthenticationFailed if it is unknown or revoked."""
    row = session.execute(
        select(ApiKey, Tenant).join(Tenant).where(ApiKey.key_hash == hash_key(key))
    ).first()
    if row is None:
        raise AuthenticationFailed(
            "the API key is not valid: create one with `skytrain keys create --tenant NAME`"
        )
    api_key, tenant = row
    if api_key.revoked_at is not None:
        raise AuthenticationFailed(
            f"the API key {api_key.prefix}... was revoked: create a new one with "
            "`skytrain keys create`"
        )
    now = utcnow()
    if api_key.last_used_at is None or now - api_key.last_used_at > LAST_USED_RESOLUTION:
        api_key.last_used_at = now
        session.commit()
    return tenant

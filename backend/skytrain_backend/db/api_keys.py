"""Tenants and their API keys.

A key is ``sk-st-`` followed by 32 random bytes, stored as its sha256 and shown once; its
first characters are kept to recognise it in listings (``db/credentials.py``, shared with
the workers' tokens).
"""

from __future__ import annotations

import re

from sqlalchemy import select
from sqlalchemy.exc import IntegrityError
from sqlalchemy.orm import Session

from skytrain_backend.db import credentials
from skytrain_backend.db.credentials import hash_secret
from skytrain_backend.db.models import ApiKey, Entity, Tenant
from skytrain_backend.errors import AuthenticationFailed, Conflict, InvalidRequest

KEY_PREFIX = "sk-st-"
DISPLAY_PREFIX_LENGTH = len(KEY_PREFIX) + credentials.DISPLAY_CHARS
TENANT_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def get_or_create_tenant(session: Session, *, name: str) -> Tenant:
    if not TENANT_NAME_RE.match(name):
        raise InvalidRequest(
            f"tenant name {name!r} is not valid: use 1-128 letters, digits, '.', '_' or '-', "
            "starting with a letter or digit (it becomes the default entity of models)"
        )
    tenant = session.scalar(select(Tenant).where(Tenant.name == name))
    if tenant is None:
        claimed = session.scalar(
            select(Tenant.name)
            .join(Entity, Entity.tenant_id == Tenant.id)
            .where(Entity.name == name)
        )
        if claimed is not None:
            # A tenant's name is its entity: the new tenant would take the models' names over.
            raise Conflict(
                f"tenant name {name!r} is taken: tenant {claimed!r} uses it as the entity of "
                "its models (a tenant's name is its default entity): choose another name"
            )
        tenant = Tenant(name=name)
        session.add(tenant)
        session.flush()
        # Its name claimed as its entity in the same transaction: a tenant claiming the name
        # for a model meanwhile makes one of the two fail on the entity's primary key.
        session.add(Entity(name=name, tenant_id=tenant.id))
        session.flush()
    return tenant


def create_key(
    session: Session, *, tenant_name: str, name: str | None = None
) -> tuple[ApiKey, str]:
    """Create a key for the tenant (creating the tenant if new); returns the row and the key."""
    try:
        tenant = get_or_create_tenant(session, name=tenant_name)
        key = credentials.new_secret(KEY_PREFIX)
        row = ApiKey(
            tenant_id=tenant.id,
            name=name,
            prefix=key[:DISPLAY_PREFIX_LENGTH],
            key_hash=hash_secret(key),
        )
        session.add(row)
        session.commit()
    except IntegrityError:
        session.rollback()
        raise Conflict(
            f"tenant name {tenant_name!r} was taken meanwhile (by a new tenant, or by another "
            "tenant's models as their entity): run the command again, or choose another name"
        ) from None
    return row, key


def list_keys(session: Session, *, tenant_name: str | None = None) -> list[tuple[ApiKey, Tenant]]:
    statement = select(ApiKey, Tenant).join(Tenant).order_by(ApiKey.created_at, ApiKey.id)
    if tenant_name is not None:
        statement = statement.where(Tenant.name == tenant_name)
    return [(key, tenant) for key, tenant in session.execute(statement)]


def revoke_key(session: Session, *, id_or_prefix: str) -> ApiKey:
    """Revoke the key with this id or display prefix; refuses a prefix shared by several."""
    return credentials.revoke(
        session,
        ApiKey,
        id_or_prefix=id_or_prefix,
        noun="API key",
        nouns="keys",
        list_command="skytrain keys list",
    )


def authenticate(session: Session, *, key: str) -> Tenant:
    """The tenant owning ``key``; AuthenticationFailed if it is unknown or revoked."""
    row = session.execute(
        select(ApiKey, Tenant).join(Tenant).where(ApiKey.key_hash == hash_secret(key))
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
    credentials.mark_used(session, api_key)
    return tenant

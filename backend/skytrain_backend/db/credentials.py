"""What API keys, join tokens and worker tokens share: bearer secrets stored as hashes.

Each is a prefix naming its kind (``sk-st-``, ``swj-``, ``swt-``) followed by 32 random bytes
(URL-safe base64), shown once at creation; only its sha256 is stored, which is enough for a
secret with that much entropy (no salt or slow hash needed: there is nothing to brute-force).
Keys and join tokens keep their first characters as a display prefix, to recognise them in
listings and to revoke them by, and note when they were last used, at most once a minute
(writing it on every request would serialise SQLite writers).
"""

from __future__ import annotations

import hashlib
import secrets
from datetime import timedelta
from typing import TypeVar

from sqlalchemy import or_, select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import ApiKey, WorkerToken, utcnow
from skytrain_backend.errors import Conflict, NotFound

LAST_USED_RESOLUTION = timedelta(minutes=1)
# Characters of the random part a display prefix shows.
DISPLAY_CHARS = 6

Revocable = TypeVar("Revocable", ApiKey, WorkerToken)


def hash_secret(secret: str) -> str:
    return hashlib.sha256(secret.encode()).hexdigest()


def new_secret(prefix: str) -> str:
    return prefix + secrets.token_urlsafe(32)


def revoke(
    session: Session,
    model: type[Revocable],
    *,
    id_or_prefix: str,
    noun: str,
    nouns: str,
    list_command: str,
) -> Revocable:
    """Revoke the row with this id or display prefix; refuses a prefix shared by several.
    ``noun``/``nouns`` and ``list_command`` name the kind in the messages."""
    matches = list(
        session.scalars(
            select(model).where(or_(model.id == id_or_prefix, model.prefix == id_or_prefix))
        )
    )
    if not matches:
        raise NotFound(f"no {noun} has id or prefix {id_or_prefix!r}: see `{list_command}`")
    if len(matches) > 1:
        ids = ", ".join(sorted(row.id for row in matches))
        raise Conflict(f"prefix {id_or_prefix!r} matches several {nouns} ({ids}): revoke by id")
    row = matches[0]
    if row.revoked_at is None:
        row.revoked_at = utcnow()
        session.commit()
    return row


def mark_used(session: Session, row: ApiKey | WorkerToken) -> None:
    """Note that ``row`` was used now, unless it was noted within ``LAST_USED_RESOLUTION``."""
    now = utcnow()
    if row.last_used_at is None or now - row.last_used_at > LAST_USED_RESOLUTION:
        row.last_used_at = now
        session.commit()

"""Join tokens: how a worker started by hand (``sky launch sky/worker.yaml``) joins.

An operator creates one with ``skytrain workers token create``; it is ``swj-`` followed by 32
random bytes, shown once, and only its sha256 is stored, as for API keys
(``db/credentials.py``). A token may be scoped to one base
model, and revoked at any time. A worker that registers with a join token gets a worker row
and a worker token (``swt-...``) of its own for every later call, so revoking the join token
stops new workers from joining without cutting off the ones already running.
"""

from __future__ import annotations

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import credentials
from skytrain_backend.db.credentials import hash_secret
from skytrain_backend.db.models import WorkerToken
from skytrain_backend.errors import AuthenticationFailed, InvalidRequest

JOIN_TOKEN_PREFIX = "swj-"
DISPLAY_PREFIX_LENGTH = len(JOIN_TOKEN_PREFIX) + credentials.DISPLAY_CHARS
MAX_BASE_MODEL_LENGTH = 512


def is_join_token(token: str) -> bool:
    """Whether ``token`` has the form of a join token (as opposed to a worker token)."""
    return token.startswith(JOIN_TOKEN_PREFIX)


def create_join_token(
    session: Session, *, name: str | None = None, base_model: str | None = None
) -> tuple[WorkerToken, str]:
    """Create a join token (scoped to ``base_model`` when given); returns the row and the token."""
    if base_model is not None and not base_model.strip():
        raise InvalidRequest(
            "the base model scope is empty: pass a model name, or no --base-model for a token "
            "that joins workers of any base model"
        )
    if base_model is not None and len(base_model) > MAX_BASE_MODEL_LENGTH:
        raise InvalidRequest(
            f"the base model name is {len(base_model)} characters long; "
            f"at most {MAX_BASE_MODEL_LENGTH} are allowed"
        )
    token = credentials.new_secret(JOIN_TOKEN_PREFIX)
    row = WorkerToken(
        name=name,
        prefix=token[:DISPLAY_PREFIX_LENGTH],
        token_hash=hash_secret(token),
        base_model=base_model,
    )
    session.add(row)
    session.commit()
    return row, token


def list_join_tokens(session: Session, *, include_revoked: bool = True) -> list[WorkerToken]:
    statement = select(WorkerToken).order_by(WorkerToken.created_at, WorkerToken.id)
    if not include_revoked:
        statement = statement.where(WorkerToken.revoked_at.is_(None))
    return list(session.scalars(statement))


def revoke_join_token(session: Session, *, id_or_prefix: str) -> WorkerToken:
    """Revoke the token with this id or display prefix; refuses a prefix shared by several."""
    return credentials.revoke(
        session,
        WorkerToken,
        id_or_prefix=id_or_prefix,
        noun="join token",
        nouns="join tokens",
        list_command="skytrain workers token list",
    )


def live_join_token(session: Session, *, token: str) -> WorkerToken:
    """The join token ``token``; AuthenticationFailed when it is unknown or revoked."""
    row = session.scalar(select(WorkerToken).where(WorkerToken.token_hash == hash_secret(token)))
    if row is None:
        raise AuthenticationFailed(
            "unknown join token: create one with `skytrain workers token create` on the "
            "control plane and start the worker with it (SKYTRAIN_WORKER_TOKEN)"
        )
    if row.revoked_at is not None:
        raise AuthenticationFailed(
            f"the join token {row.prefix}... was revoked: create a new one with "
            "`skytrain workers token create`"
        )
    return row


def verify_join_token(session: Session, *, token: str, base_model: str) -> WorkerToken:
    """The join token a worker for ``base_model`` registers with.

    Raises AuthenticationFailed when the token is unknown, revoked, or scoped to another base
    model, with what the operator can do about it.
    """
    row = live_join_token(session, token=token)
    if row.base_model is not None and row.base_model != base_model:
        raise AuthenticationFailed(
            f"the join token {row.prefix}... only joins workers for {row.base_model!r}, "
            f"not {base_model!r}: start the worker with that base model, or create a token "
            "for this one with `skytrain workers token create --base-model`"
        )
    credentials.mark_used(session, row)
    return row

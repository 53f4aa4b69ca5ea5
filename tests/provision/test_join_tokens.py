"""Join tokens for workers started by hand: created once, stored hashed, scoped, revocable.

The persistence functions run on SQLite and PostgreSQL; the CLI runs as an operator runs it,
through Typer's runner (in this process, with only the operator's environment).
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy import select
from sqlalchemy.orm import Session
from typer.testing import CliRunner, Result

from skytrain_backend.cli import app
from skytrain_backend.config import get_settings
from skytrain_backend.db import worker_tokens
from skytrain_backend.db.credentials import hash_secret
from skytrain_backend.db.models import WorkerToken
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.errors import AuthenticationFailed, Conflict, InvalidRequest, NotFound
from tests.fixtures.services import MakeSettings

MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def session(request: pytest.FixtureRequest, make_settings: MakeSettings) -> Iterator[Session]:
    engine = create_db_engine(make_settings(database=request.param).storage.resolved_database_url)
    with session_factory(engine)() as opened:
        yield opened
    engine.dispose()


def test_token_is_stored_only_as_its_hash(session: Session) -> None:
    row, token = worker_tokens.create_join_token(session, name="gpu-box", base_model=MODEL)
    assert re.fullmatch(r"swj-[A-Za-z0-9_-]{43}", token)
    stored = session.scalars(select(WorkerToken)).one()
    assert stored.token_hash == hash_secret(token)
    assert token not in (stored.prefix, stored.token_hash, stored.name)
    assert token.startswith(stored.prefix)
    assert (stored.id, stored.base_model, stored.name) == (row.id, MODEL, "gpu-box")


def test_verify_accepts_a_scoped_token_for_its_base_model(session: Session) -> None:
    row, token = worker_tokens.create_join_token(session, base_model=MODEL)
    assert row.last_used_at is None
    verified = worker_tokens.verify_join_token(session, token=token, base_model=MODEL)
    assert verified.id == row.id
    assert verified.last_used_at is not None


def test_verify_accepts_an_unscoped_token_for_any_base_model(session: Session) -> None:
    row, token = worker_tokens.create_join_token(session)
    for base_model in (MODEL, "Qwen/Qwen2.5-7B-Instruct"):
        assert worker_tokens.verify_join_token(session, token=token, base_model=base_model) == row


def test_verify_refuses_a_token_scoped_to_another_base_model(session: Session) -> None:
    _, token = worker_tokens.create_join_token(session, base_model=MODEL)
    with pytest.raises(AuthenticationFailed, match="only joins workers for") as raised:
        worker_tokens.verify_join_token(session, token=token, base_model="Qwen/Qwen2.5-7B")
    assert MODEL in raised.value.message and "Qwen/Qwen2.5-7B" in raised.value.message


def test_verify_refuses_unknown_and_revoked_tokens(session: Session) -> None:
    with pytest.raises(AuthenticationFailed, match="unknown join token"):
        worker_tokens.verify_join_token(session, token="swj-made-up", base_model=MODEL)
    row, token = worker_tokens.create_join_token(session)
    worker_tokens.revoke_join_token(session, id_or_prefix=row.prefix)
    with pytest.raises(AuthenticationFailed, match="was revoked"):
        worker_tokens.verify_join_token(session, token=token, base_model=MODEL)


def test_revoke_by_id_is_idempotent_and_keeps_the_row(session: Session) -> None:
    row, _ = worker_tokens.create_join_token(session)
    first = worker_tokens.revoke_join_token(session, id_or_prefix=row.id).revoked_at
    again = worker_tokens.revoke_join_token(session, id_or_prefix=row.id).revoked_at
    assert first is not None and again == first
    assert [t.id for t in worker_tokens.list_join_tokens(session)] == [row.id]
    assert worker_tokens.list_join_tokens(session, include_revoked=False) == []


def test_revoke_refuses_unknown_and_ambiguous_prefixes(session: Session) -> None:
    with pytest.raises(NotFound, match="skytrain workers token list"):
        worker_tokens.revoke_join_token(session, id_or_prefix="swj-nothing")
    first, _ = worker_tokens.create_join_token(session)
    second, _ = worker_tokens.create_join_token(session)
    second.prefix = first.prefix  # a prefix collision, improbable but possible
    session.commit()
    with pytest.raises(Conflict, match="revoke by id"):
        worker_tokens.revoke_join_token(session, id_or_prefix=first.prefix)
    assert all(t.revoked_at is None for t in worker_tokens.list_join_tokens(session))


def test_create_refuses_an_empty_base_model_scope(session: Session) -> None:
    with pytest.raises(InvalidRequest, match="scope is empty"):
        worker_tokens.create_join_token(session, base_model="  ")
    assert worker_tokens.list_join_tokens(session) == []


# --- the CLI ------------------------------------------------------------------------------------


def _skytrain(home: Path, *args: str) -> Result:
    """`skytrain ARGS` with nothing set but ``SKYTRAIN_HOME`` (the embedded defaults)."""
    env: dict[str, str | None] = {k: None for k in os.environ if k.startswith("SKYTRAIN_")}
    env["SKYTRAIN_HOME"] = str(home)
    get_settings.cache_clear()
    try:
        return CliRunner().invoke(app, list(args), env=env)
    finally:
        get_settings.cache_clear()


def test_cli_creates_lists_and_revokes_join_tokens(tmp_path: Path) -> None:
    created = _skytrain(tmp_path, "workers", "token", "create", "--base-model", MODEL)
    assert created.exit_code == 0, created.stderr
    token = created.stdout.strip()
    assert re.fullmatch(r"swj-[A-Za-z0-9_-]{43}", token)
    assert "not shown again" in created.stderr

    listed = _skytrain(tmp_path, "workers", "token", "list")
    assert listed.exit_code == 0, listed.stderr
    (line,) = [line for line in listed.stdout.splitlines() if token[:10] in line]
    assert MODEL in line and "never" in line
    assert token not in listed.stdout

    revoked = _skytrain(tmp_path, "workers", "token", "revoke", f"{token[:10]}...")
    assert revoked.exit_code == 0, revoked.stderr
    engine = create_db_engine(f"sqlite:///{tmp_path / 'skytrain.db'}")
    try:
        with session_factory(engine)() as session, pytest.raises(AuthenticationFailed):
            worker_tokens.verify_join_token(session, token=token, base_model=MODEL)
    finally:
        engine.dispose()


def test_cli_revoke_of_an_unknown_token_fails_with_a_message(tmp_path: Path) -> None:
    result = _skytrain(tmp_path, "workers", "token", "revoke", "swj-nothing")
    # An exit with a message, not an exception escaping the command.
    assert result.exit_code == 1 and isinstance(result.exception, SystemExit)
    assert "no join token has id or prefix 'swj-nothing'" in result.stderr
    assert "Traceback" not in result.stderr

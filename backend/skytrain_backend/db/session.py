"""Database engines and sessions from the settings.

PostgreSQL (psycopg 3) in production; SQLite as the embedded default, in WAL mode so readers
do not block the writer, with foreign keys enforced (SQLite leaves them off unless asked) and a
busy timeout so concurrent requests wait for the write lock instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_S = 30


def create_db_engine(url: str) -> Engine:
    """An engine for ``url``; creates the directory of a SQLite file if needed."""
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
    )
    event.listen(engine, "connect", _configure_sqlite)
    return engine


def _configure_sqlite(dbapi_connection: Any, _record: Any) -> None:
    cursor = dbapi_connection.cursor()
    cursor.execute("PRAGMA journal_mode=WAL")
    cursor.execute("PRAGMA foreign_keys=ON")
    cursor.execute(f"PRAGMA busy_timeout={SQLITE_BUSY_TIMEOUT_S * 1000}")
    cursor.close()


def session_factory(engine: Engine) -> sessionmaker[Session]:
    # Rows stay readable after commit: routes build responses from what they just wrote.
    return sessionmaker(engine, expire_on_commit=False)

"""Database engines and sessions from the settings.

PostgreSQL (psycopg 3) in production; SQLite as the embedded default, in WAL mode so readers
do not block the writer, with foreign keys enforced (SQLite leaves them off unless asked) and a
busy timeout so concurrent requests wait for the write lock instead of failing.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, TypeVar

from sqlalchemy import Engine, create_engine, event
from sqlalchemy.engine import make_url
from sqlalchemy.orm import Session, sessionmaker

SQLITE_BUSY_TIMEOUT_S = 30

Row = TypeVar("Row")


def create_db_engine(url: str, *, pool_size: int = 5, max_connections: int = 15) -> Engine:
    """An engine for ``url`` whose pool keeps ``pool_size`` connections open and opens up to
    ``max_connections`` at once; creates the directory of a SQLite file if needed.

    The control plane sizes the pool for its threads (``app.py``): each thread that may touch
    the database can hold a connection at once, and since no request holds one while it waits
    for anything (``api/deps.py``), a thread waiting for a connection waits only for threads
    that are running.
    """
    kept = min(pool_size, max_connections)
    pool: dict[str, int] = {"pool_size": kept, "max_overflow": max_connections - kept}
    parsed = make_url(url)
    if parsed.get_backend_name() != "sqlite":
        return create_engine(url, pool_pre_ping=True, **pool)
    if parsed.database and parsed.database != ":memory:":
        Path(parsed.database).expanduser().parent.mkdir(parents=True, exist_ok=True)
    else:
        pool = {}  # one in-memory database per connection: SQLAlchemy's own pool for it
    engine = create_engine(
        url,
        connect_args={"check_same_thread": False, "timeout": SQLITE_BUSY_TIMEOUT_S},
        **pool,
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


def staged(session: Session, row: Row) -> Row:
    """``row`` added and flushed: its ids and defaults are set and a constraint it breaks
    fails now, while the caller commits only once what the row points at exists."""
    session.add(row)
    session.flush()
    return row

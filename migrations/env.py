"""Alembic environment for skytrain.

skytrain drives Alembic from Python (``skytrain db upgrade``, the server's start-up check,
tests), handing over an engine in ``config.attributes["engine"]``. Run from the command line
(``alembic -c migrations/alembic.ini ...``, for writing new revisions), the database is the
one the settings name (``SKYTRAIN_DATABASE_URL``).
"""

from __future__ import annotations

from alembic import context
from sqlalchemy import Engine

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Base
from skytrain_backend.db.session import create_db_engine

target_metadata = Base.metadata


def _engine() -> tuple[Engine, bool]:
    engine = context.config.attributes.get("engine")
    if engine is not None:
        return engine, False
    return create_db_engine(Settings().resolved_database_url), True


def run_migrations_offline() -> None:
    context.configure(
        url=Settings().resolved_database_url,
        target_metadata=target_metadata,
        literal_binds=True,
        dialect_opts={"paramstyle": "named"},
    )
    with context.begin_transaction():
        context.run_migrations()


def run_migrations_online() -> None:
    engine, owned = _engine()
    try:
        with engine.connect() as connection:
            context.configure(
                connection=connection,
                target_metadata=target_metadata,
                # SQLite cannot ALTER most things: later revisions rebuild tables in batches.
                render_as_batch=connection.dialect.name == "sqlite",
                compare_type=True,
            )
            with context.begin_transaction():
                context.run_migrations()
    finally:
        if owned:
            engine.dispose()


if context.is_offline_mode():
    run_migrations_offline()
else:
    run_migrations_online()

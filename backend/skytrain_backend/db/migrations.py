"""Alembic, driven from Python: upgrade, downgrade, current revision, schema check.

The revisions live in the checkout's ``migrations/``; an installed wheel carries them as
``skytrain_backend/_migrations``. The control plane refuses to start on a schema older than
its code (``SchemaOutdated``) unless auto-migration is on (the SQLite default).
"""

from __future__ import annotations

import logging
from pathlib import Path

from alembic import command
from alembic.config import Config
from alembic.runtime.migration import MigrationContext
from alembic.script import ScriptDirectory
from sqlalchemy import Engine

from skytrain_backend.db.session import create_db_engine
from skytrain_backend.errors import ConfigurationError, SchemaOutdated

_PACKAGE_DIR = Path(__file__).resolve().parents[1]


class _RevisionsRun(logging.Filter):
    """Alembic names its dialect ("Context impl ...", "Will assume ... DDL") each time it
    opens a context, so every start and every schema check logged it. Only the revisions an
    upgrade or downgrade runs are news (and anything above INFO)."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.levelno > logging.INFO or record.getMessage().startswith("Running ")


logging.getLogger("alembic.runtime.migration").addFilter(_RevisionsRun())


def script_location() -> Path:
    """The migrations shipped in the installed package, else the checkout's ``migrations/``."""
    for candidate in (_PACKAGE_DIR / "_migrations", _PACKAGE_DIR.parents[1] / "migrations"):
        if (candidate / "env.py").is_file():
            return candidate
    raise ConfigurationError(
        f"skytrain's migrations are missing (looked in {_PACKAGE_DIR / '_migrations'} and "
        f"{_PACKAGE_DIR.parents[1] / 'migrations'}): reinstall skytrain"
    )


def _config(engine: Engine) -> Config:
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    config.attributes["engine"] = engine
    return config


def head_revisions() -> set[str]:
    config = Config()
    config.set_main_option("script_location", str(script_location()))
    return set(ScriptDirectory.from_config(config).get_heads())


def current_revisions(engine: Engine) -> set[str]:
    with engine.connect() as connection:
        return set(MigrationContext.configure(connection).get_current_heads())


def upgrade(engine: Engine, revision: str = "head") -> None:
    command.upgrade(_config(engine), revision)


def downgrade(engine: Engine, revision: str) -> None:
    command.downgrade(_config(engine), revision)


def check_schema(engine: Engine) -> None:
    """Raise SchemaOutdated unless the database is at the revision this code expects."""
    current, heads = current_revisions(engine), head_revisions()
    if current != heads:
        shown = ", ".join(sorted(current)) or "empty"
        raise SchemaOutdated(
            f"the database schema is at revision {shown}, this skytrain needs "
            f"{', '.join(sorted(heads))}: run `skytrain db upgrade` "
            "(with the same SKYTRAIN_DATABASE_URL) and start again"
        )


def prepare_schema(engine: Engine, *, auto_migrate: bool) -> None:
    """Upgrade when allowed, then make sure the schema is current."""
    if auto_migrate:
        upgrade(engine)
    check_schema(engine)


def upgrade_url(url: str, revision: str = "head") -> None:
    """Upgrade the database at ``url`` (for the CLI and test fixtures)."""
    engine = create_db_engine(url)
    try:
        upgrade(engine, revision)
    finally:
        engine.dispose()

"""Alembic is the only way the schema changes: revisions and models agree, and migrate both ways."""

from __future__ import annotations

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect

from skytrain_backend.db import migrations
from skytrain_backend.db.models import Base
from skytrain_backend.errors import SchemaOutdated

TABLES = set(Base.metadata.tables)


def _differences(engine: Engine) -> list[object]:
    with engine.connect() as connection:
        return list(compare_metadata(MigrationContext.configure(connection), Base.metadata))


def _tables(engine: Engine) -> set[str]:
    return set(inspect(engine).get_table_names()) - {"alembic_version", "sqlite_sequence"}


def test_upgrade_downgrade_upgrade_matches_the_models(empty_engine: Engine) -> None:
    migrations.upgrade(empty_engine)
    assert _tables(empty_engine) == TABLES
    assert _differences(empty_engine) == []
    assert migrations.current_revisions(empty_engine) == migrations.head_revisions()

    migrations.downgrade(empty_engine, "base")
    assert _tables(empty_engine) == set()
    assert migrations.current_revisions(empty_engine) == set()

    migrations.upgrade(empty_engine)
    assert _tables(empty_engine) == TABLES
    assert _differences(empty_engine) == []


def test_an_outdated_schema_is_refused_with_the_fix(empty_engine: Engine) -> None:
    with pytest.raises(SchemaOutdated, match="run `skytrain db upgrade`"):
        migrations.check_schema(empty_engine)
    migrations.prepare_schema(empty_engine, auto_migrate=True)
    migrations.check_schema(empty_engine)
    assert migrations.current_revisions(empty_engine) == migrations.head_revisions()


def test_migrations_are_found_in_the_checkout() -> None:
    location = migrations.script_location()
    assert (location / "env.py").is_file()
    assert any((location / "versions").glob("*.py"))

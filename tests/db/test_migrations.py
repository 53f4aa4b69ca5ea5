"""Alembic is the only way the schema changes: revisions and models agree, and migrate both ways."""

from __future__ import annotations

import logging

import pytest
from alembic.autogenerate import compare_metadata
from alembic.runtime.migration import MigrationContext
from sqlalchemy import Engine, inspect, text

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


def test_a_current_schema_is_checked_without_a_log_line_and_an_upgrade_says_what_it_runs(
    empty_engine: Engine, caplog: pytest.LogCaptureFixture
) -> None:
    """Every start checks the schema: alembic's "Context impl" lines are noise there. Only an
    upgrade that runs a revision logs, one line per revision."""
    caplog.set_level(logging.INFO, logger="alembic")
    migrations.prepare_schema(empty_engine, auto_migrate=True)
    ran = [r.getMessage() for r in caplog.records if r.name.startswith("alembic")]
    assert ran and all(line.startswith("Running upgrade") for line in ran), ran
    caplog.clear()
    migrations.prepare_schema(empty_engine, auto_migrate=True)
    migrations.check_schema(empty_engine)
    assert migrations.current_revisions(empty_engine) == migrations.head_revisions()
    assert [r.getMessage() for r in caplog.records if r.name.startswith("alembic")] == []


def test_migrations_are_found_in_the_checkout() -> None:
    location = migrations.script_location()
    assert (location / "env.py").is_file()
    assert any((location / "versions").glob("*.py"))


def test_existing_entity_names_go_to_their_tenant_or_their_first_user(
    empty_engine: Engine,
) -> None:
    """Revision i38e gives each entity already used to one tenant: the one named so if it
    has a model there, otherwise the one whose model there is oldest."""
    migrations.upgrade(empty_engine, "i26a")
    rows = [
        # (tenant, entity, created): tb used "ta" first, but ta is named so; tb used "x" first.
        ("tb", "ta", "2026-01-01"),
        ("ta", "ta", "2026-02-01"),
        ("ta", "x", "2026-03-01"),
        ("tb", "x", "2026-01-15"),
    ]
    with empty_engine.begin() as connection:
        for name in ("ta", "tb"):
            connection.execute(
                text(
                    "INSERT INTO tenants (id, name, created_at, limits) VALUES (:n, :n, :t, '{}')"
                ),
                {"n": name, "t": "2026-01-01"},
            )
        for index, (tenant, entity, created) in enumerate(rows):
            connection.execute(
                text(
                    "INSERT INTO models (id, tenant_id, entity, project, name, base_model, "
                    "config, run_id, created_at) VALUES (:id, :tenant, :entity, 'p', 'm', 'b', "
                    "'{}', :id, :created)"
                ),
                {"id": f"m{index}", "tenant": tenant, "entity": entity, "created": created},
            )

    migrations.upgrade(empty_engine)

    with empty_engine.connect() as connection:
        owners = dict(connection.execute(text("SELECT name, tenant_id FROM entities")).all())
    assert owners == {"ta": "ta", "x": "tb"}


def test_the_tenants_running_total_is_backfilled_and_nothing_referring_to_it_is_lost(
    empty_engine: Engine,
) -> None:
    """Revision i38s adds ``tenants.storage_bytes``, the sum of what each tenant's rows hold.
    Adding it by SQLite's batch copy of ``tenants`` would drop the old table, and with foreign
    keys on that cascades to every model, key and session of every tenant."""
    migrations.upgrade(empty_engine, "i36a")
    with empty_engine.begin() as connection:
        connection.execute(
            text("INSERT INTO tenants (id, name, created_at, limits) VALUES ('t', 't', :c, '{}')"),
            {"c": "2026-01-01"},
        )
        connection.execute(
            text(
                "INSERT INTO models (id, tenant_id, entity, project, name, base_model, config, "
                "run_id, created_at) VALUES ('m', 't', 't', 'p', 'm', 'b', '{}', 'm', :c)"
            ),
            {"c": "2026-01-01"},
        )
        connection.execute(
            text(
                "INSERT INTO trajectory_batches (id, model_id, split, step, uri, num_groups, "
                "num_trajectories, metrics, size_bytes, created_at) "
                "VALUES ('b', 'm', 'train', 0, 'file:///x', 1, 2, '{}', 1000, :c)"
            ),
            {"c": "2026-01-01"},
        )
        connection.execute(
            text(
                "INSERT INTO tinker_sessions (id, tenant_id, sdk_version, tags, user_metadata, "
                "size_bytes, created_at, last_heartbeat_at) "
                "VALUES ('s', 't', 'x', '[]', '{}', 234, :c, :c)"
            ),
            {"c": "2026-01-01"},
        )

    migrations.upgrade(empty_engine)

    with empty_engine.connect() as connection:
        assert connection.scalar(text("SELECT storage_bytes FROM tenants")) == 1234
        assert connection.scalar(text("SELECT count(*) FROM models")) == 1
        assert connection.scalar(text("SELECT count(*) FROM trajectory_batches")) == 1
        assert connection.scalar(text("SELECT count(*) FROM tinker_sessions")) == 1

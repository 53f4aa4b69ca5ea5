"""What the schema promises on both databases: UTC timestamps, increasing event ids,
cascading deletes, unique steps."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta, timezone

import pytest
from sqlalchemy import Engine, func, select
from sqlalchemy.exc import IntegrityError

from skytrain_backend.db import api_keys, jobs, migrations, registry
from skytrain_backend.db.models import Checkpoint, TrainingJobEvent
from skytrain_backend.db.session import session_factory
from tests.fixtures.rows import add_model, add_rl_job


@pytest.fixture
def engine(empty_engine: Engine) -> Engine:
    migrations.upgrade(empty_engine)
    return empty_engine


def _model(engine: Engine) -> str:
    with session_factory(engine)() as session:
        return add_model(session, "m", base_model="b", project="p").id


def test_timestamps_come_back_aware_and_in_utc(engine: Engine) -> None:
    model_id = _model(engine)
    eastern = datetime(2026, 1, 1, 12, 0, tzinfo=timezone(timedelta(hours=5)))
    with session_factory(engine)() as session:
        checkpoint = session.scalars(
            select(Checkpoint).where(Checkpoint.model_id == model_id)
        ).one()
        checkpoint.deleted_at = eastern
        session.commit()
    with session_factory(engine)() as session:
        stored = session.scalars(select(Checkpoint).where(Checkpoint.model_id == model_id)).one()
        assert stored.deleted_at == eastern
        assert stored.deleted_at is not None and stored.deleted_at.tzinfo == UTC
        assert stored.deleted_at.hour == 7
        assert stored.created_at.tzinfo == UTC


def test_event_ids_increase_and_deleting_a_model_cascades(engine: Engine) -> None:
    model_id = _model(engine)
    sessions = session_factory(engine)
    with sessions() as session:
        job = add_rl_job(session, model_id, job_id="j" * 32)
        ids = [
            jobs.add_event(session, job_id=job.id, type="gradient_step", data={"n": n}).id
            for n in range(3)
        ]
        session.commit()
        assert ids == sorted(ids) and len(set(ids)) == 3
    with sessions() as session:
        tenant = api_keys.get_or_create_tenant(session, name="acme")
        model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
        registry.delete_model_rows(session, model=model)
        assert session.scalar(select(func.count()).select_from(TrainingJobEvent)) == 0
        assert session.scalar(select(func.count()).select_from(Checkpoint)) == 0


@pytest.mark.slow
def test_a_step_is_committed_once(engine: Engine) -> None:
    model_id = _model(engine)
    with session_factory(engine)() as session:
        session.add(Checkpoint(model_id=model_id, step=0, uri=None, metrics={}))
        with pytest.raises(IntegrityError):
            session.commit()

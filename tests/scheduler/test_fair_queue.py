"""Training jobs are leased round-robin across tenants, on real job rows in real databases:
one tenant's long queue does not hold back another tenant's job."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import keys, migrations, registry
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, Worker, new_id
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.scheduler import queue

LEASE_S = 60.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sessions(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[sessionmaker[Session]]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'skytrain.db'}"
    else:
        url = request.getfixturevalue("make_postgres_url")()
    engine = create_db_engine(url)
    migrations.upgrade(engine)
    yield session_factory(engine)
    engine.dispose()


def _model(session: Session, *, tenant: str, name: str, worker: Worker) -> Model:
    owner = keys.get_or_create_tenant(session, name=tenant)
    model, _ = registry.create_model(
        session,
        tenant=owner,
        entity=tenant,
        project="p",
        name=name,
        base_model="base",
        config={},
        return_existing=False,
    )
    model.worker_id = worker.id
    session.commit()
    return model


def _queue_jobs(session: Session, model: Model, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        job = job_rows.add_job(
            session,
            job_id=new_id(),
            model_id=model.id,
            kind="rl",
            config={},
            input_uri="unused",
            num_groups=1,
            num_trajectories=2,
            max_attempts=3,
        )
        session.commit()
        ids.append(job.id)
    return ids


def _run_next(session: Session, worker: Worker) -> str:
    """Lease the worker's next job and end it, as a worker does one job at a time."""
    job = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
    assert job is not None
    queue.fail_job(
        session,
        worker=worker,
        job_id=job.id,
        attempt=job.attempts,
        error_message="done",
        retryable=False,
        cancelled=False,
    )
    return job.id


def test_one_tenants_thirty_queued_jobs_do_not_all_run_before_another_tenants_one(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider="local", base_model="base", max_models=8, status="ready"
        )
        session.commit()
        busy = [_model(session, tenant="busy", name=f"m{i}", worker=worker) for i in range(3)]
        busy_jobs = set()
        for model in busy:
            busy_jobs |= set(_queue_jobs(session, model, 10))
        quiet = _model(session, tenant="quiet", name="m", worker=worker)
        (quiet_job,) = _queue_jobs(session, quiet, 1)  # queued after all thirty

        first = _run_next(session, worker)
        second = _run_next(session, worker)
        third = _run_next(session, worker)

    assert first in busy_jobs
    assert second == quiet_job  # its turn, not the 2nd of the busy tenant's thirty
    assert third in busy_jobs


def test_tenants_alternate_while_both_have_jobs_queued(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        worker, _ = worker_rows.create_worker(
            session, provider="local", base_model="base", max_models=8, status="ready"
        )
        session.commit()
        owners = {}
        for tenant in ("a", "b"):
            for index in range(2):
                model = _model(session, tenant=tenant, name=f"m{index}", worker=worker)
                owners |= dict.fromkeys(_queue_jobs(session, model, 3), tenant)
        order = [owners[_run_next(session, worker)] for _ in range(8)]
    assert order in (["a", "b"] * 4, ["b", "a"] * 4)

"""Training jobs are leased round-robin across tenants, on real job rows in real databases:
one tenant's long queue does not hold back another tenant's job, and one tenant's long job
yields its worker to another tenant's waiting job once it has had its time slice."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db.models import Model, TrainingJob, Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import CheckpointFile, JobFailure, JobPreemption
from skytrain_backend.scheduler import garbage, queue
from skytrain_backend.storage import ObjectStore
from skytrain_backend.storage.local import LocalObjectStore
from tests.fixtures.rows import add_model, add_ready_worker, add_rl_job
from tests.fixtures.services import MakeSettings

LEASE_S = 60.0


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def sessions(
    request: pytest.FixtureRequest, make_settings: MakeSettings
) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(make_settings(database=request.param).storage.resolved_database_url)
    yield session_factory(engine)
    engine.dispose()


def _model(session: Session, *, tenant: str, name: str, worker: Worker) -> Model:
    model = add_model(session, name, base_model="base", tenant=tenant, project="p")
    model.worker_id = worker.id
    session.commit()
    return model


def _queue_jobs(session: Session, model: Model, count: int) -> list[str]:
    ids = []
    for _ in range(count):
        job = add_rl_job(session, model.id)
        session.commit()
        ids.append(job.id)
    return ids


def _run_next(session: Session, worker: Worker) -> str:
    """Lease the worker's next job and end it, as a worker does one job at a time."""
    job = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
    assert job is not None
    queue.fail_job(
        session,
        JobFailure(attempt=job.attempts, error_message="done"),
        worker=worker,
        job_id=job.id,
    )
    return job.id


def test_one_tenants_thirty_queued_jobs_do_not_all_run_before_another_tenants_one(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        worker = add_ready_worker(session)
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
        worker = add_ready_worker(session)
        owners = {}
        for tenant in ("a", "b"):
            for index in range(2):
                model = _model(session, tenant=tenant, name=f"m{index}", worker=worker)
                owners |= dict.fromkeys(_queue_jobs(session, model, 3), tenant)
        order = [owners[_run_next(session, worker)] for _ in range(8)]
    assert order in (["a", "b"] * 4, ["b", "a"] * 4)


# --- time slices -------------------------------------------------------------------------------


def _worker(session: Session) -> Worker:
    return add_ready_worker(session)


def _stage_state(store: ObjectStore, session: Session, job_id: str) -> list[CheckpointFile]:
    """What a worker uploads when it yields: the job's state as the attempt's files."""
    job = session.get_one(TrainingJob, job_id)
    tenant_id = session.get_one(Model, job.model_id).tenant_id
    files = {"adapter_model.safetensors": b"weights", "progress.pt": b"position"}
    for name, data in files.items():
        store.put_bytes(
            queue.staged_file_key(job, tenant_id=tenant_id, attempt=job.attempts, name=name), data
        )
    return [CheckpointFile(name=name, size=len(data)) for name, data in files.items()]


def test_a_job_past_its_time_slice_yields_only_to_another_tenants_waiting_job(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        worker = _worker(session)
        (long,) = _queue_jobs(session, _model(session, tenant="a", name="long", worker=worker), 1)
        _queue_jobs(session, _model(session, tenant="a", name="next", worker=worker), 1)
        queue.lease_job(session, worker=worker, lease_s=LEASE_S)
        elsewhere = _worker(session)
        # Another tenant's job for another worker does not count either.
        _queue_jobs(session, _model(session, tenant="b", name="other", worker=elsewhere), 1)
        assert queue.request_yields(session, slice_s=0) == []  # only its own tenant's job waits

        (waiting,) = _queue_jobs(session, _model(session, tenant="b", name="m", worker=worker), 1)
        assert queue.request_yields(session, slice_s=3600) == []  # its slice is not over
        assert [job.id for job in queue.request_yields(session, slice_s=0)] == [long]
        renewed = queue.renew_lease(session, worker=worker, job_id=long, attempt=1, lease_s=LEASE_S)
        assert renewed.yield_requested
        assert queue.request_yields(session, slice_s=0) == []  # asked once
        assert session.get_one(TrainingJob, waiting).status == "queued"


def test_a_yielded_job_goes_behind_the_job_it_yielded_to_and_resumes_from_its_state(
    sessions: sessionmaker[Session], tmp_path: Path
) -> None:
    store = LocalObjectStore(tmp_path / "objects")
    with sessions() as session:
        worker = _worker(session)
        (long,) = _queue_jobs(session, _model(session, tenant="a", name="long", worker=worker), 1)
        leased = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
        assert leased is not None and leased.id == long
        # Tenant b's newest lease (on another worker) is newer than the yielding job's.
        elsewhere = _worker(session)
        _queue_jobs(session, _model(session, tenant="b", name="busy", worker=elsewhere), 1)
        assert queue.lease_job(session, worker=elsewhere, lease_s=LEASE_S) is not None
        (waiting,) = _queue_jobs(session, _model(session, tenant="b", name="m", worker=worker), 1)
        files = _stage_state(store, session, long)

        def preempt(steps_done: int, attempt: int) -> TrainingJob:
            return queue.preempt_job(
                session,
                JobPreemption(attempt=attempt, steps_done=steps_done, files=files),
                store=store,
                worker=worker,
                job_id=long,
            )

        with pytest.raises(InvalidRequest, match="was not asked to yield"):
            preempt(3, attempt=1)
        queue.request_yields(session, slice_s=0)
        wrong = [CheckpointFile(name="progress.pt", size=999)]
        with pytest.raises(InvalidRequest, match=r"not in the store as named: \['progress.pt"):
            queue.preempt_job(
                session,
                JobPreemption(attempt=1, steps_done=3, files=wrong),
                store=store,
                worker=worker,
                job_id=long,
            )
        assert session.get_one(TrainingJob, long).status == "running"  # nothing changed

        # The worker's engine slept for the job and woke before handing it back: it serves
        # again from the hand-back on, not from its next heartbeat.
        worker.status = "sleeping"
        session.commit()
        yielded = preempt(3, attempt=1)
        assert (yielded.status, yielded.attempts, yielded.preemptions) == ("queued", 1, 1)
        assert worker.status == "training"
        (event,) = job_rows.list_events(session, job_id=long, limit=10)[0]
        assert event.type == "training_preempted"
        assert event.data["steps_done"] == 3
        # The saved state outlives the sweep of files staged by attempts that are over.
        garbage.collect_garbage(session, store=store, written_before=utcnow() + timedelta(days=1))
        assert len(store.list(queue.saved_state_prefix(yielded, tenant_id=_tenant(session, long))))

        # The waiting job first: the yield ended tenant a's turn, though b's lease is newer
        # than a's and the yielded job is older.
        assert _run_next(session, worker) == waiting
        resumed = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
        assert resumed is not None and resumed.id == long
        handed = queue.job_for_worker(session, resumed)
        assert (handed.attempt, handed.steps_done, handed.base_step) == (2, 3, 0)

        # A yield is not a failure: with max_attempts=3, two losses after it still requeue.
        for attempt in (2, 3):
            queue.release_jobs(session, jobs=[resumed], reason="worker lost")
            assert resumed.status == "queued", attempt
            resumed = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
            assert resumed is not None and resumed.attempts == attempt + 1
        assert queue.job_for_worker(session, resumed).steps_done == 3


def _tenant(session: Session, job_id: str) -> str:
    job = session.get_one(TrainingJob, job_id)
    return session.get_one(Model, job.model_id).tenant_id

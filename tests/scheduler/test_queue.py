"""The job queue on real databases: concurrent leasing, lease expiry and retries, exactly-once
commits, cancellation, one running job per model."""

from __future__ import annotations

import hashlib
import threading
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy import Result, event, func, inspect, select, update
from sqlalchemy.orm import ORMExecuteState, Session, sessionmaker

from skytrain_backend.api.route_cache import RouteCache
from skytrain_backend.config import Settings
from skytrain_backend.db import jobs as job_rows
from skytrain_backend.db import migrations
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    TrainingJob,
    TrainingJobEvent,
    Worker,
    utcnow,
)
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.protocol import JobCompletion, JobFailure, StagedFile
from skytrain_backend.scheduler import placement, queue, scale_in
from skytrain_backend.scheduler.serving import serving_status
from skytrain_backend.storage import LocalObjectStore
from skytrain_backend.storage import keys as object_keys
from tests.fixtures.rows import add_model, add_ready_worker, add_rl_job

LEASE_S = 60.0
NO_QUOTA = TenantLimits.defaults(
    Settings(tenant_limits={"max_placed_models": 100, "max_workers": 100})
)


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


@pytest.fixture
def store(tmp_path: Path) -> LocalObjectStore:
    return LocalObjectStore(tmp_path / "objects")


def _model(session: Session, name: str = "agent") -> Model:
    return add_model(session, name, base_model="base", tenant="tenant", project="p")


def _worker(session: Session) -> Worker:
    return add_ready_worker(session)


def _job(session: Session, model: Model, *, max_attempts: int = 3) -> TrainingJob:
    job = add_rl_job(
        session,
        model.id,
        job_id=f"job{session.scalar(select(func.count(TrainingJob.id))) or 0:04d}{model.id[:8]}",
        max_attempts=max_attempts,
    )
    session.commit()
    return job


def _place(session: Session, model: Model, worker: Worker) -> None:
    model.worker_id = worker.id
    session.commit()


def _placement_pass(
    session: Session, *, max_workers: int, launch: Callable[[str], None] | None = None
) -> None:
    """A placement pass where neither the idle clock nor a tenant's quota is the subject."""
    placement.place_models(
        session,
        idle_timeout_s=600,
        max_workers=max_workers,
        launch=launch,
        limits=lambda _tenant_id: NO_QUOTA,
    )


def _placed(session: Session) -> tuple[Worker, Model]:
    """A ready worker and a model placed on it."""
    worker, model = _worker(session), _model(session)
    _place(session, model, worker)
    return worker, model


def _leased(session: Session) -> tuple[Worker, Model, TrainingJob]:
    """A model placed on a worker, and a job of it the worker leased (attempt 1)."""
    worker, model = _placed(session)
    job = _job(session, model)
    queue.lease_job(session, worker=worker, lease_s=LEASE_S)
    return worker, model, job


def _fail(
    session: Session, worker: Worker, job_id: str, error_message: str, *, cancelled: bool = False
) -> None:
    """The worker reports attempt 1 failed for good (or cancelled)."""
    report = JobFailure(attempt=1, error_message=error_message, cancelled=cancelled)
    queue.fail_job(session, report, worker=worker, job_id=job_id)


def _complete(
    session: Session,
    store: LocalObjectStore,
    worker: Worker,
    job_id: str,
    *,
    attempt: int,
    files: list[StagedFile],
    metrics: dict[str, float] | None = None,
) -> None:
    """The worker reports ``attempt`` trained step 1 with those staged files."""
    report = JobCompletion(attempt=attempt, step=1, metrics=metrics or {}, files=files)
    queue.complete_job(
        session, report, store=store, worker=worker, job_id=job_id, settings=Settings()
    )


def _stage_files(
    store: LocalObjectStore, job: TrainingJob, model: Model, attempt: int
) -> list[StagedFile]:
    """Stage an adapter's files for ``attempt``; what its worker's completion says of them."""
    staged = []
    for name in ("adapter_config.json", "adapter_model.safetensors"):
        key = queue.staged_file_key(job, tenant_id=model.tenant_id, attempt=attempt, name=name)
        data = f"{name} of attempt {attempt}".encode()
        store.put_bytes(key, data)
        staged.append(
            StagedFile(name=name, size=len(data), sha256=hashlib.sha256(data).hexdigest())
        )
    return staged


def test_concurrent_workers_never_lease_the_same_job(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        workers = [_worker(session) for _ in range(6)]
        for index in range(12):  # twelve models, one job each, all placed on every worker's pool
            model = _model(session, f"m{index}")
            _place(session, model, workers[index % len(workers)])
            _job(session, model)
    leased: list[str] = []
    errors: list[BaseException] = []
    barrier = threading.Barrier(len(workers))

    def work(worker_id: str) -> None:
        try:
            with sessions() as session:
                worker = session.get_one(Worker, worker_id)
                barrier.wait()
                while (job := queue.lease_job(session, worker=worker, lease_s=LEASE_S)) is not None:
                    leased.append(job.id)
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w.id,)) for w in workers]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors
    assert len(leased) == len(set(leased)) == 12
    with sessions() as session:
        assert (
            session.scalar(
                select(func.count(TrainingJob.id)).where(TrainingJob.status == "running")
            )
            == 12
        )


def test_a_model_runs_one_job_at_a_time(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        worker, model = _placed(session)
        first, second = _job(session, model), _job(session, model)
        assert queue.lease_job(session, worker=worker, lease_s=LEASE_S).id == first.id  # type: ignore[union-attr]
        assert queue.lease_job(session, worker=worker, lease_s=LEASE_S) is None
        _fail(session, worker, first.id, "bad data")
        assert queue.lease_job(session, worker=worker, lease_s=LEASE_S).id == second.id  # type: ignore[union-attr]


def test_only_jobs_of_models_placed_on_the_worker_are_leased(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        mine, other = _worker(session), _worker(session)
        model = _model(session)
        _place(session, model, other)
        _job(session, model)
        assert queue.lease_job(session, worker=mine, lease_s=LEASE_S) is None
        assert queue.lease_job(session, worker=other, lease_s=LEASE_S) is not None


def test_a_lease_handed_back_is_uncounted_and_a_cancel_that_came_meanwhile_ends_it(
    sessions: sessionmaker[Session],
) -> None:
    """``unlease``: the worker hung up before it got the job. Queued again as never leased,
    even when that lease was its last attempt (or cancelled, if a cancel came meanwhile); a
    job held otherwise is left alone."""
    with sessions() as session:
        worker, other = _worker(session), _worker(session)
        model = _model(session)
        _place(session, model, worker)
        job = _job(session, model, max_attempts=1)
        job_id = job.id
        assert queue.lease_job(session, worker=worker, lease_s=LEASE_S).id == job_id  # type: ignore[union-attr]
        queue.unlease(session, worker_id=other.id, job_id=job_id, attempt=1)  # not its lease
        queue.unlease(session, worker_id=worker.id, job_id=job_id, attempt=2)  # not this attempt
        assert session.get_one(TrainingJob, job_id).status == "running"

        queue.unlease(session, worker_id=worker.id, job_id=job_id, attempt=1)
        handed_back = session.get_one(TrainingJob, job_id)
        assert (handed_back.status, handed_back.attempts, handed_back.worker_id) == (
            "queued",
            0,
            None,
        )
        assert handed_back.started_at is None

        leased = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
        assert leased is not None and leased.attempts == 1
        leased.cancel_requested = True
        session.commit()
        queue.unlease(session, worker_id=worker.id, job_id=job_id, attempt=1)
        assert session.get_one(TrainingJob, job_id).status == "cancelled"


def _expire(session: Session, job_id: str) -> None:
    """Move the lease's end into the past, as if the worker had gone silent."""
    session.execute(
        update(TrainingJob)
        .where(TrainingJob.id == job_id)
        .values(lease_expires_at=utcnow() - timedelta(seconds=1))
    )
    session.commit()


def test_an_expired_lease_is_retried_then_fails_with_the_reason(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        worker, model = _placed(session)
        job = _job(session, model, max_attempts=2)
        for attempt in (1, 2):
            leased = queue.lease_job(session, worker=worker, lease_s=LEASE_S)
            assert leased is not None and leased.attempts == attempt
            _expire(session, job.id)
            assert queue.expire_leases(session) == 1
        session.refresh(job)
        assert job.status == "failed"
        assert "gave up after 2 attempts" in (job.error or "")
        assert "stopped renewing its lease" in (job.error or "")
        events = list(
            session.scalars(select(TrainingJobEvent).where(TrainingJobEvent.job_id == job.id))
        )
        assert [e.type for e in events] == ["training_failed"]


def test_a_step_is_committed_once_and_a_stale_attempt_is_refused(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    with sessions() as session:
        old_worker, new_worker, model = _worker(session), _worker(session), _model(session)
        _place(session, model, old_worker)
        job = _job(session, model)
        queue.lease_job(session, worker=old_worker, lease_s=LEASE_S)
        stale = _stage_files(store, job, model, attempt=1)
        _expire(session, job.id)
        queue.expire_leases(session)  # the old worker went silent; the job is queued again
        _place(session, model, new_worker)
        assert queue.lease_job(session, worker=new_worker, lease_s=LEASE_S) is not None
        staged = _stage_files(store, job, model, attempt=2)
        _complete(
            session,
            store,
            new_worker,
            job.id,
            attempt=2,
            files=staged,
            metrics={"loss/policy": 0.5},
        )
        # The stale first attempt wakes up and tries to commit its result and upload again.
        with pytest.raises(queue.LeaseLost):
            _complete(session, store, old_worker, job.id, attempt=1, files=stale[:1])
        with pytest.raises(queue.LeaseLost):
            queue.renew_lease(session, worker=old_worker, job_id=job.id, attempt=1, lease_s=LEASE_S)
        steps = list(
            session.scalars(select(Checkpoint.step).where(Checkpoint.model_id == model.id))
        )
        assert sorted(steps) == [0, 1]
        row = session.scalars(
            select(Checkpoint).where(Checkpoint.model_id == model.id, Checkpoint.step == 1)
        ).one()
        assert row.uri is not None
        committed = object_keys.committed_prefix(
            tenant_id=model.tenant_id, model_id=model.id, uri=row.uri
        )
        assert store.get_bytes(f"{committed}adapter_model.safetensors") == (
            b"adapter_model.safetensors of attempt 2"
        )
        # Staged files are cleaned up once committed.
        assert not [o for o in store.list() if "/attempts/" in o.key]
        session.refresh(job)
        assert (job.status, job.result_step, job.attempts) == ("succeeded", 1, 2)
        assert {"model_id": model.id, "step": 1} in session.get_one(Worker, new_worker.id).served


def test_a_commit_from_a_sleeping_worker_serves_the_new_step_on_the_next_request(
    sessions: sessionmaker[Session], store: LocalObjectStore
) -> None:
    """A worker whose engine slept for the job woke it and loaded the new step before it
    completed (worker/jobs.py): the commit routes the next request there, without waiting for
    the worker's next heartbeat to say it is awake. A sharded e2e worker's first request after
    ``training_ended`` got 503 "its engine sleeps" that way."""
    with sessions() as session:
        worker, model, job = _leased(session)
        worker.status = "sleeping"  # its heartbeat as the engine went to sleep
        session.commit()
        assert serving_status(session, model=model).state == "training"
        staged = _stage_files(store, job, model, attempt=1)
        _complete(session, store, worker, job.id, attempt=1, files=staged)
        routed = serving_status(session, model=model)
        assert (routed.ready, routed.step, routed.worker_id) == (True, 1, worker.id)


def test_a_running_job_is_cancelled_through_its_worker(sessions: sessionmaker[Session]) -> None:
    with sessions() as session:
        worker, _, job = _leased(session)
        job_rows.cancel_job(session, job=job)
        renewed = queue.renew_lease(
            session, worker=worker, job_id=job.id, attempt=1, lease_s=LEASE_S
        )
        assert renewed.cancel_requested
        _fail(session, worker, job.id, "cancelled by the user", cancelled=True)
        session.refresh(job)
        assert job.status == "cancelled"


def test_a_lost_worker_frees_its_models_and_requeues_its_job(
    sessions: sessionmaker[Session],
) -> None:
    with sessions() as session:
        worker, model, job = _leased(session)
        placement.worker_gone(session, worker=worker, status="lost", reason="no heartbeat")
        session.refresh(job)
        session.refresh(model)
        assert (job.status, job.worker_id, model.worker_id) == ("queued", None, None)


class _ClearsInThisThread(RouteCache[str]):
    """Counts the clears a commit in the test's own thread makes. Every commit in the process
    clears every cache, and a control plane another test module left running in this pytest
    process (a session fixture, its scheduler in a thread) commits too."""

    def __init__(self) -> None:
        super().__init__(ttl_s=60)
        self.clears = 0
        self._thread = threading.get_ident()

    def clear(self) -> None:
        if threading.get_ident() == self._thread:
            self.clears += 1
        super().clear()


def test_placement_keeps_a_placement_committed_after_the_pass_read_the_model(
    sessions: sessionmaker[Session],
) -> None:
    """A pass that read the model unplaced does not write over a placement committed before
    its own (a leader taking over, an operator): nor does it empty the route caches."""
    cache = _ClearsInThisThread()
    clears: list[int] = []
    with sessions() as session:
        emptiest, chosen = _worker(session), _worker(session)
        model = _model(session)
        placement.mark_model_active(session, model=model, min_interval_s=0)

    def placed_meanwhile(_tenant_id: str) -> TenantLimits:
        # Called by the pass after it read the model, before it places it.
        with sessions() as other:
            other.get_one(Model, model.id).worker_id = chosen.id
            other.commit()
        clears.append(cache.clears)
        return NO_QUOTA

    with sessions() as session:
        placement.place_models(
            session,
            idle_timeout_s=600,
            max_workers=2,
            launch=None,
            limits=placed_meanwhile,
        )
    with sessions() as session:
        assert session.get_one(Model, model.id).worker_id == chosen.id != emptiest.id
    assert clears == [cache.clears]


@pytest.mark.parametrize("went", ["lost", "draining", "deleted"])
def test_placement_skips_a_worker_gone_after_the_pass_read_it(
    sessions: sessionmaker[Session], went: str
) -> None:
    """A worker that went away between the pass's read of the workers and its write (lost,
    asked to drain, its row deleted by hand) gets no model: the model waits for the next pass,
    and the worker's row is not written."""
    with sessions() as session:
        worker, model = _worker(session), _model(session)
        placement.mark_model_active(session, model=model, min_interval_s=0)
    left: list[Worker] = []

    def gone_after_the_read(state: ORMExecuteState) -> Result[Any] | None:
        # The pass's read of the workers runs, then the worker goes away, then the pass goes on.
        if left or not state.is_select or state.bind_mapper is not inspect(Worker):
            return None
        read = state.invoke_statement().freeze()
        with sessions() as other:
            row = other.get_one(Worker, worker.id)
            if went == "lost":
                placement.worker_gone(other, worker=row, status="lost", reason="no heartbeat")
            elif went == "draining":
                row.status = "draining"
                other.commit()
            else:
                other.delete(row)
                other.commit()
            left.append(row)
        return read()

    with sessions() as session:
        event.listen(session, "do_orm_execute", gone_after_the_read)
        _placement_pass(session, max_workers=1)
    assert left, "the pass never read the workers"
    with sessions() as session:
        assert session.get_one(Model, model.id).worker_id is None
        after = session.get(Worker, worker.id)
        if went == "deleted":
            assert after is None
        else:
            assert after is not None
            assert (after.status, after.last_active_at) == (went, left[0].last_active_at)


def test_placement_prefers_a_worker_with_room_and_launches_only_within_the_limit(
    sessions: sessionmaker[Session],
) -> None:
    launches: list[str] = []
    with sessions() as session:
        full = _worker(session)
        full.capacity = {"max_models": 1}
        session.commit()
        first, second, third = (_model(session, name) for name in ("a", "b", "c"))
        for model in (first, second, third):
            placement.mark_model_active(session, model=model, min_interval_s=0)
        _placement_pass(session, max_workers=1, launch=launches.append)
        placed = [session.get_one(Model, m.id).worker_id for m in (first, second, third)]
        assert placed.count(full.id) == 1 and placed.count(None) == 2
        assert launches == []  # max_workers=1 is reached: nothing more is launched
        _placement_pass(session, max_workers=2, launch=launches.append)
        assert launches == ["base"]  # one launch per base model per pass


def _time_passes(session: Session, seconds: float) -> None:
    """Move every model's last activity ``seconds`` into the past."""
    for row in session.scalars(select(Model).execution_options(populate_existing=True)):
        assert row.last_active_at is not None
        row.last_active_at -= timedelta(seconds=seconds)
    session.commit()


def test_a_model_waiting_for_its_worker_does_not_go_idle_meanwhile(
    sessions: sessionmaker[Session],
) -> None:
    """A worker takes minutes to launch on a cloud, longer than a model's idle timeout may
    be: the model that asked for it must still be active when it registers, or the worker
    finds nothing to serve and the user's model is never served. The idle clock stands still
    while the model waits, and starts again when it is placed."""
    idle_timeout_s = 10.0
    launches: list[str] = []

    def a_pass(session: Session) -> None:
        placement.place_models(
            session,
            idle_timeout_s=idle_timeout_s,
            max_workers=1,
            launch=launches.append,
            limits=lambda _tenant_id: NO_QUOTA,
        )

    with sessions() as session:
        model = _model(session)
        placement.mark_model_active(session, model=model, min_interval_s=0)
        a_pass(session)
        assert launches == ["base"]
        for _ in range(3):  # 18 s of launching, with passes between
            _time_passes(session, 0.6 * idle_timeout_s)
            a_pass(session)
        worker = _worker(session)
        a_pass(session)
        placed = session.get_one(Model, model.id)
        session.refresh(placed)
        assert placed.worker_id == worker.id
        assert placed.last_active_at is not None
        assert placed.last_active_at > utcnow() - timedelta(seconds=idle_timeout_s / 2)
        # Once placed and unused, it goes idle as before.
        _time_passes(session, idle_timeout_s + 1)
        assert placement.release_idle_models(session, idle_timeout_s=idle_timeout_s) == 1


def test_a_model_on_a_worker_still_starting_does_not_go_idle_meanwhile(
    sessions: sessionmaker[Session],
) -> None:
    """Placed on a worker that is still starting (loading the model, starting vLLM: minutes),
    a model is not served yet: it keeps its place, and its idle clock runs only once the
    worker serves it."""
    idle_timeout_s = 10.0

    with sessions() as session:
        worker, model = _worker(session), _model(session)
        worker.status = "starting"
        session.commit()
        placement.mark_model_active(session, model=model, min_interval_s=0)
        _place(session, model, worker)
        for _ in range(3):  # 18 s of starting
            _time_passes(session, 0.6 * idle_timeout_s)
            assert placement.release_idle_models(session, idle_timeout_s=idle_timeout_s) == 0
        worker.status = "ready"
        session.commit()
        assert placement.release_idle_models(session, idle_timeout_s=idle_timeout_s) == 0
        assert scale_in.idle_workers(session, idle_timeout_s=idle_timeout_s) == []
        _time_passes(session, idle_timeout_s + 1)
        assert placement.release_idle_models(session, idle_timeout_s=idle_timeout_s) == 1
        session.refresh(model)
        assert model.worker_id is None


def test_a_pass_with_no_idle_clock_to_hold_empties_no_route_cache(
    sessions: sessionmaker[Session],
) -> None:
    """The gateway's route caches are emptied by any UPDATE of the models table: a pass that
    has no model's idle clock to hold writes none, so cached routes outlive it."""
    cache = _ClearsInThisThread()
    with sessions() as session:
        worker, model = _worker(session), _model(session)
        placement.mark_model_active(session, model=model, min_interval_s=0)
        _place(session, model, worker)
        worker.status = "starting"
        session.commit()
        before = cache.clears
        assert placement.release_idle_models(session, idle_timeout_s=600) == 0
        assert cache.clears == before
        model.last_active_at = utcnow() - timedelta(seconds=400)  # past half the timeout
        session.commit()
        before = cache.clears
        assert placement.release_idle_models(session, idle_timeout_s=600) == 0
        assert cache.clears == before + 1  # held: written, and the caches emptied
        session.refresh(model)
        assert model.last_active_at is not None
        assert model.last_active_at > utcnow() - timedelta(seconds=60)

"""A tenant's stored bytes are a running total on its row (issue 38): every write that holds
bytes (logged batches, jobs' inputs, checkpoints, Tinker sessions and operations) adds to it
in its own transaction, every delete takes off what it frees, the storage quota reads that one
row, a checkpoint that does not fit fails its job, and `skytrain storage check --fix-usage`
sets a drifted total back to the sum over the rows."""

from __future__ import annotations

import json
from collections.abc import Callable

from sqlalchemy import event, select, update
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.db.models import Checkpoint, Tenant, TrainingJob
from tests.api.support import group
from tests.fixtures.cli import run_cli
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import OnWorker, Who, WorkerClient, leased_job

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": b"\x01" * 512}
ADAPTER_BYTES = sum(len(data) for data in ADAPTER.values())


def _recorded_and_counted(db: sessionmaker[Session], who: Who) -> tuple[int, int]:
    with db() as session:
        recorded = session.scalar(select(Tenant.storage_bytes).where(Tenant.id == who.tenant_id))
        counted = session.scalar(tenants.counted_storage(tenant_id=who.tenant_id))
        return int(recorded or 0), int(counted or 0)


def _commit_a_step(alice: Who, worker: WorkerClient, model_id: str, *, step: int) -> str:
    job_id = leased_job(alice, worker, model_id)
    worker.stage(job_id, ADAPTER)
    return job_id


def test_the_running_total_follows_every_write_and_delete_and_the_cli_recounts_it(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
    lifecycle_settings: Settings,
) -> None:
    alice, model_id, worker = on_worker
    logged = alice.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    assert logged.status_code == 201, logged.text
    recorded, counted = _recorded_and_counted(lifecycle_plane.sessions, alice)
    assert recorded == counted > 0

    for step in (1, 2):
        job_id = _commit_a_step(alice, worker, model_id, step=step)
        completed = worker.complete(job_id, ADAPTER, step=step)
        assert completed.status_code == 200, completed.text
    before_delete, counted = _recorded_and_counted(lifecycle_plane.sessions, alice)
    assert (
        before_delete
        == counted
        == recorded + 2 * (ADAPTER_BYTES + _input_bytes(lifecycle_plane.sessions, model_id))
    )
    deleted = alice.http.request(
        "DELETE", f"/v1/models/{model_id}/checkpoints", json={"steps": [1]}
    )
    assert deleted.status_code == 200, deleted.text
    assert (
        _recorded_and_counted(lifecycle_plane.sessions, alice)
        == (before_delete - ADAPTER_BYTES,) * 2
    )
    quotas = {q["name"]: q["used"] for q in alice.http.get("/v1/usage").json()["quotas"]}
    assert quotas["max_storage_bytes"] == before_delete - ADAPTER_BYTES

    # Bytes written around the running total (by hand; a version before it): the check lists
    # the tenant and exits 1; --fix-usage sets the total to the count.
    with lifecycle_plane.sessions() as session:
        session.execute(
            update(Tenant).where(Tenant.id == alice.tenant_id).values(storage_bytes=12345)
        )
        session.commit()
    checked = run_cli(lifecycle_settings, "storage", "check")
    assert checked.exit_code == 1, checked.output
    (row,) = [line for line in checked.stdout.splitlines() if alice.name in line]
    assert "12345" in row and str(before_delete - ADAPTER_BYTES) in row
    as_json = run_cli(lifecycle_settings, "storage", "check", "--json")
    assert as_json.exit_code == 1, as_json.output
    (entry,) = [t for t in json.loads(as_json.stdout)["tenants"] if t["tenant"] == alice.name]
    assert entry == {
        "tenant": alice.name,
        "bytes_recorded": "12345",
        "bytes_counted": str(before_delete - ADAPTER_BYTES),
    }
    fixed = run_cli(lifecycle_settings, "storage", "check", "--fix-usage")
    assert "(fixed)" in fixed.stdout
    assert (
        _recorded_and_counted(lifecycle_plane.sessions, alice)
        == (before_delete - ADAPTER_BYTES,) * 2
    )

    # Deleting the model frees all it held, through its rows' cascade.
    assert alice.http.delete(f"/v1/models/{model_id}").status_code == 204
    assert _recorded_and_counted(lifecycle_plane.sessions, alice) == (0, 0)


def _input_bytes(db: sessionmaker[Session], model_id: str) -> int:
    """The bytes of one job's input batch of ``[group()]`` (what each job above holds)."""
    with db() as session:
        (size,) = set(
            session.scalars(select(TrainingJob.input_bytes).where(TrainingJob.model_id == model_id))
        )
    return int(size)


def test_the_storage_check_reads_the_tenants_row_not_its_rows(
    who: Callable[[], Who], lifecycle_plane: ServedPlane, lifecycle_settings: Settings
) -> None:
    """Summing the tenant's rows under its lock took 122-137 ms per write at 100,000 rows
    (bench/quota_cost.py): the check reads the running total on the tenant's row instead."""
    alice = who()
    statements: list[str] = []
    with lifecycle_plane.sessions() as session:
        engine = session.get_bind()

        def seen(conn: object, cursor: object, statement: str, *args: object) -> None:
            statements.append(statement)

        event.listen(engine, "before_cursor_execute", seen)
        try:
            tenants.reserve_storage(
                session,
                tenant_id=alice.tenant_id,
                limits=tenants.TenantLimits.defaults(lifecycle_settings),
                adding=10,
                what="this test",
            )
            session.rollback()
        finally:
            event.remove(engine, "before_cursor_execute", seen)
    read = " ".join(statements).lower()
    assert "tenants" in read
    for table in ("trajectory_batches", "training_jobs", "checkpoints", "tinker_requests"):
        assert table not in read, statements


def test_a_checkpoint_over_the_storage_quota_fails_its_job_and_commits_nothing(
    on_worker: OnWorker,
    lifecycle_plane: ServedPlane,
) -> None:
    """Checkpoints were committed whatever the tenant held: up to max_queued_jobs x the
    adapter's size past its max_storage_bytes."""
    alice, model_id, worker = on_worker
    job_id = _commit_a_step(alice, worker, model_id, step=1)
    held, _ = _recorded_and_counted(lifecycle_plane.sessions, alice)
    with lifecycle_plane.sessions() as session:
        tenant_name = session.get_one(Tenant, alice.tenant_id).name
        tenants.set_limits(
            session,
            tenant_name=tenant_name,
            values={"max_storage_bytes": held + ADAPTER_BYTES - 1},
            reset=[],
        )

    completed = worker.complete(job_id, ADAPTER, step=1)
    assert completed.status_code == 403, completed.text
    assert completed.json()["error"]["type"] == "quota_exceeded"
    job = alice.http.get(f"/v1/training-jobs/{job_id}").json()
    assert job["status"] == "failed"
    assert f"the checkpoint of step 1 of job {job_id} takes {ADAPTER_BYTES} bytes" in job["error"]
    assert "max_storage_bytes" in job["error"]
    with lifecycle_plane.sessions() as session:
        steps = session.scalars(select(Checkpoint.step).where(Checkpoint.model_id == model_id))
        assert list(steps) == [0]
    assert _recorded_and_counted(lifecycle_plane.sessions, alice) == (held, held)

    with lifecycle_plane.sessions() as session:
        tenants.set_limits(
            session,
            tenant_name=tenant_name,
            values={"max_storage_bytes": held + 10 * ADAPTER_BYTES + 10_000},
            reset=[],
        )
    job_id = _commit_a_step(alice, worker, model_id, step=1)
    assert worker.complete(job_id, ADAPTER, step=1).status_code == 200
    recorded, counted = _recorded_and_counted(lifecycle_plane.sessions, alice)
    assert recorded == counted > held + ADAPTER_BYTES

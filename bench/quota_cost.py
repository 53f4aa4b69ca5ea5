"""What a storage-quota check costs each write that stores bytes, as a tenant's rows grow.

Every log, training job, checkpoint, Tinker session and queued operation takes its bytes with
``db.tenants.reserve_storage``: the tenant's row lock, then its running total of stored bytes
(``tenants.storage_bytes``; before migration i38s, a sum over every row it holds). This times
that check (lock, read, add, rollback) on
SQLite and on a fresh PostgreSQL schema, for a tenant holding ``--rows`` logged batches and as
many Tinker operations, and the ``max_models`` check beside it. In process, no server.

Usage:
    .venv/bin/python bench/quota_cost.py [--rows 1000 100000] [--repeats 200]
        [--postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path

import load
import machine
from sqlalchemy import insert, update
from sqlalchemy.orm import Session

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "backend"))

from skytrain_backend.config import Settings  # noqa: E402
from skytrain_backend.db import migrations, registry, tenants  # noqa: E402
from skytrain_backend.db.models import (  # noqa: E402
    Model,
    Tenant,
    TinkerRequest,
    TrajectoryBatch,
    new_id,
)
from skytrain_backend.db.session import create_db_engine, session_factory  # noqa: E402


def _timed_ms(check: Callable[[], None], repeats: int) -> str:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        check()
        times.append((time.perf_counter() - start) * 1000)
    times.sort()
    return (
        f"p50 {statistics.median(times):6.2f} ms   p99 {times[int(len(times) * 0.99) - 1]:6.2f} ms"
    )


def _fill(session: Session, *, tenant_id: str, model_id: str, rows: int) -> None:
    for start in range(0, rows, 10_000):
        count = min(10_000, rows - start)
        session.execute(
            insert(TrajectoryBatch),
            [
                {
                    "id": new_id(),
                    "model_id": model_id,
                    "split": "train",
                    "step": 0,
                    "uri": "file:///x",
                    "num_groups": 1,
                    "num_trajectories": 2,
                    "metrics": {},
                    "size_bytes": 1_000,
                }
                for _ in range(count)
            ],
        )
        session.execute(
            insert(TinkerRequest),
            [
                {
                    "id": new_id(),
                    "tenant_id": tenant_id,
                    "kind": "sample",
                    "status": "succeeded",
                    "params": {},
                    "input_bytes": 1_000,
                }
                for _ in range(count)
            ],
        )
        # The rows' bytes in the running total, as the writes that store them add them.
        session.execute(
            update(Tenant)
            .where(Tenant.id == tenant_id)
            .values(storage_bytes=Tenant.storage_bytes + count * 2_000)
        )
        session.commit()


def _run(label: str, url: str, *, rows: list[int], repeats: int) -> None:
    migrations.upgrade_url(url)
    engine = create_db_engine(url)
    sessions = session_factory(engine)
    limits = tenants.TenantLimits.defaults(Settings(storage={"database_url": url}))
    print(f"\n{label}")
    with sessions() as session:
        tenant = Tenant(name=f"bench-{uuid.uuid4().hex[:8]}", limits={})
        session.add(tenant)
        session.flush()
        model = Model(
            tenant_id=tenant.id, entity="e", project="p", name="m", base_model="b", config={}
        )
        session.add(model)
        session.commit()
        held = 0
        for total in rows:
            _fill(session, tenant_id=tenant.id, model_id=model.id, rows=total - held)
            held = total

            def storage() -> None:
                tenants.reserve_storage(
                    session, tenant_id=tenant.id, limits=limits, adding=1, what="bench"
                )
                session.rollback()

            def models() -> None:
                registry.check_model_quota(session, tenant_id=tenant.id, max_models=100)
                session.rollback()

            print(f"  {total:>7,} batches + {total:>7,} operations:")
            print(f"    storage check    : {_timed_ms(storage, repeats)}")
            print(f"    max_models check : {_timed_ms(models, repeats)}")
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1_000, 100_000])
    parser.add_argument("--repeats", type=int, default=200)
    load.add_postgres_url(parser)
    args = parser.parse_args()
    print(f"hardware: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU (shared)")
    print(f"1-min load average before: {os.getloadavg()[0]:.1f}")
    rows = sorted(args.rows)
    with tempfile.TemporaryDirectory() as home:
        _run("SQLite", f"sqlite:///{home}/bench.db", rows=rows, repeats=args.repeats)

    with load.fresh_schema(args.postgres_url, "bench_quota") as url:
        _run("PostgreSQL", url, rows=rows, repeats=args.repeats)
    print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

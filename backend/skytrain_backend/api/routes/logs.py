"""Trajectory logs of a model (evaluation and training rollouts) and the metrics they carry."""

from __future__ import annotations

from itertools import groupby

from fastapi import APIRouter, status

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import LargeBodyRoute
from skytrain_backend.api.deps import (
    After,
    Limit,
    OrderQuery,
    SessionDep,
    SettingsDep,
    StoreDep,
    TenantDep,
)
from skytrain_backend.api.schemas import (
    LogCreate,
    MetricsPointPublic,
    MetricsPublic,
    TrajectoryBatchDetail,
    TrajectoryBatchesPublic,
    TrajectoryBatchPublic,
)
from skytrain_backend.db import batches, checkpoints, registry
from skytrain_backend.db.models import new_id
from skytrain_backend.protocol import parse_trajectory_groups
from skytrain_backend.storage import keys

router = APIRouter(prefix="/models/{model_id}", tags=["logs"], route_class=LargeBodyRoute)


@router.post("/log", status_code=status.HTTP_201_CREATED, response_model=TrajectoryBatchPublic)
def log_trajectories(
    model_id: str,
    body: LogCreate,
    session: SessionDep,
    tenant: TenantDep,
    store: StoreDep,
    settings: SettingsDep,
) -> TrajectoryBatchPublic:
    """Store a batch at ``step`` (default: the latest) and merge the metrics of the step's
    batches of that split, combined, into the checkpoint at that step as ``{split}/{metric}``."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    groups = parse_trajectory_groups(body.trajectory_groups)
    num_trajectories = ingest.count_trajectories(groups)
    ingest.check_count(num_trajectories, limit=settings.max_trajectories_per_request)
    step = body.step if body.step is not None else registry.latest_step(session, model_id=model.id)
    metrics = ingest.summarize(groups)
    batch_id = new_id()

    def insert(uri: str) -> TrajectoryBatchPublic:
        batch = batches.add_batch(
            session,
            batch_id=batch_id,
            model_id=model.id,
            split=body.split,
            step=step,
            uri=uri,
            num_groups=len(groups),
            num_trajectories=num_trajectories,
            metrics=metrics,
        )
        # The checkpoint first: a concurrent log of the same step waits for this one, then
        # reads both batches. Then every batch of this step and split, as /metrics shows them.
        checkpoint = checkpoints.lock_live_checkpoint(session, model_id=model.id, step=step)
        if checkpoint is not None:
            logged = batches.batches_by_step(
                session, model_id=model.id, split=body.split, step=step
            )
            combined = ingest.combine([row.metrics for row in logged])
            checkpoints.merge_metrics(
                checkpoint=checkpoint,
                metrics={f"{body.split}/{key}": value for key, value in combined.items()},
            )
        return TrajectoryBatchPublic.model_validate(batch)

    return ingest.store_then_commit(
        store,
        session,
        key=keys.log_key(tenant_id=tenant.id, model_id=model.id, batch_id=batch_id),
        data=ingest.to_jsonl(groups),
        insert=insert,
    )


@router.get("/logs", response_model=TrajectoryBatchesPublic)
def list_logs(
    model_id: str,
    session: SessionDep,
    tenant: TenantDep,
    split: str | None = None,
    step: int | None = None,
    after: After = None,
    limit: Limit = 20,
    order: OrderQuery = "asc",
) -> TrajectoryBatchesPublic:
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    rows, has_more = batches.list_batches(
        session, model_id=model.id, split=split, step=step, after=after, limit=limit, order=order
    )
    return TrajectoryBatchesPublic(
        data=[TrajectoryBatchPublic.model_validate(row) for row in rows], has_more=has_more
    )


@router.get("/logs/{batch_id}", response_model=TrajectoryBatchDetail)
def get_log(
    model_id: str, batch_id: str, session: SessionDep, tenant: TenantDep, store: StoreDep
) -> TrajectoryBatchDetail:
    """The batch with its trajectory groups, as stored."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    batch = batches.get_batch(session, model_id=model.id, batch_id=batch_id)
    data = store.get_bytes(keys.log_key(tenant_id=tenant.id, model_id=model.id, batch_id=batch.id))
    return TrajectoryBatchDetail(
        **TrajectoryBatchPublic.model_validate(batch).model_dump(),
        trajectory_groups=ingest.groups_from_jsonl(data),
    )


@router.get("/metrics", response_model=MetricsPublic)
def get_metrics(
    model_id: str, session: SessionDep, tenant: TenantDep, split: str | None = None
) -> MetricsPublic:
    """Metrics history: one point per step and split (batches logged together are combined)."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    rows = batches.batches_by_step(session, model_id=model.id, split=split)
    points = [
        MetricsPointPublic(
            step=step, split=split_, metrics=ingest.combine([row.metrics for row in group])
        )
        for (step, split_), group in groupby(rows, key=lambda row: (row.step, row.split))
    ]
    return MetricsPublic(data=points)

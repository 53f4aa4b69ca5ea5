"""Trajectory logs of a model (evaluation and training rollouts) and the metrics they carry."""

from __future__ import annotations

from itertools import groupby

from fastapi import APIRouter, Request, status

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import LargeBodyRoute, json_body_doc
from skytrain_backend.api.deps import (
    BatchId,
    ModelId,
    PageDep,
    SessionDep,
    SplitQuery,
    StepQuery,
    StoreDep,
    TenantDep,
    Upload,
    UploadDep,
    in_thread,
)
from skytrain_backend.api.schemas import (
    LogCreate,
    MetricsPointPublic,
    MetricsPublic,
    TrajectoryBatchDetail,
    TrajectoryBatchesPublic,
    TrajectoryBatchPublic,
    page_public,
)
from skytrain_backend.db import batches, checkpoints, registry, tenants
from skytrain_backend.db.models import new_id
from skytrain_backend.storage import compression, keys

router = APIRouter(prefix="/models/{model_id}", tags=["logs"], route_class=LargeBodyRoute)


@router.post(
    "/log",
    status_code=status.HTTP_201_CREATED,
    response_model=TrajectoryBatchPublic,
    openapi_extra=json_body_doc(LogCreate),
)
async def log_trajectories(
    model_id: ModelId, request: Request, upload: UploadDep
) -> TrajectoryBatchPublic:
    """Store a batch at ``step`` (default: the latest) and merge the metrics of the step's
    batches of that split, combined, into the checkpoint at that step as ``{split}/{metric}``."""
    body = await ingest.read_body(request)
    try:
        return await in_thread(upload.session, _log, body, model_id, upload)
    finally:
        body.close()


def _log(body: ingest.Spool, model_id: str, upload: Upload) -> TrajectoryBatchPublic:
    session, tenant, limits = upload.session, upload.tenant, upload.limits
    batch = ingest.IngestBatch(limit=upload.settings.server.max_trajectories_per_request)
    summary = ingest.Summary()
    try:
        with body.view() as buffer:
            request, items = ingest.split_body(
                buffer, schema=LogCreate, list_field="trajectory_groups"
            )
            model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
            batch.reservation = tenants.reserve_as_it_streams(
                session, tenant_id=tenant.id, limits=limits, what="this batch"
            )
            session.commit()  # ends the read: no connection is held while the batch streams
            batch_id = new_id()
            key = keys.log_key(tenant_id=tenant.id, model_id=model.id, batch_id=batch_id)
            batch.stream_to(upload.store, key)
            for group in ingest.each_item(
                items or [], ingest.parse_group, field="trajectory_groups"
            ):
                summary.add(group)
                batch.add(group)
            del items  # the raw items point into the buffer, which closes with this block
        step = request.step
        if step is None:
            step = registry.latest_step(session, model_id=model.id)
        metrics = summary.result()

        def insert(uri: str) -> TrajectoryBatchPublic:
            row = batches.add_batch(
                session,
                batch_id=batch_id,
                model_id=model.id,
                split=request.split,
                step=step,
                uri=uri,
                num_groups=batch.num_items,
                num_trajectories=batch.num_trajectories,
                metrics=metrics,
                size_bytes=batch.num_bytes,
            )
            # The checkpoint first: a concurrent log of the same step waits for this one, then
            # reads both batches. Then every batch of this step and split, as /metrics shows
            # them.
            checkpoint = checkpoints.lock_live_checkpoint(session, model_id=model.id, step=step)
            if checkpoint is not None:
                logged = batches.batches_by_step(
                    session, model_id=model.id, split=request.split, step=step
                )
                combined = ingest.combine([batch.metrics for batch in logged])
                checkpoints.merge_metrics(
                    checkpoint=checkpoint,
                    metrics={f"{request.split}/{key}": value for key, value in combined.items()},
                )
            return TrajectoryBatchPublic.model_validate(row)

        return ingest.store_then_commit(
            upload.store,
            session,
            key=key,
            data=batch.output,
            insert=insert,
            reservation=batch.reservation,
        )
    finally:
        batch.close()


@router.get("/logs", response_model=TrajectoryBatchesPublic)
def list_logs(
    model_id: ModelId,
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    split: SplitQuery = None,
    step: StepQuery = None,
) -> TrajectoryBatchesPublic:
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    found = batches.list_batches(session, model_id=model.id, split=split, step=step, page=page)
    return page_public(TrajectoryBatchesPublic, found)


@router.get("/logs/{batch_id}", response_model=TrajectoryBatchDetail)
def get_log(
    model_id: ModelId, batch_id: BatchId, session: SessionDep, tenant: TenantDep, store: StoreDep
) -> TrajectoryBatchDetail:
    """The batch with its trajectory groups, as stored."""
    model = registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    batch = batches.get_batch(session, model_id=model.id, batch_id=batch_id)
    session.commit()  # no transaction open while the store reads
    data = store.get_bytes(keys.log_key(tenant_id=tenant.id, model_id=model.id, batch_id=batch.id))
    return TrajectoryBatchDetail(
        **TrajectoryBatchPublic.model_validate(batch).model_dump(),
        trajectory_groups=ingest.groups_from_jsonl(compression.decompress(data)),
    )


@router.get("/metrics", response_model=MetricsPublic)
def get_metrics(
    model_id: ModelId, session: SessionDep, tenant: TenantDep, split: SplitQuery = None
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

"""The Tinker protocol (``/api/v1/...``): the routes the official ``tinker`` SDK calls.

Authentication: the SDK sends ``X-API-Key: tml-<skytrain key>``; the key's tenant owns what is
created, and another tenant's run, future or sampler is not found. Training operations are
queued in the run's order and return futures (``retrieve_future``); see
``scheduler.tinker.worker_ops`` for how workers run them, ``api.tinker.service`` for sampling, and
``docs/tinker.md`` for what is served and what is not.
"""

from __future__ import annotations

import uuid
from typing import Literal

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import select
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api.deps import (
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    TinkerTenantDep,
)
from skytrain_backend.api.tinker import futures, rest_client, sampling
from skytrain_backend.api.tinker.deps import PathId, TinkerDep, TrainingDep
from skytrain_backend.api.tinker.service import ADAM_ONLY
from skytrain_backend.db import tinker_rows
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.db.tenants import limits_of
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import ModelConfig, format_validation_error, tinker_protobuf
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.protocol.tinker_ops import (
    BatchOperation,
    BatchParams,
    CreationOperation,
    CreationParams,
    OptimOperation,
    OptimParams,
    SaveOperation,
    SaveParams,
)
from skytrain_backend.scheduler.serving import LIVE_WORKER_STATUSES
from skytrain_backend.scheduler.tinker import runs

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=SessionRoute)

# --- service ------------------------------------------------------------------------------------


@router.get("/healthz")
def healthz() -> dict[str, str]:
    return {"status": "ok"}


@router.post("/client/config")
def client_config(tenant: TinkerTenantDep) -> schemas.ClientConfigResponse:
    return schemas.ClientConfigResponse()


@router.post("/client/dynamic_config")
def client_dynamic_config(tenant: TinkerTenantDep) -> schemas.DynamicConfigResponse:
    return schemas.DynamicConfigResponse()


@router.post("/telemetry")
def telemetry(tenant: TinkerTenantDep) -> dict[str, str]:
    """The SDK's telemetry is accepted and discarded: skytrain keeps none of it."""
    return {"status": "accepted"}


@router.get("/get_server_capabilities")
def server_capabilities(tenant: TinkerTenantDep, session: SessionDep) -> schemas.ServerCapabilities:
    """The base models workers serve now and those the tenant's models use (any model
    skytrain can load may be asked for: a worker is started for it)."""
    names = set(
        session.scalars(
            select(Worker.base_model).where(Worker.status.in_(LIVE_WORKER_STATUSES)).distinct()
        )
    ) | set(
        session.scalars(select(Model.base_model).where(Model.tenant_id == tenant.id).distinct())
    )
    return schemas.ServerCapabilities(
        supported_models=[schemas.SupportedModel(model_name=name) for name in sorted(names)]
    )


@router.post("/create_session")
def create_session(
    body: schemas.CreateSessionRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
) -> schemas.CreateSessionResponse:
    row = tinker_rows.create_session(
        session,
        tenant_id=tenant.id,
        sdk_version=body.sdk_version,
        tags=body.tags,
        user_metadata=body.user_metadata or {},
        limits=limits_of(tenant, settings),
    )
    return schemas.CreateSessionResponse(session_id=row.id)


@router.post("/session_heartbeat")
def session_heartbeat(
    body: schemas.SessionHeartbeatRequest, tenant: TinkerTenantDep, session: SessionDep
) -> Response:
    row = tinker_rows.get_session(session, tenant_id=tenant.id, session_id=body.session_id)
    if row.finished_at is not None:
        # 410 stops the SDK's heartbeat loop.
        return JSONResponse(
            {"error": {"type": "gone", "message": f"session {row.id} has finished"}},
            status_code=410,
        )
    tinker_rows.heartbeat(session, row=row)
    return JSONResponse({"type": "session_heartbeat"})


@router.post("/sessions/{session_id}/finish", status_code=204)
def finish_session(
    session_id: PathId,
    body: schemas.FinishSessionRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
) -> None:
    row = tinker_rows.get_session(session, tenant_id=tenant.id, session_id=session_id)
    status = str(body.reason.get("type") or "success")[:32]
    runs.finish_session(session, row=row, status=status)


@router.post("/create_model")
def create_model(
    body: schemas.CreateModelRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    tinker: TinkerDep,
    scheduler: SchedulerDep,
) -> schemas.UntypedAPIFuture:
    if body.optimizer_config.type != "adamw":
        raise InvalidRequest(ADAM_ONLY)
    lora = body.lora_config or schemas.LoraConfig(rank=32)
    config = runs.lora_model_config(
        rank=lora.rank, train_attn=lora.train_attn, train_mlp=lora.train_mlp
    )
    # An unseeded adapter gets a seed now: a rebuilt state must start from the same weights.
    seed = lora.seed if lora.seed is not None else uuid.uuid4().int % 2**31
    creation = CreationOperation(kind="create_model", params=CreationParams(seed=seed))
    new = runs.NewRun(
        body.session_id,
        body.model_seq_id,
        body.base_model,
        config,
        lora,
        body.user_metadata,
        creation,
    )
    return tinker.create_run(session, new, tenant=tenant, scheduler=scheduler)


@router.post("/get_info")
def get_info(
    body: schemas.GetInfoRequest, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.GetInfoResponse:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=body.model_id)
    model = session.get_one(Model, run.model_id)
    config = ModelConfig.model_validate(model.config)
    return schemas.GetInfoResponse(
        model_data=schemas.ModelData(model_name=model.base_model, tokenizer_id=model.base_model),
        model_id=run.id,
        lora_rank=config.lora_rank,
        model_name=model.base_model,
    )


@router.post("/forward_backward")
async def forward_backward(
    request: Request, session: SessionDep, training: TrainingDep
) -> schemas.UntypedAPIFuture:
    """A protobuf ``ForwardBackwardRequest`` (``forward`` is the same with ``forward_only``),
    validated in full before it is queued (invalid content: a failed future, see ``submit``)."""
    if tinker_protobuf.PROTOBUF_MEDIA_TYPE not in request.headers.get("content-type", ""):
        raise InvalidRequest(
            f"forward_backward takes a protobuf body ({tinker_protobuf.PROTOBUF_MEDIA_TYPE}), "
            "as the tinker SDK sends it"
        )
    if request.headers.get("content-encoding", "identity") != "identity":
        raise InvalidRequest("compressed forward_backward bodies are not accepted: send it plain")
    body = await request.body()

    def queue_it() -> schemas.UntypedAPIFuture:
        message = tinker_protobuf.decode_forward_backward(body)
        run = training.run(session, message.model_id)
        model = session.get_one(Model, run.model_id)
        kind: Literal["forward", "forward_backward"] = (
            "forward" if message.forward_only else "forward_backward"
        )
        max_tokens = ModelConfig.model_validate(model.config).max_seq_length
        try:
            batch = tinker_protobuf.validate_forward_backward(message, max_tokens=max_tokens)
        except InvalidRequest as exc:
            refused = BatchOperation(kind=kind, params=BatchParams(loss_fn=message.loss_fn))
            return training.tinker.submit(
                session, run, message.seq_id, refused, refused=exc.message
            )
        params = BatchParams(
            loss_fn=batch.loss_fn, num_datums=len(batch.data), num_tokens=batch.num_tokens
        )
        operation = BatchOperation(kind=kind, params=params)
        return training.tinker.submit(session, run, batch.seq_id, operation, body=body)

    return await run_in_threadpool(queue_it)


@router.post("/optim_step")
def optim_step(
    body: schemas.OptimStepRequest, session: SessionDep, training: TrainingDep
) -> schemas.UntypedAPIFuture:
    run = training.run(session, body.model_id)
    operation, refused = OptimOperation(kind="optim_step"), None
    if body.optimizer_params is not None:
        refused = ADAM_ONLY
    else:
        try:
            adam = schemas.AdamParams.model_validate(body.adam_params or {})
            operation = OptimOperation(kind="optim_step", params=OptimParams(adam=adam))
        except ValidationError as exc:
            refused = format_validation_error(exc, root="adam_params")
    return training.tinker.submit(session, run, body.seq_id, operation, refused=refused)


@router.post("/save_weights")
def save_weights(
    body: schemas.SaveWeightsRequest, session: SessionDep, training: TrainingDep
) -> schemas.UntypedAPIFuture:
    name = body.path or f"state-{body.seq_id}"
    params = SaveParams(name=name, overwrite=body.overwrite, user_metadata=body.user_metadata)
    return training.tinker.submit_save(
        session,
        training.run(session, body.model_id),
        body.seq_id,
        SaveOperation(kind="save_weights", params=params),
    )


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: schemas.SaveWeightsForSamplerRequest, session: SessionDep, training: TrainingDep
) -> schemas.UntypedAPIFuture:
    refused = None
    if body.kind != "snapshot":
        refused = f"sampling client kind {body.kind!r} is not served: skytrain's are snapshots"
    params = SaveParams(name=body.path, user_metadata=body.user_metadata)
    return training.tinker.submit_save(
        session,
        training.run(session, body.model_id),
        body.seq_id,
        SaveOperation(kind="save_weights_for_sampler", params=params),
        refused=refused,
    )


@router.post("/load_weights")
def load_weights(
    body: schemas.LoadWeightsRequest,
    session: SessionDep,
    training: TrainingDep,
    scheduler: SchedulerDep,
) -> schemas.UntypedAPIFuture:
    """Load a checkpoint into a live run (``model_id`` + ``seq_id``), or create a run from one
    (``session_id`` + ``model_seq_id``: ``create_training_client_from_state``)."""
    if body.session_id is not None and body.model_seq_id is not None:
        return training.tinker.create_from_state(
            session,
            tenant=training.tenant,
            scheduler=scheduler,
            body=body,
            session_id=body.session_id,
            model_seq_id=body.model_seq_id,
        )
    if body.model_id is None:
        raise InvalidRequest(
            "load_weights needs model_id and seq_id, or session_id and model_seq_id"
        )
    run = training.run(session, body.model_id)
    operation, refused = training.tinker.load_operation(
        session, tenant=training.tenant, run=run, body=body
    )
    return training.tinker.submit(session, run, body.seq_id, operation, refused=refused)


# The sampling, futures and REST-client routes, in modules of their own.
router.include_router(sampling.router)
router.include_router(futures.router)
router.include_router(rest_client.router)

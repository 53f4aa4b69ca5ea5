"""The Tinker protocol (``/api/v1/...``): the routes the official ``tinker`` SDK calls.

Authentication: the SDK sends ``X-API-Key: tml-<skytrain key>``; the key's tenant owns what is
created, and another tenant's run, future or sampler is not found. Training operations are
queued in the run's order and return futures (``retrieve_future``); see
``scheduler.tinker_worker`` for how workers run them, ``api.tinker`` for sampling, and
``docs/tinker.md`` for what is served and what is not.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from skytrain_backend import tinker_wire
from skytrain_backend.api import tinker_schemas as schemas
from skytrain_backend.api.admission.model_rules import check_new_model
from skytrain_backend.api.deps import (
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    StoreDep,
    TinkerDep,
    TinkerTenantDep,
)
from skytrain_backend.api.routes import tinker_futures, tinker_runs, tinker_sampling
from skytrain_backend.api.routes.tinker_common import PathId, future, queued, submit, tenant_run
from skytrain_backend.db import tinker as tinker_rows
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    Worker,
)
from skytrain_backend.db.tenants import limits_of, metadata_bytes
from skytrain_backend.errors import InvalidRequest, NotFound
from skytrain_backend.protocol import ModelConfig, format_validation_error
from skytrain_backend.scheduler import tinker as runs
from skytrain_backend.scheduler.serving import LIVE_WORKER_STATUSES

router = APIRouter(prefix="/api/v1", tags=["tinker"], route_class=SessionRoute)

_ADAM_ONLY = "skytrain's Tinker runs use Adam (AdamW) only: leave optimizer out or use AdamParams"


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
    settings: SettingsDep,
    scheduler: SchedulerDep,
) -> schemas.UntypedAPIFuture:
    tinker_session = tinker_rows.open_session(
        session, tenant_id=tenant.id, session_id=body.session_id
    )
    if body.optimizer_config.type != "adamw":
        raise InvalidRequest(_ADAM_ONLY)
    lora = body.lora_config or schemas.LoraConfig(rank=32)
    config = runs.lora_model_config(
        rank=lora.rank, train_attn=lora.train_attn, train_mlp=lora.train_mlp
    )
    limits = check_new_model(
        session,
        tenant=tenant,
        settings=settings,
        base_model=body.base_model,
        lora_rank=config.lora_rank,
        provider=scheduler.provider,
        configs=scheduler.configs,
        tinker_training=True,
    )
    metadata_bytes(body.user_metadata, limits=limits, field="user_metadata")
    # An unseeded adapter gets a seed now: a rebuilt state must start from the same weights.
    seed = lora.seed if lora.seed is not None else uuid.uuid4().int % 2**31
    operation = runs.create_run(
        session,
        tenant=tenant,
        tinker_session=tinker_session,
        model_seq_id=body.model_seq_id,
        base_model=body.base_model,
        model_config=config,
        lora_config=lora.model_dump(),
        user_metadata=body.user_metadata or {},
        creation={"kind": "create_model", "seed": seed},
        max_attempts=settings.job_max_attempts,
        max_models=limits.max_models,
    )
    return future(operation)


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
    request: Request,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    """A protobuf ``ForwardBackwardRequest`` (``forward`` is the same with ``forward_only``),
    validated in full before it is queued (invalid content: a failed future, see ``submit``)."""
    if tinker_wire.PROTOBUF_MEDIA_TYPE not in request.headers.get("content-type", ""):
        raise InvalidRequest(
            f"forward_backward takes a protobuf body ({tinker_wire.PROTOBUF_MEDIA_TYPE}), as the "
            "tinker SDK sends it"
        )
    if request.headers.get("content-encoding", "identity") != "identity":
        raise InvalidRequest("compressed forward_backward bodies are not accepted: send it plain")
    body = await request.body()

    def queue_it() -> TinkerRequest:
        message = tinker_wire.decode_forward_backward(body)
        run = tenant_run(session, tenant, message.model_id)
        model = session.get_one(Model, run.model_id)
        kind = "forward" if message.forward_only else "forward_backward"
        max_tokens = ModelConfig.model_validate(model.config).max_seq_length
        try:
            batch = tinker_wire.validate_forward_backward(message, max_tokens=max_tokens)
        except InvalidRequest as exc:
            params = {"loss_fn": message.loss_fn}
            return runs.submit(
                session,
                store=store,
                run=run,
                seq_id=message.seq_id,
                kind=kind,
                params=params,
                refused=exc.message,
                limits=limits_of(tenant, tinker.settings),
            )
        return runs.submit(
            session,
            store=store,
            limits=limits_of(tenant, tinker.settings),
            run=run,
            seq_id=batch.seq_id,
            kind=kind,
            params={
                "loss_fn": batch.loss_fn,
                "num_datums": len(batch.data),
                "num_tokens": batch.num_tokens,
            },
            body=body,
        )

    return queued(tinker, session, await run_in_threadpool(queue_it))


@router.post("/optim_step")
def optim_step(
    body: schemas.OptimStepRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    run = tenant_run(session, tenant, body.model_id)
    refused = None
    params: dict[str, Any] = {}
    if body.optimizer_params is not None:
        refused = _ADAM_ONLY
    else:
        try:
            adam = schemas.AdamParams.model_validate(body.adam_params or {})
            params = {"adam": adam.model_dump()}
        except ValidationError as exc:
            refused = format_validation_error(exc, root="adam_params")
    return submit(
        tinker,
        session,
        store,
        run=run,
        seq_id=body.seq_id,
        kind="optim_step",
        params=params,
        refused=refused,
    )


def _name_refusal(
    session: Session, run: TinkerRun, kind: str, name: str, *, overwrite: bool
) -> str | None:
    """Why ``name`` cannot name a new save of ``run`` (None: it can)."""
    try:
        runs.check_name(name)
    except InvalidRequest as exc:
        return exc.message
    taken = session.scalar(
        select(TinkerCheckpoint.id).where(
            TinkerCheckpoint.run_id == run.id,
            TinkerCheckpoint.kind == kind,
            TinkerCheckpoint.name == name,
        )
    )
    if taken is not None and not overwrite:
        return (
            f"run {run.id} already has a checkpoint named {name!r}: choose another name, or pass "
            "overwrite=True"
        )
    return None


@router.post("/save_weights")
def save_weights(
    body: schemas.SaveWeightsRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    run = tenant_run(session, tenant, body.model_id)
    name = body.path or f"state-{body.seq_id}"
    return submit(
        tinker,
        session,
        store,
        run=run,
        seq_id=body.seq_id,
        kind="save_weights",
        params={"name": name, "overwrite": body.overwrite, "user_metadata": body.user_metadata},
        refused=_name_refusal(session, run, "training", name, overwrite=body.overwrite),
    )


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: schemas.SaveWeightsForSamplerRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    run = tenant_run(session, tenant, body.model_id)
    refused = None
    if body.kind != "snapshot":
        refused = f"sampling client kind {body.kind!r} is not served: skytrain's are snapshots"
    elif body.path is not None:
        refused = _name_refusal(session, run, "sampler", body.path, overwrite=False)
    return submit(
        tinker,
        session,
        store,
        run=run,
        seq_id=body.seq_id,
        kind="save_weights_for_sampler",
        params={"name": body.path, "user_metadata": body.user_metadata},
        refused=refused,
    )


def _load_source(
    session: Session, tenant: Tenant, body: schemas.LoadWeightsRequest
) -> tuple[Model, TinkerRun, dict[str, Any]]:
    """The checkpoint a load names: its model, run, and the operation's parameters."""
    if body.weights_access_token is not None:
        raise InvalidRequest("weights_access_token is not served: load checkpoints of your tenant")
    source_run, checkpoint = runs.resolve_path(session, tenant_id=tenant.id, path=body.path)
    params = {
        "path": body.path,
        "source": {"model_id": checkpoint.model_id, "step": checkpoint.step},
        "optimizer": body.optimizer,
    }
    return session.get_one(Model, source_run.model_id), source_run, params


@router.post("/load_weights")
def load_weights(
    body: schemas.LoadWeightsRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    settings: SettingsDep,
    tinker: TinkerDep,
    scheduler: SchedulerDep,
) -> schemas.UntypedAPIFuture:
    """Load a checkpoint into a live run (``model_id`` + ``seq_id``), or create a run from one
    (``session_id`` + ``model_seq_id``: ``create_training_client_from_state``)."""
    if body.session_id is not None and body.model_seq_id is not None:
        source_model, source_run, params = _load_source(session, tenant, body)
        if body.optimizer_config is not None and (
            body.optimizer or body.optimizer_config.type != "adamw"
        ):
            raise InvalidRequest(_ADAM_ONLY)
        if body.base_model is not None and body.base_model != source_model.base_model:
            raise InvalidRequest(
                f"{body.path} was trained on {source_model.base_model!r}, not {body.base_model!r}"
            )
        tinker_session = tinker_rows.open_session(
            session, tenant_id=tenant.id, session_id=body.session_id
        )
        config = ModelConfig.model_validate(source_model.config)
        limits = check_new_model(
            session,
            tenant=tenant,
            settings=settings,
            base_model=source_model.base_model,
            lora_rank=config.lora_rank,
            provider=scheduler.provider,
            configs=scheduler.configs,
            tinker_training=True,
        )
        metadata_bytes(body.user_metadata, limits=limits, field="user_metadata")
        operation = runs.create_run(
            session,
            tenant=tenant,
            tinker_session=tinker_session,
            model_seq_id=body.model_seq_id,
            base_model=source_model.base_model,
            model_config=config,
            lora_config=source_run.lora_config,
            user_metadata=body.user_metadata or {},
            creation={"kind": "load_create", **params},
            max_attempts=settings.job_max_attempts,
            max_models=limits.max_models,
        )
        return future(operation)
    if body.model_id is None:
        raise InvalidRequest(
            "load_weights needs model_id and seq_id, or session_id and model_seq_id"
        )
    run = tenant_run(session, tenant, body.model_id)
    refused = None
    params = {}
    try:
        source_model, _, params = _load_source(session, tenant, body)
        target = session.get_one(Model, run.model_id)
        if target.base_model != source_model.base_model or target.config != source_model.config:
            refused = (
                f"{body.path} has another base model or LoRA shape than run {run.id}: create a "
                "training client from it instead (create_training_client_from_state)"
            )
    except (InvalidRequest, NotFound) as exc:
        refused = exc.message
    return submit(
        tinker,
        session,
        store,
        run=run,
        seq_id=body.seq_id,
        kind="load_weights",
        params=params,
        refused=refused,
    )


# The sampling, futures and REST-client routes, in modules of their own.
router.include_router(tinker_sampling.router)
router.include_router(tinker_futures.router)
router.include_router(tinker_runs.router)

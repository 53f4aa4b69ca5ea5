"""The Tinker protocol (``/api/v1/...``): the routes the official ``tinker`` SDK calls.

Authentication: the SDK sends ``X-API-Key: tml-<skytrain key>``; the key's tenant owns what is
created, and another tenant's run, future or sampler is not found. Training operations are
queued in the run's order and return futures (``retrieve_future``); see
``scheduler.tinker`` for how workers run them, ``api.tinker`` for sampling, and
``docs/tinker.md`` for what is served and what is not.
"""

from __future__ import annotations

import uuid
from typing import Annotated, Any

from fastapi import APIRouter, Path, Query, Request, Response
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from skytrain_backend import tinker_wire
from skytrain_backend.api import tinker_schemas as schemas
from skytrain_backend.api.deps import (
    SessionDep,
    SettingsDep,
    StoreDep,
    TinkerDep,
    TinkerTenantDep,
)
from skytrain_backend.api.tinker import TinkerService, sampling_body
from skytrain_backend.db import registry
from skytrain_backend.db import tinker as tinker_rows
from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    Tenant,
    TinkerCheckpoint,
    TinkerRequest,
    TinkerRun,
    TinkerSampler,
    Worker,
)
from skytrain_backend.errors import InvalidRequest, NotFound, PayloadTooLarge
from skytrain_backend.protocol import ModelConfig, format_validation_error
from skytrain_backend.ranges import INT32_MAX, NO_NUL_PATTERN
from skytrain_backend.scheduler import tinker as runs
from skytrain_backend.scheduler.serving import LIVE_WORKER_STATUSES

router = APIRouter(prefix="/api/v1", tags=["tinker"])

# An id in the path: refused (400) before it reaches SQL if it holds NUL or is too long.
PathId = Annotated[str, Path(min_length=1, max_length=256, pattern=NO_NUL_PATTERN)]

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
    body: schemas.CreateSessionRequest, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.CreateSessionResponse:
    row = tinker_rows.create_session(
        session,
        tenant_id=tenant.id,
        sdk_version=body.sdk_version,
        tags=body.tags,
        user_metadata=body.user_metadata or {},
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


# --- training runs ------------------------------------------------------------------------------


def _future(row: TinkerRequest, **extra: Any) -> schemas.UntypedAPIFuture:
    return schemas.UntypedAPIFuture(request_id=row.id, model_id=row.run_id, **extra)


@router.post("/create_model")
def create_model(
    body: schemas.CreateModelRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
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
    )
    return _future(operation)


def _queued(
    tinker: TinkerService, session: Session, operation: TinkerRequest
) -> schemas.UntypedAPIFuture:
    """The future of a queued operation, its run's worker told at once."""
    if operation.run_id is not None:
        run = session.get_one(TinkerRun, operation.run_id)
        tinker.notify(f"job:{run.job_id}")
    return _future(operation)


def _run(session: Session, tenant: Tenant, model_id: str) -> TinkerRun:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=model_id)
    tinker_rows.touch_run(session, run=run)
    return run


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
        run = _run(session, tenant, message.model_id)
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
            )
        return runs.submit(
            session,
            store=store,
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

    return _queued(tinker, session, await run_in_threadpool(queue_it))


@router.post("/optim_step")
def optim_step(
    body: schemas.OptimStepRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    run = _run(session, tenant, body.model_id)
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
    operation = runs.submit(
        session,
        store=store,
        run=run,
        seq_id=body.seq_id,
        kind="optim_step",
        params=params,
        refused=refused,
    )
    return _queued(tinker, session, operation)


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
    run = _run(session, tenant, body.model_id)
    name = body.path or f"state-{body.seq_id}"
    operation = runs.submit(
        session,
        store=store,
        run=run,
        seq_id=body.seq_id,
        kind="save_weights",
        params={"name": name, "overwrite": body.overwrite, "user_metadata": body.user_metadata},
        refused=_name_refusal(session, run, "training", name, overwrite=body.overwrite),
    )
    return _queued(tinker, session, operation)


@router.post("/save_weights_for_sampler")
def save_weights_for_sampler(
    body: schemas.SaveWeightsForSamplerRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    store: StoreDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    run = _run(session, tenant, body.model_id)
    refused = None
    if body.kind != "snapshot":
        refused = f"sampling client kind {body.kind!r} is not served: skytrain's are snapshots"
    elif body.path is not None:
        refused = _name_refusal(session, run, "sampler", body.path, overwrite=False)
    operation = runs.submit(
        session,
        store=store,
        run=run,
        seq_id=body.seq_id,
        kind="save_weights_for_sampler",
        params={"name": body.path, "user_metadata": body.user_metadata},
        refused=refused,
    )
    return _queued(tinker, session, operation)


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
        operation = runs.create_run(
            session,
            tenant=tenant,
            tinker_session=tinker_session,
            model_seq_id=body.model_seq_id,
            base_model=source_model.base_model,
            model_config=ModelConfig.model_validate(source_model.config),
            lora_config=source_run.lora_config,
            user_metadata=body.user_metadata or {},
            creation={"kind": "load_create", **params},
            max_attempts=settings.job_max_attempts,
        )
        return _future(operation)
    if body.model_id is None:
        raise InvalidRequest(
            "load_weights needs model_id and seq_id, or session_id and model_seq_id"
        )
    run = _run(session, tenant, body.model_id)
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
    operation = runs.submit(
        session,
        store=store,
        run=run,
        seq_id=body.seq_id,
        kind="load_weights",
        params=params,
        refused=refused,
    )
    return _queued(tinker, session, operation)


# --- sampling -----------------------------------------------------------------------------------


def _base_model_sampler_model(session: Session, tenant: Tenant, base_model: str) -> Model:
    """The tenant's model that stands for ``base_model`` itself (step 0), created once."""
    name = "base-" + uuid.uuid5(uuid.NAMESPACE_URL, base_model).hex[:16]
    model = session.scalar(
        select(Model).where(
            Model.tenant_id == tenant.id,
            Model.entity == tenant.name,
            Model.project == runs.PROJECT,
            Model.name == name,
        )
    )
    if model is not None:
        return model
    model, _ = registry.create_model(
        session,
        tenant=tenant,
        entity=tenant.name,
        project=runs.PROJECT,
        name=name,
        base_model=base_model,
        config=ModelConfig().model_dump(mode="json"),
        return_existing=True,
    )
    return model


@router.post("/create_sampling_session")
def create_sampling_session(
    body: schemas.CreateSamplingSessionRequest, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.CreateSamplingSessionResponse:
    tinker_rows.open_session(session, tenant_id=tenant.id, session_id=body.session_id)
    if body.model_path is not None:
        run, checkpoint = runs.resolve_path(session, tenant_id=tenant.id, path=body.model_path)
        model = session.get_one(Model, run.model_id)
        step = checkpoint.step
    elif body.base_model is not None:
        model = _base_model_sampler_model(session, tenant, body.base_model)
        step = 0
    else:
        raise InvalidRequest("create_sampling_session needs model_path or base_model")
    sampler = TinkerSampler(
        tenant_id=tenant.id,
        base_model=model.base_model,
        model_id=model.id,
        step=step,
        model_path=body.model_path,
    )
    session.add(sampler)
    session.commit()
    return schemas.CreateSamplingSessionResponse(sampling_session_id=sampler.id)


@router.get("/samplers/{sampler_id}")
def get_sampler(
    sampler_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.GetSamplerResponse:
    sampler = tinker_rows.get_sampler(session, tenant_id=tenant.id, sampler_id=sampler_id)
    return schemas.GetSamplerResponse(
        sampler_id=sampler.id, base_model=sampler.base_model, model_path=sampler.model_path
    )


_UNSERVED_SAMPLING = {
    "prompt_logprobs": "prompt logprobs (compute_logprobs): use a training client's forward",
    "topk_prompt_logprobs": "top-k prompt logprobs",
    "topk_sample_logprobs": "top-k sampled-token logprobs",
    "target_prompt_logprobs": "target prompt logprobs",
    "prompt_alt_tokens_k": "prompt alternative tokens",
    "prompt_logprobs_last_n": "prompt logprobs",
    "record_stability_info": "stability information (stable_reinforce)",
}


@router.post("/asample")
async def asample(
    body: schemas.SampleRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    """Queue a sampling request; its task (in this process) asks the sampler's engine."""
    for field_name, what in _UNSERVED_SAMPLING.items():
        if getattr(body, field_name):
            raise InvalidRequest(f"{field_name}: {what} is not served by skytrain")
    if body.sampling_session_id is None:
        raise InvalidRequest(
            "asample needs a sampling_session_id: create a SamplingClient with the SDK"
        )
    try:
        prompt = body.prompt.token_ids()
    except (ValueError, ValidationError) as exc:
        raise InvalidRequest(str(exc)) from None
    if not prompt:
        raise InvalidRequest("the prompt is empty: send at least one token")
    if len(prompt) > runs.MAX_SEQ_LENGTH:
        raise PayloadTooLarge(
            f"the prompt has {len(prompt)} tokens, more than {runs.MAX_SEQ_LENGTH}"
        )
    sampler_id = body.sampling_session_id

    def record() -> tuple[TinkerRequest, TinkerSampler]:
        sampler = tinker_rows.get_sampler(session, tenant_id=tenant.id, sampler_id=sampler_id)
        row = TinkerRequest(
            tenant_id=tenant.id,
            sampler_id=sampler.id,
            kind="sample",
            status="running",
            params={"num_samples": body.num_samples, "prompt_tokens": len(prompt)},
        )
        session.add(row)
        session.commit()
        return row, sampler

    row, sampler = await run_in_threadpool(record)
    tinker.start_sample(
        request_id=row.id,
        tenant_id=tenant.id,
        model=f"{sampler.model_id}:step{sampler.step}",
        body=sampling_body(
            prompt=prompt, num_samples=body.num_samples, params=body.sampling_params
        ),
    )
    return _future(row, sample_sequence_ids=[f"{row.id}:{i}" for i in range(body.num_samples)])


# --- futures ------------------------------------------------------------------------------------


def _result(store: Any, session: Session, row: TinkerRequest) -> Response:
    """A succeeded future's answer: protobuf for forward-backward and sampling."""
    if row.kind in ("forward", "forward_backward"):
        assert row.result_uri is not None and row.run_id is not None
        run = session.get_one(TinkerRun, row.run_id)
        assert row.seq_id is not None
        content = store.get_bytes(runs.output_key(run, row.seq_id))
        return Response(content, media_type=tinker_wire.PROTOBUF_MEDIA_TYPE)
    if row.kind == "sample":
        sequences = [
            tinker_wire.SampledSequence(s["tokens"], s["logprobs"], s["stop_reason"])
            for s in (row.result or {})["sequences"]
        ]
        content = tinker_wire.encode_sample_response(sequences)
        return Response(content, media_type=tinker_wire.PROTOBUF_MEDIA_TYPE)
    return JSONResponse(row.result or {})


@router.post("/retrieve_future")
async def retrieve_future(
    body: schemas.FutureRetrieveRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    tinker: TinkerDep,
    store: StoreDep,
) -> Response:
    """The future's answer; one not done yet is waited on for a while (holding no database
    connection), then answered ``try_again``."""
    tenant_id = tenant.id
    session.rollback()
    answer = await tinker.wait(
        tenant_id=tenant_id,
        request_id=body.request_id,
        on_done=lambda session, row: _result(store, session, row),
    )
    if isinstance(answer, Response):
        return answer
    if isinstance(answer, runs.Failed):
        failed = schemas.RequestFailedResponse(error=answer.error, category=answer.category)
        return JSONResponse(failed.model_dump())
    pending = schemas.TryAgainResponse(
        request_id=body.request_id, queue_state=answer.queue_state, queue_state_reason=answer.reason
    )
    return JSONResponse(pending.model_dump())


@router.post("/cancel_future", status_code=204)
def cancel_future(tenant: TinkerTenantDep) -> None:
    """Accepted and ignored: a sample runs to its end (the SDK sends this only when the
    server's dynamic config enables it, which skytrain's does not)."""


# --- training runs and checkpoints ----------------------------------------------------------------


def _checkpoint_public(
    named: TinkerCheckpoint, checkpoint: Checkpoint
) -> schemas.TinkerCheckpointPublic:
    segment = "weights" if named.kind == "training" else "sampler_weights"
    return schemas.TinkerCheckpointPublic(
        checkpoint_id=f"{segment}/{named.name}",
        checkpoint_type=named.kind,
        time=named.created_at,
        tinker_path=runs.TinkerPath.of(named.run_id, named.kind, named.name),  # type: ignore[arg-type]
        size_bytes=checkpoint.size_bytes,
        user_metadata=named.user_metadata or None,
    )


def _run_public(session: Session, tenant: Tenant, run: TinkerRun) -> schemas.TrainingRunPublic:
    model = session.get_one(Model, run.model_id)
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id, run_id=run.id)
    latest = {
        kind: next((item for item in named if item[0].kind == kind), None)
        for kind in ("training", "sampler")
    }
    job = runs.run_job(session, run=run)
    return schemas.TrainingRunPublic(
        training_run_id=run.id,
        base_model=model.base_model,
        model_owner=tenant.name,
        corrupted=job.status == "failed",
        lora_rank=ModelConfig.model_validate(model.config).lora_rank,
        last_request_time=run.last_request_at,
        last_checkpoint=_checkpoint_public(*latest["training"]) if latest["training"] else None,
        last_sampler_checkpoint=(
            _checkpoint_public(*latest["sampler"]) if latest["sampler"] else None
        ),
        user_metadata={k: str(v) for k, v in run.user_metadata.items()} or None,
    )


Limit = Annotated[int, Query(ge=1, le=1000)]
Offset = Annotated[int, Query(ge=0, le=INT32_MAX)]


@router.get("/training_runs")
def list_training_runs(
    tenant: TinkerTenantDep, session: SessionDep, limit: Limit = 20, offset: Offset = 0
) -> schemas.TrainingRunsResponse:
    found, total = tinker_rows.list_runs(session, tenant_id=tenant.id, limit=limit, offset=offset)
    return schemas.TrainingRunsResponse(
        training_runs=[_run_public(session, tenant, run) for run in found],
        cursor=schemas.Cursor(offset=offset, limit=limit, total_count=total),
    )


@router.get("/training_runs/{run_id}")
def get_training_run(
    run_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.TrainingRunPublic:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=run_id)
    return _run_public(session, tenant, run)


@router.get("/training_runs/{run_id}/checkpoints")
def list_run_checkpoints(
    run_id: PathId, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.CheckpointsListResponse:
    run = tinker_rows.get_run(session, tenant_id=tenant.id, run_id=run_id)
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id, run_id=run.id)
    return schemas.CheckpointsListResponse(
        checkpoints=[_checkpoint_public(*item) for item in named]
    )


@router.get("/checkpoints")
def list_checkpoints(
    tenant: TinkerTenantDep, session: SessionDep, limit: Limit = 100, offset: Offset = 0
) -> schemas.CheckpointsListResponse:
    named = tinker_rows.named_checkpoints(session, tenant_id=tenant.id)
    page = named[offset : offset + limit]
    return schemas.CheckpointsListResponse(
        checkpoints=[_checkpoint_public(*item) for item in page],
        cursor=schemas.Cursor(offset=offset, limit=limit, total_count=len(named)),
    )


@router.post("/weights_info")
def weights_info(
    body: schemas.WeightsInfoRequest, tenant: TinkerTenantDep, session: SessionDep
) -> schemas.WeightsInfoResponse:
    run, _ = runs.resolve_path(session, tenant_id=tenant.id, path=body.tinker_path)
    model = session.get_one(Model, run.model_id)
    config = ModelConfig.model_validate(model.config)
    return schemas.WeightsInfoResponse(
        base_model=model.base_model,
        lora_rank=config.lora_rank,
        train_mlp=bool(set(runs.MLP_MODULES) & set(config.lora_target_modules)),
        train_attn=bool(set(runs.ATTENTION_MODULES) & set(config.lora_target_modules)),
    )

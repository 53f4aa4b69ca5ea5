"""The Tinker protocol's sampling routes: sampling sessions, samplers and ``asample`` (the
sample itself is a task of this process: ``api.tinker``)."""

from __future__ import annotations

import uuid

from fastapi import APIRouter
from pydantic import ValidationError
from sqlalchemy import select
from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api import tinker_schemas as schemas
from skytrain_backend.api.admission.model_rules import check_new_model
from skytrain_backend.api.deps import (
    SchedulerDep,
    SessionDep,
    SessionRoute,
    SettingsDep,
    TinkerDep,
    TinkerTenantDep,
)
from skytrain_backend.api.routes.tinker_common import PathId, future
from skytrain_backend.api.tinker import sampling_body
from skytrain_backend.config import Settings
from skytrain_backend.db import registry, tenants
from skytrain_backend.db import tinker as tinker_rows
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerRequest,
    TinkerSampler,
)
from skytrain_backend.errors import InvalidRequest, PayloadTooLarge
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.provision.base import Provider
from skytrain_backend.scheduler import tinker as runs
from skytrain_backend.scheduler.model_configs import ModelConfigs

# Included by the main Tinker router (api/routes/tinker.py), under its /api/v1 prefix.
router = APIRouter(tags=["tinker"], route_class=SessionRoute)


def _base_model_sampler_model(
    session: Session,
    tenant: Tenant,
    settings: Settings,
    provider: Provider | None,
    configs: ModelConfigs,
    base_model: str,
) -> Model:
    """The tenant's model that stands for ``base_model`` itself (step 0), created once, under
    the rules of any new model."""
    config = ModelConfig()
    limits = check_new_model(
        session,
        tenant=tenant,
        settings=settings,
        base_model=base_model,
        lora_rank=config.lora_rank,
        provider=provider,
        configs=configs,
    )
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
        config=config.model_dump(mode="json"),
        return_existing=True,
        max_models=limits.max_models,
    )
    return model


@router.post("/create_sampling_session")
def create_sampling_session(
    body: schemas.CreateSamplingSessionRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
    scheduler: SchedulerDep,
) -> schemas.CreateSamplingSessionResponse:
    tinker_rows.open_session(session, tenant_id=tenant.id, session_id=body.session_id)
    if body.model_path is not None:
        run, checkpoint = runs.resolve_path(session, tenant_id=tenant.id, path=body.model_path)
        model = session.get_one(Model, run.model_id)
        step = checkpoint.step
    elif body.base_model is not None:
        model = _base_model_sampler_model(
            session, tenant, settings, scheduler.provider, scheduler.configs, body.base_model
        )
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
    "target_prompt_logprobs": "target prompt logprobs",
    "prompt_alt_tokens_k": "prompt alternative tokens",
    "record_stability_info": "stability information (stable_reinforce)",
}


def _prompt_scoring(body: schemas.SampleRequest, prompt: list[int]) -> int | None:
    """The number of top tokens per prompt position the engine is asked for, or None when
    the prompt's logprobs are not (``include_prompt_logprobs``)."""
    asked = bool(body.prompt_logprobs)
    if not asked and (body.topk_prompt_logprobs or body.prompt_logprobs_last_n is not None):
        field = "topk_prompt_logprobs" if body.topk_prompt_logprobs else "prompt_logprobs_last_n"
        raise InvalidRequest(f"{field} applies to prompt logprobs: set prompt_logprobs")
    last_n = body.prompt_logprobs_last_n
    if asked and last_n is not None and not 1 <= last_n <= len(prompt) - 1:
        raise InvalidRequest(
            f"prompt_logprobs_last_n is {last_n}: it must be between 1 and the prompt's length "
            f"less one ({len(prompt) - 1})"
        )
    return body.topk_prompt_logprobs if asked else None


@router.post("/asample")
async def asample(
    body: schemas.SampleRequest,
    tenant: TinkerTenantDep,
    session: SessionDep,
    settings: SettingsDep,
    tinker: TinkerDep,
) -> schemas.UntypedAPIFuture:
    """Queue a sampling request; its task (in this process) asks the sampler's engine. It
    counts against the tenant's requests in flight from now until it is answered: past its
    limit, 429 (the SDK backs off and sends it again)."""
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
    sampler_id, tenant_id = body.sampling_session_id, tenant.id
    limits = tenants.limits_of(tenant, settings)
    sampling = sampling_body(
        prompt=prompt,
        num_samples=body.num_samples,
        params=body.sampling_params,
        topk_sample_logprobs=body.topk_sample_logprobs,
        prompt_logprobs=_prompt_scoring(body, prompt),
    )

    def find() -> tuple[str, str]:
        sampler = tinker_rows.get_sampler(session, tenant_id=tenant_id, sampler_id=sampler_id)
        found = sampler.id, f"{sampler.model_id}:step{sampler.step}"
        session.rollback()  # no connection held while the sample is admitted
        return found

    def record() -> TinkerRequest:
        row = TinkerRequest(
            tenant_id=tenant_id,
            sampler_id=sampler_id,
            kind="sample",
            status="running",
            params={"num_samples": body.num_samples, "prompt_tokens": len(prompt)},
        )
        session.add(row)
        session.commit()
        return row

    sampler_id, model = await run_in_threadpool(find)
    release = await tinker.admit_sample(tenant_id=tenant_id, limits=limits, body=sampling)
    try:
        row = await run_in_threadpool(record)
    except BaseException:
        release()
        raise
    tinker.start_sample(
        request_id=row.id,
        tenant_id=tenant_id,
        model=model,
        body=sampling,
        release=release,
        prompt_logprobs_last_n=body.prompt_logprobs_last_n if body.prompt_logprobs else None,
    )
    return future(row, sample_sequence_ids=[f"{row.id}:{i}" for i in range(body.num_samples)])

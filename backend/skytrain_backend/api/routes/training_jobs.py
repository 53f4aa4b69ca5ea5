"""Training jobs: RL (trajectory groups) and SFT (trajectories or an uploaded file).

Creating a job validates everything, stores the input batch, and records the job ``queued``;
the scheduler hands it to a worker. Cancelling a queued job ends it at once; a running one is
asked to stop.
"""

from __future__ import annotations

import contextlib
import functools
import re
from typing import Any, Generic, TypeVar

import msgspec
from fastapi import APIRouter, Request, Response
from sqlalchemy.orm import Session

from skytrain_backend.api import ingest
from skytrain_backend.api.bulk import LargeBodyRoute, json_body_doc
from skytrain_backend.api.deps import (
    EventCursor,
    JobId,
    Limit,
    ModelIdQuery,
    NotifierDep,
    PageDep,
    SessionDep,
    SettingsDep,
    TenantDep,
    Upload,
    UploadDep,
    WaitingDep,
    WaitS,
    in_thread,
)
from skytrain_backend.api.longpoll import WAIT_REFUSED_HEADER, long_poll
from skytrain_backend.api.routes.files import read_uploaded_file
from skytrain_backend.api.schemas import (
    LongSequencesPublic,
    SFTTrainingJobCreate,
    TrainingJobCreate,
    TrainingJobEventsPublic,
    TrainingJobPublic,
    TrainingJobsPublic,
    page_public,
)
from skytrain_backend.config import Settings
from skytrain_backend.db import checkpoints, jobs, notify, registry
from skytrain_backend.db.models import Model, Tenant, TrainingJob, new_id, utcnow
from skytrain_backend.db.tenants import TenantLimits, limits_of, reserve_as_it_streams
from skytrain_backend.errors import InvalidRequest, NotFound
from skytrain_backend.observability import logs, metrics
from skytrain_backend.protocol import (
    TERMINAL_JOB_STATUSES,
    JobKind,
    JobStatus,
    ModelConfig,
    RLTrainConfig,
    SFTTrainConfig,
    check_trainable_turns,
    sampled_step,
)
from skytrain_backend.ranges import ID_MAX_LENGTH, ID_PATTERN
from skytrain_backend.scheduler import ranks
from skytrain_backend.scheduler.serving import job_waiting
from skytrain_backend.storage import ObjectStore, keys

router = APIRouter(tags=["training jobs"], route_class=LargeBodyRoute)

ART_EVENT_TYPES = frozenset(
    {"training_started", "gradient_step", "training_ended", "training_failed"}
)


def _store_job(
    upload: Upload,
    *,
    model: Model,
    kind: JobKind,
    config: RLTrainConfig | SFTTrainConfig,
    batch: ingest.IngestBatch,
    job_id: str,
) -> TrainingJobPublic:
    session, limits, scheduling = upload.session, upload.limits, upload.settings.scheduler

    def insert(uri: str) -> TrainingJob:
        jobs.reserve_job(session, tenant_id=model.tenant_id, max_queued_jobs=limits.max_queued_jobs)
        # A job makes its model active: the scheduler places it on a worker if needed.
        model.last_active_at = utcnow()
        return jobs.add_job(
            session,
            job_id=job_id,
            model_id=model.id,
            kind=kind,
            config=config.model_dump(mode="json"),
            input_uri=uri,
            num_groups=batch.num_items if kind == "rl" else 0,
            num_trajectories=batch.num_trajectories,
            max_attempts=scheduling.job_max_attempts,
            input_bytes=batch.num_bytes,
            request_id=logs.current_request_id(),
        )

    job = ingest.store_then_commit(
        upload.store,
        session,
        key=_input_key(model, job_id),
        data=batch.output,
        insert=insert,
        reservation=batch.reservation,
    )
    upload.scheduler.wake()
    return _job_public(session, job, limits=limits, max_workers=scheduling.launched_workers_limit)


def _job_public(
    session: Session, job: TrainingJob, *, limits: TenantLimits, max_workers: int | None
) -> TrainingJobPublic:
    """The job; a queued one says in ``waiting`` why it has not started."""
    public = TrainingJobPublic.model_validate(job)
    public.waiting = job_waiting(session, job=job, limits=limits, max_workers=max_workers)
    return public


def _input_key(model: Model, job_id: str) -> str:
    return keys.job_input_key(tenant_id=model.tenant_id, model_id=model.id, job_id=job_id)


def _check_servable(session: Session, *, model: Model, settings: Settings) -> None:
    """A job whose adapter no worker would load is refused now, not after training."""
    ranks.check_lora_rank(
        session,
        base_model=model.base_model,
        lora_rank=ranks.model_lora_rank(model),
        default_limit=settings.engine.max_lora_rank,
        launches=settings.scheduler.provider != "none",
    )


RequestT = TypeVar("RequestT", TrainingJobCreate, SFTTrainingJobCreate)
ConfigT = TypeVar("ConfigT", RLTrainConfig, SFTTrainConfig)
Items = list[msgspec.Raw] | None


class _JobBody(Generic[RequestT, ConfigT]):
    """How one kind of job reads its body; ``_queue_job`` does what both kinds share."""

    kind: JobKind
    schema: type[RequestT]
    list_field: str

    def config(self, request: RequestT, items: Items, *, session: Session, model: Model) -> ConfigT:
        """The job's options for ``model``; raises for a body that asks for something
        impossible."""
        raise NotImplementedError

    def add_items(
        self, items: Items, batch: ingest.IngestBatch, config: ConfigT, *, model: Model
    ) -> None:
        """The body's list, each item validated, into the batch (of a job of ``model``)."""
        raise NotImplementedError

    def too_long(self) -> LongSequencesPublic | None:
        """The sequences longer than the job's row, known once the items are added."""
        return None

    def finish(
        self,
        request: RequestT,
        batch: ingest.IngestBatch,
        *,
        session: Session,
        store: ObjectStore,
        tenant: Tenant,
    ) -> None:
        """What remains once the body's buffer is closed."""


def _reference_by_id(session: Session, model: Model, reference: str) -> int:
    """ART's ``kl_ref_adapter_path``: taken only as the id of a live checkpoint of the job's
    own model (never a path on this server); its step."""
    checkpoint = checkpoints.live_checkpoint_by_id(
        session, model_id=model.id, checkpoint_id=reference
    )
    if checkpoint is None:
        safe = len(reference) <= ID_MAX_LENGTH and re.fullmatch(ID_PATTERN, reference)
        shown = repr(reference) if safe else "it"
        raise InvalidRequest(
            f"experimental_config.kl_ref_adapter_path: {shown} is not a checkpoint of model "
            f"{model.id}; send the id of one of its checkpoints (GET /v1/models/{model.id}/"
            "checkpoints): a path on the server is never read"
        )
    return checkpoint.step


def _check_reference_step(session: Session, model: Model, config: RLTrainConfig) -> None:
    """A ``kl_penalty_reference_step`` names a live checkpoint of the job's model (0: the base
    model, always there)."""
    step = config.kl_penalty_reference_step
    if not step:
        return
    try:
        checkpoints.get_checkpoint(session, model_id=model.id, step=step)
    except NotFound as exc:
        raise InvalidRequest(f"kl_penalty_reference_step={step}: {exc.message}") from exc


class _RLJob(_JobBody[TrainingJobCreate, RLTrainConfig]):
    """A GRPO job's body: trajectory groups, skytrain's or ART's options."""

    kind: JobKind = "rl"
    schema = TrainingJobCreate
    list_field = "trajectory_groups"

    def __init__(self) -> None:
        self._trainable_turns = 0
        self._long: ingest.LongSequences | None = None
        self._current_step = 0

    def config(
        self, request: TrainingJobCreate, items: Items, *, session: Session, model: Model
    ) -> RLTrainConfig:
        if request.config is not None and request.experimental_config is not None:
            raise InvalidRequest(
                "send either config (skytrain's options) or experimental_config (ART's), not both"
            )
        config = request.config or RLTrainConfig.from_experimental(
            request.experimental_config,
            checkpoint_step=functools.partial(_reference_by_id, session, model),
        )
        _check_reference_step(session, model, config)
        self._current_step = registry.latest_step(session, model_id=model.id)
        return config

    def add_items(
        self, items: Items, batch: ingest.IngestBatch, config: RLTrainConfig, *, model: Model
    ) -> None:
        allow = config.allow_training_without_logprobs
        self._long = ingest.LongSequences(
            row_tokens=config.packed_sequence_length
            or ModelConfig.model_validate(model.config or {}).max_seq_length
        )
        for index, group in enumerate(
            ingest.each_item(items or [], ingest.parse_group, field="trajectory_groups")
        ):
            self._trainable_turns += ingest.trainable_turns(
                group, index, allow_training_without_logprobs=allow
            )
            self._check_off_policy(group, index, config.max_off_policy_steps)
            self._long.add(group)
            batch.add(group)

    def _check_off_policy(self, group: ingest.Group, index: int, limit: int | None) -> None:
        """A group sampled more than ``max_off_policy_steps`` before the model's step now is
        refused (the whole job: nothing is stored)."""
        step = sampled_step(group)
        if limit is None or step is None or self._current_step - step <= limit:
            return
        raise InvalidRequest(
            f"trajectory_groups[{index}] was sampled from step {step}, "
            f"{self._current_step - step} steps before the model's current step "
            f"{self._current_step}, and max_off_policy_steps={limit}: sample the group again "
            "from the current step, leave it out, or raise max_off_policy_steps"
        )

    def too_long(self) -> LongSequencesPublic | None:
        report = self._long.report() if self._long is not None else None
        return None if report is None else LongSequencesPublic(**report)

    def finish(
        self,
        request: TrainingJobCreate,
        batch: ingest.IngestBatch,
        *,
        session: Session,
        store: ObjectStore,
        tenant: Tenant,
    ) -> None:
        check_trainable_turns(self._trainable_turns)


class _SFTJob(_JobBody[SFTTrainingJobCreate, SFTTrainConfig]):
    """An SFT job's body: trajectories, or the URL of an uploaded JSONL file."""

    kind: JobKind = "sft"
    schema = SFTTrainingJobCreate
    list_field = "trajectories"

    def config(
        self, request: SFTTrainingJobCreate, items: Items, *, session: Session, model: Model
    ) -> SFTTrainConfig:
        if (items is None) == (request.training_data_url is None):
            raise InvalidRequest(
                "send exactly one of trajectories (a list) or training_data_url "
                "(skytrain-file://<id> from POST /v1/files)"
            )
        return request.config or SFTTrainConfig()

    def add_items(
        self, items: Items, batch: ingest.IngestBatch, config: SFTTrainConfig, *, model: Model
    ) -> None:
        if items is not None:
            for trajectory in ingest.each_item(
                items, ingest.parse_trajectory, field="trajectories"
            ):
                batch.add(trajectory)

    def finish(
        self,
        request: SFTTrainingJobCreate,
        batch: ingest.IngestBatch,
        *,
        session: Session,
        store: ObjectStore,
        tenant: Tenant,
    ) -> None:
        if request.training_data_url is not None:
            lines = read_uploaded_file(
                session, store, tenant_id=tenant.id, url=request.training_data_url
            )
            ingest.parse_trajectory_lines(lines, batch)


@router.post(
    "/training-jobs",
    status_code=201,
    response_model=TrainingJobPublic,
    openapi_extra=json_body_doc(TrainingJobCreate),
)
async def create_training_job(request: Request, upload: UploadDep) -> TrainingJobPublic:
    """Queue a GRPO step on the trajectory groups (ART's experimental_config is accepted)."""
    return await _queue(_RLJob(), request, upload)


@router.post(
    "/sft-training-jobs",
    status_code=201,
    response_model=TrainingJobPublic,
    openapi_extra=json_body_doc(SFTTrainingJobCreate),
)
async def create_sft_training_job(request: Request, upload: UploadDep) -> TrainingJobPublic:
    """Queue supervised fine-tuning on ``trajectories`` or on an uploaded JSONL file."""
    return await _queue(_SFTJob(), request, upload)


async def _queue(job: _JobBody[Any, Any], request: Request, upload: Upload) -> TrainingJobPublic:
    body = await ingest.read_body(request)
    try:
        queued = await in_thread(upload.session, _queue_job, job, body, upload)
    finally:
        body.close()
    logs.set_context(job_id=queued.id)  # the call's access line names the job it made
    return queued


def _queue_job(job: _JobBody[Any, Any], body: ingest.Spool, upload: Upload) -> TrainingJobPublic:
    """Validate the body, stream its batch to the store and record the job ``queued``."""
    session, tenant = upload.session, upload.tenant
    batch = ingest.IngestBatch(limit=upload.settings.server.max_trajectories_per_request)
    try:
        with body.view() as buffer:
            request, items = ingest.split_body(buffer, schema=job.schema, list_field=job.list_field)
            model = registry.get_model(session, tenant_id=tenant.id, model_id=request.model_id)
            _check_servable(session, model=model, settings=upload.settings)
            config = job.config(request, items, session=session, model=model)
            batch.reservation = reserve_as_it_streams(
                session, tenant_id=tenant.id, limits=upload.limits, what="this job's trajectories"
            )
            session.commit()  # ends the read: no connection is held while the batch streams
            job_id = new_id()
            batch.stream_to(upload.store, _input_key(model, job_id))
            job.add_items(items, batch, config, model=model)
            del items  # the raw items point into the buffer, which closes with this block
        job.finish(request, batch, session=session, store=upload.store, tenant=tenant)
        public = _store_job(
            upload, model=model, kind=job.kind, config=config, batch=batch, job_id=job_id
        )
        public.too_long = job.too_long()
        return public
    finally:
        batch.close()


@router.get("/training-jobs", response_model=TrainingJobsPublic)
def list_training_jobs(
    session: SessionDep,
    tenant: TenantDep,
    page: PageDep,
    model_id: ModelIdQuery = None,
    status: JobStatus | None = None,
) -> TrainingJobsPublic:
    if model_id is not None:
        registry.get_model(session, tenant_id=tenant.id, model_id=model_id)
    found = jobs.list_jobs(
        session, tenant_id=tenant.id, model_id=model_id, status=status, page=page
    )
    return page_public(TrainingJobsPublic, found)


@router.get("/training-jobs/{job_id}", response_model=TrainingJobPublic)
def get_training_job(
    job_id: JobId, session: SessionDep, tenant: TenantDep, settings: SettingsDep
) -> TrainingJobPublic:
    """The job; a queued one says in ``waiting`` why it has not started."""
    job = jobs.get_job(session, tenant_id=tenant.id, job_id=job_id)
    return _job_public(
        session,
        job,
        limits=limits_of(tenant, settings),
        max_workers=settings.scheduler.launched_workers_limit,
    )


@router.post("/training-jobs/{job_id}/cancel", response_model=TrainingJobPublic)
def cancel_training_job(job_id: JobId, session: SessionDep, tenant: TenantDep) -> TrainingJobPublic:
    job = jobs.get_job(session, tenant_id=tenant.id, job_id=job_id)
    queued = job.status == "queued"
    cancelled = jobs.cancel_job(session, job=job)
    if queued:  # ended here; a running job ends when its worker stops it
        metrics.JOBS_ENDED.labels(status="cancelled").inc()
    return TrainingJobPublic.model_validate(cancelled)


@router.get("/training-jobs/{job_id}/events", response_model=TrainingJobEventsPublic)
async def list_training_job_events(
    job_id: JobId,
    request: Request,
    response: Response,
    session: SessionDep,
    tenant: TenantDep,
    notifier: NotifierDep,
    waiting: WaitingDep,
    settings: SettingsDep,
    after: EventCursor = None,
    limit: Limit = 100,
    wait_s: WaitS = 0.0,
) -> TrainingJobEventsPublic:
    """Events in order; pass the last event's id as ``after`` to follow a job, and ``wait_s``
    to have the answer wait for the next event (an empty page means none came within
    ``wait_s``, or the job ended). A tenant has at most ``max_waiting_polls`` such waits at
    once: past them, the answer comes at once, with the ``X-Skytrain-Wait-Refused`` header
    saying why."""
    job = await in_thread(session, jobs.get_job, session, tenant_id=tenant.id, job_id=job_id)
    job_key, tenant_id = job.id, tenant.id
    wait_limit = limits_of(tenant, settings).max_waiting_polls
    # ART's client knows these four types only (its event model is a Literal of them).
    types = ART_EVENT_TYPES if request.url.path.startswith("/v1/preview/") else None

    def page() -> TrainingJobEventsPublic | None:
        try:
            rows, has_more = jobs.list_events(
                session,
                job_id=job_key,
                after=None if after is None else int(after),
                limit=limit,
                types=types,
            )
            if not rows and session.get_one(TrainingJob, job_key).status not in (
                TERMINAL_JOB_STATUSES
            ):
                return None
            return page_public(TrainingJobEventsPublic, (rows, has_more))
        finally:
            session.rollback()

    holding = (
        waiting.hold(tenant_id, limit=wait_limit) if wait_s > 0 else contextlib.nullcontext(False)
    )
    with holding as may_wait:
        if wait_s > 0 and not may_wait:
            response.headers[WAIT_REFUSED_HEADER] = (
                f"{wait_limit} long-polls of yours are waiting already (max_waiting_polls): "
                "answered without waiting"
            )
        found = await long_poll(
            request,
            notifier,
            page,
            channel=notify.EVENTS,
            key=job_key,
            wait_s=wait_s if may_wait else 0.0,
            checks=waiting.checks if may_wait else None,
        )
    return found or TrainingJobEventsPublic(data=[], has_more=False)

"""The Tinker protocol's work inside the control plane: the operations the routes build,
queued (``submit``), runs created and loaded, sampling, and waiting on futures.

Every training operation is one typed ``TinkerOperation`` (``protocol/tinker_ops.py``): the
route builds it from the SDK's request and calls ``submit``; the worker leases the same
operation back.

Sampling goes to the worker engine serving the sampler's checkpoint, through the inference
gateway (the route, the engine secret, the per-tenant limit): the prompt's token ids go to
``/v1/completions`` as vLLM takes them, and the sampled token ids and their logprobs come back.
Each ``asample`` is a future row; its answer is computed by a task of this process and stored,
so any control-plane process can hand it out.

Each sample is counted against its tenant's requests, sequences and tokens in flight
(``Gateway.admit_completion``) from the moment ``asample`` accepts it until its answer is stored:
a tenant's samples waiting for their model to be placed are bounded like its requests being
generated, and past its limit ``asample`` answers 429 (the SDK backs off and sends it again).

``retrieve_future`` waits on the server (up to ``RETRIEVE_WAIT_S``) before answering
``try_again``, since the SDK asks again at once: one request per few seconds per future instead
of a busy loop. A tenant has at most ``max_waiting_polls`` waits at once in a process (the
long-polls' counter, ``api/longpoll.py``): past them a future not done yet is answered 429, and
the SDK backs off. The waits' lookups take turns per tenant (``api/admission/fairness.py``), so one
tenant's many waits never delay another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import AbstractContextManager
from typing import Any, TypeVar

import msgspec
from pydantic import ValidationError
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.admission.model_rules import check_new_model
from skytrain_backend.api.gateway import Gateway
from skytrain_backend.api.tinker.completions import (
    parse_completion,
    parse_prompt_logprobs,
    sampling_body,
)
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants, tinker_rows
from skytrain_backend.db.models import (
    Model,
    Tenant,
    TinkerRequest,
    TinkerRun,
    utcnow,
)
from skytrain_backend.db.tenants import TenantLimits, limits_of, metadata_bytes
from skytrain_backend.errors import (
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    QuotaExceeded,
    RateLimited,
    SkytrainError,
    Unavailable,
)
from skytrain_backend.protocol import ModelConfig
from skytrain_backend.protocol import tinker_api as schemas
from skytrain_backend.protocol.tinker_ops import (
    CreationOperation,
    CreationParams,
    LoadOperation,
    LoadParams,
    SaveOperation,
    TinkerOperation,
)
from skytrain_backend.scheduler.loop import Scheduler
from skytrain_backend.scheduler.tinker import futures, runs
from skytrain_backend.storage.base import ObjectStore

logger = logging.getLogger(__name__)

# How long retrieve_future holds a request for a future that is not done (the SDK's own
# timeout for it is 45 s).
RETRIEVE_WAIT_S = 10.0
# How often a wait looks again without being notified; how many look at once, and how many
# of them one tenant's.
FALLBACK_POLL_S = 1.0
LOOKUP_CONCURRENCY = 4
LOOKUP_PER_TENANT = 2

T = TypeVar("T")

ADAM_ONLY = "skytrain's Tinker runs use Adam (AdamW) only: leave optimizer out or use AdamParams"
_UNSERVED_SAMPLING = {
    "target_prompt_logprobs": "target prompt logprobs",
    "prompt_alt_tokens_k": "prompt alternative tokens",
    "record_stability_info": "stability information (stable_reinforce)",
}


def future(row: TinkerRequest, **extra: Any) -> schemas.UntypedAPIFuture:
    return schemas.UntypedAPIFuture(request_id=row.id, model_id=row.run_id, **extra)


class TinkerService:
    """One per app: the sampling tasks of this process, and the waits on futures and queues.

    A wait looks at the database, then sleeps until this process records a change to what it
    waits for (``notify``) or ``FALLBACK_POLL_S`` passes (a change another control-plane
    process made). Lookups run ``LOOKUP_CONCURRENCY`` at a time, at most ``LOOKUP_PER_TENANT``
    of them one tenant's, so many waiting clients never take the connections heartbeats and
    writes need, nor hold up another tenant's lookups.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        store: ObjectStore,
        gateway: Gateway,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self.store = store
        self._gateway = gateway
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._waiting: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self.lookups = FairLimiter(total=LOOKUP_CONCURRENCY, per_key=LOOKUP_PER_TENANT)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- training runs and their operations -----------------------------------------------------

    def submit(
        self,
        session: Session,
        run: TinkerRun,
        seq_id: int | None,
        operation: TinkerOperation,
        *,
        refused: str | None = None,
        body: bytes | None = None,
    ) -> schemas.UntypedAPIFuture:
        """How every operation of a live run ends: queued in the run's order (or recorded
        failed, ``refused`` saying why), its future answered, the run's worker told."""
        row = runs.submit(
            session,
            store=self.store,
            limits=limits_of(session.get_one(Tenant, run.tenant_id), self.settings),
            run=run,
            seq_id=seq_id,
            operation=operation,
            body=body,
            refused=refused,
        )
        self.notify(f"job:{run.job_id}")
        return future(row)

    def create_run(
        self, session: Session, new: runs.NewRun, *, tenant: Tenant, scheduler: Scheduler
    ) -> schemas.UntypedAPIFuture:
        """A new training run in the SDK's session: its model checked against the tenant's
        rules and quota, then created with its creation as its operation 0."""
        tinker_session = tinker_rows.open_session(
            session, tenant_id=tenant.id, session_id=new.session_id
        )
        limits = check_new_model(
            session,
            tenant,
            new.base_model,
            new.model_config,
            settings=self.settings,
            scheduler=scheduler,
            tinker_training=True,
        )
        metadata_bytes(new.user_metadata, limits=limits, field="user_metadata")
        operation = runs.create_run(
            session,
            new,
            tenant=tenant,
            tinker_session=tinker_session,
            max_attempts=self.settings.scheduler.job_max_attempts,
            max_models=limits.max_models,
        )
        return future(operation)

    def create_from_state(
        self,
        session: Session,
        *,
        tenant: Tenant,
        scheduler: Scheduler,
        body: schemas.LoadWeightsRequest,
        session_id: str,
        model_seq_id: int,
    ) -> schemas.UntypedAPIFuture:
        """``create_training_client_from_state``: a new run whose state starts from the
        checkpoint ``body.path`` names (its base model and LoRA shape with it)."""
        source_model, source_run, load = _load_source(session, tenant, body)
        if body.optimizer_config is not None and (
            body.optimizer or body.optimizer_config.type != "adamw"
        ):
            raise InvalidRequest(ADAM_ONLY)
        if body.base_model is not None and body.base_model != source_model.base_model:
            raise InvalidRequest(
                f"{body.path} was trained on {source_model.base_model!r}, not {body.base_model!r}"
            )
        creation = CreationOperation(
            kind="load_create",
            params=CreationParams(path=load.path, source=load.source, optimizer=load.optimizer),
        )
        new = runs.NewRun(
            session_id,
            model_seq_id,
            source_model.base_model,
            ModelConfig.model_validate(source_model.config),
            schemas.LoraConfig.model_validate(source_run.lora_config),
            body.user_metadata,
            creation,
        )
        return self.create_run(session, new, tenant=tenant, scheduler=scheduler)

    def load_operation(
        self, session: Session, *, tenant: Tenant, run: TinkerRun, body: schemas.LoadWeightsRequest
    ) -> tuple[LoadOperation, str | None]:
        """A load into the live ``run``, and why it is refused (None: it is not): the
        checkpoint must exist and have the run's base model and LoRA shape."""
        operation = LoadOperation(kind="load_weights")
        try:
            source_model, _, load = _load_source(session, tenant, body)
        except (InvalidRequest, NotFound) as exc:
            return operation, exc.message
        operation = LoadOperation(kind="load_weights", params=load)
        target = session.get_one(Model, run.model_id)
        if target.base_model != source_model.base_model or target.config != source_model.config:
            return operation, (
                f"{body.path} has another base model or LoRA shape than run {run.id}: create a "
                "training client from it instead (create_training_client_from_state)"
            )
        return operation, None

    def submit_save(
        self,
        session: Session,
        run: TinkerRun,
        seq_id: int | None,
        save: SaveOperation,
        *,
        refused: str | None = None,
    ) -> schemas.UntypedAPIFuture:
        """``submit`` a save, refused also when its name is not one a checkpoint can have, or
        names one of ``run``'s already that it does not overwrite."""
        if refused is None and save.params.name is not None:
            try:
                runs.check_name(save.params.name)
                refused = runs.name_refusal(session, run=run, save=save)
            except InvalidRequest as exc:
                refused = exc.message
        return self.submit(session, run, seq_id, save, refused=refused)

    # --- waiting --------------------------------------------------------------------------------

    def notify(self, key: str) -> None:
        """Wake the waits on ``key`` (``request:<id>``, ``job:<id>``); from any thread."""
        self._loop.call_soon_threadsafe(self._wake, key)

    def _wake(self, key: str) -> None:
        for event in self._waiting.pop(key, set()):
            event.set()

    async def watch(
        self,
        key: str,
        look: Callable[[], tuple[bool, T]],
        *,
        turn: str,
        timeout_s: float,
        idle: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> T:
        """``look()`` (in a thread, in the turn of ``turn``: a tenant, a worker) until it says
        it is done or ``timeout_s`` passed; the last answer. Each wait between two looks runs
        in ``idle()``."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = asyncio.Event()
            self._waiting[key].add(event)
            try:
                done, answer = await self.lookups.run_sync(turn, look)
                remaining = deadline - time.monotonic()
                if done or remaining <= 0:
                    return answer
                with idle(), contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, FALLBACK_POLL_S))
            finally:
                waiting = self._waiting.get(key)
                if waiting is not None:
                    waiting.discard(event)
                    if not waiting:
                        del self._waiting[key]

    async def wait(
        self,
        *,
        tenant_id: str,
        request_id: str,
        on_done: Callable[[Session, TinkerRequest], Any],
        wait_s: float = RETRIEVE_WAIT_S,
        idle: Callable[[], AbstractContextManager[None]] = contextlib.nullcontext,
    ) -> Any:
        """``on_done(session, row)`` once the future succeeded; else its failure, or its
        pending state after ``wait_s``; each wait between two looks in ``idle()``."""

        def look() -> tuple[bool, Any]:
            with self.sessions() as session:
                row = tinker_rows.get_request(session, tenant_id=tenant_id, request_id=request_id)
                found = futures.state(
                    session,
                    operation=row,
                    sample_timeout_s=self.settings.tinker.sample_timeout_s,
                    settings=self.settings,
                )
                if found is None:
                    return True, on_done(session, row)
                return isinstance(found, futures.Failed), found

        return await self.watch(
            f"request:{request_id}", look, turn=tenant_id, timeout_s=wait_s, idle=idle
        )

    # --- sampling -------------------------------------------------------------------------------

    async def asample(
        self, session: Session, *, tenant: Tenant, body: schemas.SampleRequest
    ) -> schemas.UntypedAPIFuture:
        """Queue a sampling request; its task (in this process) asks the sampler's engine. It
        counts against the tenant's requests in flight from now until it is answered: past
        its limit, 429 (the SDK backs off and sends it again)."""
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
        limits = limits_of(tenant, self.settings)
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
        release = await self.admit_sample(tenant_id=tenant_id, limits=limits, body=sampling)
        try:
            row = await run_in_threadpool(record)
        except BaseException:
            release()
            raise
        self.start_sample(
            request_id=row.id,
            tenant_id=tenant_id,
            model=model,
            body=sampling,
            release=release,
            prompt_logprobs_last_n=body.prompt_logprobs_last_n if body.prompt_logprobs else None,
        )
        return future(row, sample_sequence_ids=[f"{row.id}:{i}" for i in range(body.num_samples)])

    async def admit_sample(
        self, *, tenant_id: str, limits: TenantLimits, body: dict[str, Any]
    ) -> Callable[[], None]:
        """Count a sample in against the tenant's limits (``RateLimited`` past them); the
        function that counts it out, which ``start_sample`` then owns."""
        return await self._gateway.admit_completion(tenant_id=tenant_id, limits=limits, body=body)

    def start_sample(
        self,
        *,
        request_id: str,
        tenant_id: str,
        model: str,
        body: dict[str, Any],
        release: Callable[[], None],
        prompt_logprobs_last_n: int | None = None,
    ) -> None:
        """Sample in a task of this process; ``release`` (its admission) once it is settled."""
        task = asyncio.create_task(
            self._sample(
                request_id=request_id,
                tenant_id=tenant_id,
                model=model,
                body=body,
                last_n=prompt_logprobs_last_n,
            ),
            name=f"tinker-sample-{request_id}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: release())

    async def _sample(
        self,
        *,
        request_id: str,
        tenant_id: str,
        model: str,
        body: dict[str, Any],
        last_n: int | None,
    ) -> None:
        deadline = time.monotonic() + self.settings.tinker.sample_timeout_s
        while True:
            try:
                answer = await self._gateway.complete_tokens(
                    tenant_id=tenant_id, model=model, body=body
                )
                sequences = parse_completion(
                    answer, num_samples=int(body["n"]), k=int(body["logprobs"])
                )
                prompt = parse_prompt_logprobs(answer, body, last_n=last_n)
            except (Unavailable, RateLimited) as exc:
                # A model no worker can be started for fails now; anything else may pass.
                cannot = isinstance(exc, Unavailable) and exc.state == "failed"
                if cannot or time.monotonic() >= deadline:
                    await self._settle(request_id, error=exc.message, category="server")
                    return
                await asyncio.sleep(getattr(exc, "retry_after_s", 1.0))
                continue
            except (InvalidRequest, NotFound) as exc:
                await self._settle(request_id, error=exc.message, category="user")
                return
            except SkytrainError as exc:
                await self._settle(request_id, error=exc.message, category="server")
                return
            except Exception:
                logger.exception("sampling request %s failed", request_id)
                await self._settle(
                    request_id,
                    error="sampling failed: see the control plane's log",
                    category="server",
                )
                return
            result: dict[str, Any] = {
                "sequences": [
                    {
                        "tokens": s.tokens,
                        "logprobs": s.logprobs,
                        "stop_reason": s.stop_reason,
                        "topk": s.topk,
                    }
                    for s in sequences
                ]
            }
            if prompt is not None:
                result["prompt"] = {"logprobs": prompt.logprobs, "topk": prompt.topk}
            await self._settle(request_id, result=result)
            return

    async def _settle(
        self,
        request_id: str,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        category: str = "server",
    ) -> None:
        def write() -> None:
            with self.sessions() as session:
                row = session.get(TinkerRequest, request_id)
                if row is None or row.status in runs.FINISHED:
                    return
                if error is None:
                    _keep_result(session, row, result or {}, settings=self.settings)
                else:
                    row.status, row.error, row.error_category = "failed", error, category
                    row.finished_at = utcnow()
                session.commit()

        await run_in_threadpool(write)
        self.notify(f"request:{request_id}")


def _keep_result(
    session: Session, row: TinkerRequest, result: dict[str, Any], *, settings: Settings
) -> None:
    """Record a sample's ``result`` (kept in its row, as JSON: its bytes counted in the tenant's
    storage quota, taken under the tenant's lock); one that does not fit is not kept: the
    request fails with the quota's error instead. The caller commits."""
    size = len(msgspec.json.encode(result))
    limits = limits_of(session.get_one(Tenant, row.tenant_id), settings)
    request_id = row.id
    try:
        tenants.reserve_storage(
            session,
            tenant_id=row.tenant_id,
            limits=limits,
            adding=size,
            what="this sample's result",
        )
    except QuotaExceeded as exc:
        row = session.get_one(TinkerRequest, request_id)  # the refusal rolled back
        runs.fail_operation(row, f"nothing of it was kept: {exc.message}", category="user")
        return
    row.status, row.result, row.output_bytes = "succeeded", result, size
    row.finished_at = utcnow()


def _load_source(
    session: Session, tenant: Tenant, body: schemas.LoadWeightsRequest
) -> tuple[Model, TinkerRun, LoadParams]:
    """The checkpoint a load names: its model, run, and what a load of it reads."""
    if body.weights_access_token is not None:
        raise InvalidRequest("weights_access_token is not served: load checkpoints of your tenant")
    source_run, checkpoint = runs.resolve_path(session, tenant_id=tenant.id, path=body.path)
    load = LoadParams(
        path=body.path,
        source={"model_id": checkpoint.model_id, "step": checkpoint.step},
        optimizer=body.optimizer,
    )
    return session.get_one(Model, source_run.model_id), source_run, load


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

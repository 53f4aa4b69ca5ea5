"""Where a model is served, and in words what is happening when it is not.

One function answers both ``GET /v1/models/{id}`` (its ``serving`` object, which the SDK's
``register`` waits on) and the inference gateway (which routes a request, or answers 503 with
the same message and a ``Retry-After``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from datetime import timedelta
from typing import Any, Literal

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import registry
from skytrain_backend.db.models import Model, ModelReplica, TrainingJob, Worker, utcnow
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.protocol import ModelConfig, lora_name
from skytrain_backend.scheduler import fair_share, placement, ranks, scale_in

ServingState = Literal[
    "idle",
    "waiting",
    "provisioning",
    "starting",
    "unreachable",
    "training",
    "loading",
    "ready",
    "failed",
]

LIVE_WORKER_STATUSES = ("provisioning", "starting", "unreachable", "ready", "training", "sleeping")
ROUTABLE_WORKER_STATUSES = ("ready", "training")


@dataclass(frozen=True)
class ServingStatus:
    state: ServingState
    message: str
    worker_id: str | None = None
    step: int | None = None
    retry_after_s: float = 5.0
    # Waiting because of the tenant's quota: its requests get 429 rather than 503.
    over_quota: bool = False

    @property
    def ready(self) -> bool:
        """Whether requests are served now: the one state that says so."""
        return self.state == "ready"

    def public(self) -> dict[str, Any]:
        data = asdict(self)
        data.pop("retry_after_s")
        data.pop("over_quota")
        return data | {"ready": self.ready}


def is_served(worker: Worker, *, model_id: str, step: int) -> bool:
    """Whether the worker's engine serves the model's ``step`` (step 0 is the base model)."""
    if step == 0:
        return True
    return any(
        item.get("model_id") == model_id and item.get("step") == step
        for item in worker.served or []
    )


def engine_model_name(worker: Worker, *, model_id: str, step: int) -> str:
    """The name to ask the worker's engine for: the base model, or the step's adapter."""
    if step == 0:
        return worker.served_model_name or worker.base_model
    return lora_name(model_id, step)


def serving_status(
    session: Session,
    *,
    model: Model,
    step: int | None = None,
    limits: TenantLimits | None = None,
    max_workers: int | None = None,
    idle_timeout_s: float | None = None,
) -> ServingStatus:
    """The model's serving state for ``step`` (default: its latest); with the tenant's
    ``limits``, an unplaced model says when its quota is what keeps it waiting, with the
    control plane's ``max_workers`` (``Settings.launched_workers_limit``), when that limit
    does, and with the scheduler's ``idle_timeout_s``
    (``Settings.resolved_model_idle_timeout_s``), that it was taken off its worker for being
    unused (``idle``) rather than that it is loading."""
    target = registry.latest_step(session, model_id=model.id) if step is None else step
    worker = session.get(Worker, model.worker_id) if model.worker_id else None
    if worker is None or worker.status not in LIVE_WORKER_STATUSES:
        if idle_timeout_s is not None and _idle(session, model=model, timeout_s=idle_timeout_s):
            return ServingStatus(
                state="idle",
                # Not "loading": nothing happens until a request (or a registration) comes.
                message=f"idle: loads on its next request ({model.entity}/{model.project}/"
                f"{model.name} was unused for over {idle_timeout_s:.0f} s and left its worker)",
                retry_after_s=2.0,
            )
        reason = placement.quota_wait(session, model=model, limits=limits) if limits else None
        if reason is not None:
            return ServingStatus(
                state="waiting", message=reason, retry_after_s=30.0, over_quota=True
            )
        return _unplaced(session, model=model, max_workers=max_workers)
    if worker.status in ("provisioning", "starting"):
        return ServingStatus(
            state="starting",
            worker_id=worker.id,
            message=f"worker {worker.id} is starting its engine for {model.base_model}",
            retry_after_s=10.0,
        )
    if worker.status == "unreachable":
        return _unreachable(worker, model=model)
    if worker.status != "ready" or not is_served(worker, model_id=model.id, step=target):
        elsewhere = _ready_replicas(session, model=model, step=target)
        if elsewhere:
            # The home trains (its engine sleeps) or loads: its replicas serve meanwhile.
            return ServingStatus(
                state="ready",
                worker_id=elsewhere[0],
                step=target,
                message=f"serving step {target} on worker {', '.join(elsewhere)} while worker "
                f"{worker.id} is {'training' if worker.status == 'sleeping' else 'loading'}",
            )
    if worker.status == "sleeping":
        return ServingStatus(
            state="training",
            worker_id=worker.id,
            step=target,
            message=f"worker {worker.id} is training: its engine sleeps while a job uses the "
            "GPU, and serves again when the job ends",
            retry_after_s=30.0,
        )
    if not is_served(worker, model_id=model.id, step=target):
        return ServingStatus(
            state="loading",
            worker_id=worker.id,
            step=target,
            message=f"worker {worker.id} is loading step {target} of {model.entity}/"
            f"{model.project}/{model.name}",
            retry_after_s=1.0,
        )
    running = session.scalar(
        select(TrainingJob.id).where(
            TrainingJob.model_id == model.id, TrainingJob.status == "running"
        )
    )
    message = f"serving step {target} on worker {worker.id}"
    if running is not None:
        message += f"; training job {running} is running"
    return ServingStatus(state="ready", worker_id=worker.id, step=target, message=message)


def _ready_replicas(session: Session, *, model: Model, step: int) -> list[str]:
    """The workers besides its home that serve the model's ``step`` now."""
    held = select(ModelReplica.worker_id).where(
        ModelReplica.model_id == model.id, ModelReplica.status == "serving"
    )
    return [
        worker.id
        for worker in session.scalars(
            select(Worker)
            .where(Worker.id.in_(held), Worker.status.in_(ROUTABLE_WORKER_STATUSES))
            .order_by(Worker.created_at)
        )
        if worker.engine_endpoint and is_served(worker, model_id=model.id, step=step)
    ]


def _idle(session: Session, *, model: Model, timeout_s: float) -> bool:
    """Unused for ``timeout_s`` with no queued or running job: the scheduler takes such a
    model off its worker (``placement.release_idle_models``) and places it again only when it
    is used."""
    since = utcnow() - timedelta(seconds=timeout_s)
    if model.last_active_at is not None and model.last_active_at > since:
        return False
    return not session.scalar(
        select(
            select(TrainingJob.id)
            .where(
                TrainingJob.model_id == model.id,
                TrainingJob.status.in_(("queued", "running")),
            )
            .exists()
        )
    )


def _unreachable(worker: Worker, *, model: Model) -> ServingStatus:
    return ServingStatus(
        state="unreachable",
        worker_id=worker.id,
        # The address tried is the operator's (`skytrain workers list`), not the tenant's.
        message=f"worker {worker.id} for {model.base_model} is running, but the control "
        "plane cannot reach it yet; its operator sees the address tried and what to do in "
        "`skytrain workers list`",
        retry_after_s=15.0,
    )


def _unplaced(session: Session, *, model: Model, max_workers: int | None) -> ServingStatus:
    """No live worker holds the model: say whether one is coming, or why not."""
    rank = ModelConfig.model_validate(model.config or {}).lora_rank
    room = placement.worker_with_room(session, base_model=model.base_model, lora_rank=rank)
    if room is not None and room.status in (*ROUTABLE_WORKER_STATUSES, "sleeping"):
        # Placed at the scheduler's next pass (woken by the request): a model unused for a
        # while left its worker, and its next request brings it back.
        return ServingStatus(
            state="loading",
            worker_id=room.id,
            message=f"placing {model.entity}/{model.project}/{model.name} on worker {room.id}, "
            "which loads it in a few seconds",
            retry_after_s=2.0,
        )
    newest = placement.newest_worker(session, base_model=model.base_model)
    if (newest is None or newest.status != "failed") and (
        rank_wait := _rank_wait(session, model=model)
    ) is not None:
        return rank_wait
    if newest is not None and newest.status in ("provisioning", "starting"):
        detail = f": {newest.status_message}" if newest.status_message else ""
        return ServingStatus(
            state="provisioning",
            worker_id=newest.id,
            message=f"starting a worker for {model.base_model} ({newest.provider}){detail}",
            retry_after_s=15.0,
        )
    if newest is not None and newest.status == "unreachable":
        # Placement has not reached the model yet; what it waits for is that worker.
        return _unreachable(newest, model=model)
    if newest is not None and newest.status == "failed":
        # Why it failed (a launch error, a stack trace with the host's paths) is the
        # operator's to read, in the control plane's log and `skytrain logs`.
        hold = placement.launch_hold(session, base_model=model.base_model)
        held = f" ({hold.describe(model.base_model)})" if hold is not None else ""
        said = newest.status_message or ""
        if said.startswith(placement.NOT_LAUNCHED):
            # The memory plan's refusal or its missing config.json: skytrain's own words.
            tries = f" (failed launches: {hold.describe(model.base_model)})" if hold else ""
            return ServingStatus(
                state="failed",
                worker_id=newest.id,
                message=f"no worker for base model {model.base_model!r} is launched: "
                f"{said.removeprefix(placement.NOT_LAUNCHED)}{tries}",
                retry_after_s=_retry_after_s(hold),
            )
        return ServingStatus(
            state="failed",
            worker_id=newest.id,
            message=f"the last worker for base model {model.base_model!r} failed to start"
            f"{held}: check that the name is right (a Hugging Face model id you may use, or a "
            f"directory the operator allows); otherwise the operator can see why with "
            f"`skytrain logs {newest.id}`",
            retry_after_s=_retry_after_s(hold),
        )
    at_max_workers = max_workers is not None and placement.live_worker_count(session) >= max_workers
    if room is None and (max_workers is None or at_max_workers):
        # No worker is launched for it: it waits for a slot on the full ones, if any.
        fitting = placement.fitting_workers(session, base_model=model.base_model, lora_rank=rank)
        if fitting:
            wait = fair_share.wait_status(
                session, model=model, worker_ids=[worker.id for worker, _ in fitting]
            )
            return ServingStatus(
                state="waiting",
                message=wait.message,
                retry_after_s=wait.retry_after_s,
            )
    if room is None and max_workers is not None and at_max_workers:
        return _at_max_workers(session, model=model, max_workers=max_workers)
    if newest is not None and newest.status in LIVE_WORKER_STATUSES:
        return ServingStatus(
            state="waiting",
            message=f"the workers for {model.base_model} hold as many models as they may "
            "(max_models): this model is placed once one of theirs goes idle (unused for "
            "SKYTRAIN_MODEL_IDLE_TIMEOUT_S), or a worker with room starts",
            retry_after_s=5.0,
        )
    return ServingStatus(
        state="waiting",
        message=f"waiting for a worker for {model.base_model} to be placed on",
        retry_after_s=5.0,
    )


def _rank_wait(session: Session, *, model: Model) -> ServingStatus | None:
    """The live workers of the model's base model load adapters of a smaller LoRA rank than
    its own (they were launched at the rank of the models they were for): it waits for a
    worker launched at its rank."""
    rank = ranks.model_lora_rank(model)
    limits = [
        ranks.worker_rank_limit(worker)
        for worker in session.scalars(
            select(Worker).where(
                Worker.base_model == model.base_model, Worker.status.in_(LIVE_WORKER_STATUSES)
            )
        )
    ]
    if not limits or any(limit is None or limit >= rank for limit in limits):
        return None
    return ServingStatus(
        state="waiting",
        message=f"the workers for {model.base_model} load LoRA ranks up to "
        f"{max(limit for limit in limits if limit is not None)} and this model's lora_rank is "
        f"{rank}: a worker for rank {rank} is launched for it (once max_workers allows)",
        retry_after_s=5.0,
    )


def _at_max_workers(session: Session, *, model: Model, max_workers: int) -> ServingStatus:
    """The model needs a worker of its own and the control plane runs as many as it may: an
    idle one is stopped to make room (``scale_in.make_room``), or it waits for one."""
    limit = f"the control plane runs the most workers it may (max_workers={max_workers})"
    stopping = session.scalar(
        select(Worker.id)
        .where(
            Worker.status == "draining",
            Worker.status_message.startswith(scale_in.MAKING_ROOM),
        )
        .limit(1)
    )
    if stopping is not None:
        return ServingStatus(
            state="waiting",
            message=f"{limit}: an idle worker is being stopped to make room, then a worker "
            f"for {model.base_model} can start",
            retry_after_s=10.0,
        )
    return ServingStatus(
        state="waiting",
        message=f"{limit}, and they have work: a worker for {model.base_model} starts once "
        "one of them has none left (its models unused for SKYTRAIN_MODEL_IDLE_TIMEOUT_S, "
        "their jobs ended) and is stopped to make room, or when the operator raises "
        "SKYTRAIN_MAX_WORKERS",
        retry_after_s=30.0,
    )


def job_waiting(
    session: Session, *, job: TrainingJob, limits: TenantLimits, max_workers: int | None = None
) -> str | None:
    """Why a queued job has not started (None when it is not queued): its model waits for a
    worker (the serving message), another job of the model runs first, or the worker holding
    the model is busy (it trains one job at a time, tenants taking turns)."""
    if job.status != "queued":
        return None
    model = session.get_one(Model, job.model_id)
    status = serving_status(session, model=model, step=0, limits=limits, max_workers=max_workers)
    if not status.ready:
        return status.message
    running = session.scalar(
        select(TrainingJob.id).where(
            TrainingJob.model_id == model.id, TrainingJob.status == "running"
        )
    )
    if running is not None:
        return f"training job {running} of this model runs first"
    return (
        f"waiting for worker {status.worker_id}, which trains one job at a time (tenants take "
        "turns)"
    )


def _retry_after_s(hold: placement.LaunchHold | None) -> float:
    """Until the next launch for a base model whose workers failed to start (30 s to 10 min:
    a retry cannot help sooner; after the limit, the operator's fix may come any time)."""
    if hold is None:
        return 30.0
    if hold.after is None:
        return 600.0
    return min(max((hold.after - utcnow()).total_seconds(), 30.0), 600.0)

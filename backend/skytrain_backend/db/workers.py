"""Worker rows: creation with a token, authentication, registration, heartbeats, listing.

A worker authenticates with its own token (``swt-...``), created when the scheduler asks a
provider for a worker, or handed out when a worker joins with an operator's join token
(``swj-...``, ``db.worker_tokens``). Only the token's sha256 is stored.
"""

from __future__ import annotations

import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

from sqlalchemy import and_, func, or_, select
from sqlalchemy.orm import Session

from skytrain_backend.db import credentials, worker_tokens
from skytrain_backend.db.credentials import hash_secret
from skytrain_backend.db.models import ServedStep, Worker, utcnow
from skytrain_backend.errors import AuthenticationFailed, InvalidRequest

WORKER_TOKEN_PREFIX = "swt-"
# "unreachable": registered, but the control plane cannot reach its front door (yet);
# "sleeping": its engine sleeps while a job trains on the GPU it shares.
LIVE_STATUSES = (
    "provisioning",
    "starting",
    "unreachable",
    "ready",
    "training",
    "sleeping",
    "draining",
)
ENDED_STATUSES = ("stopped", "lost", "failed")
# Statuses of workers that send heartbeats.
REGISTERED_STATUSES = ("starting", "unreachable", "ready", "training", "sleeping", "draining")


def create_worker(
    session: Session,
    *,
    provider: str,
    base_model: str,
    max_models: int,
    status: str = "provisioning",
    engine_secret: str | None = None,
    max_lora_rank: int | None = None,
) -> tuple[Worker, str]:
    """A new worker row and the token it will authenticate with (shown to nobody else);
    ``max_lora_rank``: the largest LoRA rank it is launched to load (None: any), until it
    registers its own."""
    token = credentials.new_secret(WORKER_TOKEN_PREFIX)
    worker = Worker(
        provider=provider,
        base_model=base_model,
        status=status,
        token_hash=hash_secret(token),
        engine_secret=engine_secret or secrets.token_urlsafe(24),
        capacity={"max_models": max_models}
        | ({} if max_lora_rank is None else {"max_lora_rank": max_lora_rank}),
        hardware={},
        served=[],
        status_message="launching" if status == "provisioning" else None,
        last_active_at=utcnow(),
    )
    session.add(worker)
    session.flush()
    return worker, token


def authenticate_worker(session: Session, *, token: str) -> Worker:
    worker = session.scalar(select(Worker).where(Worker.token_hash == hash_secret(token)))
    if worker is None:
        raise AuthenticationFailed(
            "unknown worker token: workers use the token they were started with "
            "(SKYTRAIN_WORKER_TOKEN), or join with `skytrain workers token create`"
        )
    if worker.status in ("stopped", "failed"):
        raise AuthenticationFailed(
            f"worker {worker.id} was {worker.status}: start a new worker to rejoin"
        )
    return worker


def check_base_model(worker: Worker, *, base_model: str) -> None:
    if base_model != worker.base_model:
        raise InvalidRequest(
            f"worker {worker.id} was started for {worker.base_model!r}, "
            f"but its engine serves {base_model!r}"
        )


# The worker routes a join token (swj-...) may call: joining, checking that it may join, and
# fetching what to install.
JOIN_TOKEN_PATHS = ("/worker/register", "/worker/check", "/worker/package")


def check_worker_token(session: Session, *, token: str, path: str) -> None:
    """Whether ``token`` may call the worker route at ``path``, before its body is read: a
    live worker's token anywhere, a valid join token on ``/v1/worker/register`` and
    ``/v1/worker/check`` (whose scope the route checks against the base model) and
    ``/v1/worker/package`` (the wheel a joining worker installs). Raises
    AuthenticationFailed saying why not."""
    if path.endswith(JOIN_TOKEN_PATHS) and worker_tokens.is_join_token(token):
        worker_tokens.live_join_token(session, token=token)
    else:
        authenticate_worker(session, token=token)


def register(
    session: Session,
    *,
    worker: Worker,
    base_model: str,
    served_model_name: str,
    engine_endpoint: str,
    engine_secret: str,
    engine_certificate: str,
    capacity: dict[str, Any],
    hardware: dict[str, Any],
    unreachable: str | None,
) -> Worker:
    """Record what a (re)starting worker reports about itself; it serves nothing yet.

    ``unreachable`` is why the control plane could not reach the worker at
    ``engine_endpoint`` (None: it did); such a worker is not routed to until it is reached.
    """
    check_base_model(worker, base_model=base_model)
    now = utcnow()
    worker.served_model_name = served_model_name
    worker.engine_endpoint = engine_endpoint
    worker.engine_secret = engine_secret
    worker.engine_certificate = engine_certificate
    worker.capacity = capacity
    worker.hardware = hardware
    worker.status = "ready" if unreachable is None else "unreachable"
    worker.status_message = unreachable
    worker.served = []
    worker.last_heartbeat_at = now
    worker.last_active_at = now
    session.commit()
    return worker


def heartbeat(
    session: Session,
    *,
    worker: Worker,
    status: str,
    served: Sequence[ServedStep],
    unreachable: str | None = None,
    stats: dict[str, float] | None = None,
) -> Worker:
    """Record a heartbeat; ``unreachable`` (why the front door was not reached) keeps an
    unreachable worker so, with the reason, instead of taking the status it reports.
    ``stats`` (the engine's batch and KV use, GPU memory) replace the last reported, kept in
    ``hardware["stats"]`` for the metrics (observability.collector)."""
    worker.last_heartbeat_at = utcnow()
    if stats is not None:
        worker.hardware = {**(worker.hardware or {}), "stats": stats}
    if worker.status == "unreachable" and unreachable is not None:
        worker.status_message = unreachable
    elif worker.status != "draining":
        if worker.status == "unreachable":
            worker.status_message = None
        worker.status = status
    worker.served = [ServedStep(model_id=s["model_id"], step=s["step"]) for s in served]
    session.commit()
    return worker


def silent_workers(session: Session, *, timeout_s: float) -> list[Worker]:
    """Registered workers that have not sent a heartbeat for ``timeout_s``."""
    cutoff = utcnow() - timedelta(seconds=timeout_s)
    return list(
        session.scalars(
            select(Worker).where(
                Worker.status.in_(REGISTERED_STATUSES),
                Worker.last_heartbeat_at.is_not(None),
                Worker.last_heartbeat_at < cutoff,
            )
        )
    )


def list_workers(session: Session, *, include_ended: bool = False) -> list[Worker]:
    """Live workers, and each base model's last worker if it failed to start (why no worker
    runs for it); every worker with ``include_ended``."""
    statement = select(Worker).order_by(Worker.created_at, Worker.id)
    if not include_ended:
        newest = (
            select(Worker.base_model, func.max(Worker.created_at).label("created_at"))
            .group_by(Worker.base_model)
            .subquery()
        )
        failed_last = (
            select(Worker.id)
            .join(
                newest,
                and_(
                    Worker.base_model == newest.c.base_model,
                    Worker.created_at == newest.c.created_at,
                ),
            )
            .where(Worker.status == "failed")
        )
        statement = statement.where(
            or_(Worker.status.in_(LIVE_STATUSES), Worker.id.in_(failed_last))
        )
    return list(session.scalars(statement))

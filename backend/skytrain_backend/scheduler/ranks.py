"""LoRA ranks in use: which a model has, which a worker loads, which a new worker is given.

Workers are planned and started at the rank in use, not at the largest a worker may load
(``SKYTRAIN_ENGINE_MAX_LORA_RANK``, 64): vLLM's LoRA slots and the trainer's state grow with
the rank, and on an L4 a 7B's training rows are 1,792 tokens at rank 64 against 6,656 at the
default 8.

- A model's rank is its config's ``lora_rank`` (``model_lora_rank``); model creation plans
  at it (``placement.check_fits_a_gpu``).
- A worker launched for a base model by a provider that chooses GPUs (where the control
  plane plans) is given the largest rank among the models that wait for it
  (``launch_lora_rank``): it is planned at that rank, and its engine loads adapters of
  up to that rank (vLLM's ``--max-lora-rank``), which it registers.
- A model is placed only on a worker that loads its rank (``worker_rank_limit``); one above
  every live worker's limit waits for a worker launched at its rank.
- A rank that no worker would load is refused at creation and at job submission
  (``check_lora_rank``).
"""

from __future__ import annotations

from collections.abc import Iterable

from sqlalchemy import select
from sqlalchemy.orm import Session

from skytrain_backend.db import workers as worker_rows
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import ModelConfig


def model_lora_rank(model: Model) -> int:
    """The LoRA rank of ``model``'s adapters."""
    return ModelConfig.model_validate(model.config or {}).lora_rank


def worker_rank_limit(worker: Worker) -> int | None:
    """The largest LoRA rank the worker's engine loads: as it registered it, or as it was
    launched with (None: any)."""
    limit = (worker.capacity or {}).get("max_lora_rank")
    return None if limit is None else int(limit)


def launch_lora_rank(models: Iterable[Model], *, largest: int) -> int:
    """The rank a worker launched for ``models`` (the active ones of its base model that no
    live worker holds) is planned and started at: the largest of theirs, at most
    ``largest``; ``largest`` when there are none."""
    return min(max((model_lora_rank(model) for model in models), default=largest), largest)


def check_lora_rank(
    session: Session, *, base_model: str, lora_rank: int, default_limit: int, launches: bool
) -> None:
    """Refuse a LoRA rank that no worker for ``base_model`` would load (InvalidRequest).

    The limit is the largest that a live registered worker for the base model reported; at
    least ``default_limit`` (``SKYTRAIN_ENGINE_MAX_LORA_RANK``: the largest a worker this
    control plane starts is given) when the control plane ``launches`` workers (a worker
    launched at a smaller rank does not bound the next one) or none is registered.
    """
    workers = session.scalars(
        select(Worker).where(
            Worker.base_model == base_model, Worker.status.in_(worker_rows.REGISTERED_STATUSES)
        )
    ).all()
    limits = [worker_rank_limit(worker) for worker in workers]
    if any(limit is None for limit in limits):
        return
    known = max((limit for limit in limits if limit is not None), default=None)
    by_workers = known is not None and (not launches or known >= default_limit)
    largest = known if by_workers and known is not None else default_limit
    if lora_rank <= largest:
        return
    whose = (
        f"the largest the workers serving {base_model} load"
        if by_workers
        else "the largest a worker loads (SKYTRAIN_ENGINE_MAX_LORA_RANK)"
    )
    raise InvalidRequest(
        f"lora_rank {lora_rank} is above {largest}, {whose}: choose a lora_rank of at most "
        f"{largest}, or have the operator raise SKYTRAIN_ENGINE_MAX_LORA_RANK and start "
        "workers with it"
    )

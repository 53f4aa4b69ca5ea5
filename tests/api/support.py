"""Payloads shaped like ART's client sends them, and a snapshot of what a tenant has stored."""

from __future__ import annotations

from typing import Any

import httpx
from sqlalchemy import select
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import (
    Checkpoint,
    Model,
    TrainingJob,
    TrainingJobEvent,
    TrajectoryBatch,
)
from skytrain_backend.storage import ObjectStore, keys


def choice(text: str = "4", token_ids: tuple[int, ...] = (19, 20)) -> dict[str, Any]:
    """An OpenAI Choice as ART dumps it, sampled with logprobs and token ids."""
    return {
        "finish_reason": "stop",
        "index": 0,
        "logprobs": {
            "content": [
                {"token": f"token_id:{t}", "bytes": None, "logprob": -0.5, "top_logprobs": []}
                for t in token_ids
            ],
            "refusal": None,
        },
        "message": {
            "content": text,
            "refusal": None,
            "role": "assistant",
            "annotations": None,
            "audio": None,
            "function_call": None,
            "tool_calls": None,
        },
    }


def trajectory(reward: float = 1.0, **metrics: float) -> dict[str, Any]:
    return {
        "messages_and_choices": [
            {"role": "system", "content": "Answer with a number."},
            {"role": "user", "content": "2+2?"},
            choice(),
        ],
        "tools": None,
        "additional_histories": [],
        "reward": reward,
        "initial_policy_version": None,  # ART's: the step it was sampled at (None: unsaid)
        "metrics": metrics,
        "metadata": {"scenario": 1},
        "logs": [],
        "start_time": "2026-01-01T00:00:00",
        "end_time": "2026-01-01T00:00:01",
    }


def group(*rewards: float, **metrics: float) -> dict[str, Any]:
    return {
        "trajectories": [trajectory(reward, **metrics) for reward in rewards or (1.0, 0.0)],
        "exceptions": [],
        "metadata": {},
        "metrics": {},
        "logs": [],
    }


def sft_trajectory(answer: str = "4") -> dict[str, Any]:
    return {
        "messages_and_choices": [
            {"role": "user", "content": "2+2?"},
            {"role": "assistant", "content": answer},
        ],
        "reward": 0.0,
    }


def snapshot(
    sessions: sessionmaker[Session], store: ObjectStore, tenant_id: str
) -> tuple[list[tuple[Any, ...]], list[tuple[str, int]]]:
    """Every row the tenant owns (with its mutable fields) and every object under its prefix."""
    with sessions() as session:
        rows: list[tuple[Any, ...]] = []
        owned = select(Model.id).where(Model.tenant_id == tenant_id)
        rows += session.execute(
            select(Model.id, Model.entity, Model.project, Model.name, Model.config).where(
                Model.tenant_id == tenant_id
            )
        ).all()
        rows += session.execute(
            select(Checkpoint.id, Checkpoint.step, Checkpoint.metrics, Checkpoint.deleted_at).where(
                Checkpoint.model_id.in_(owned)
            )
        ).all()
        rows += session.execute(
            select(TrajectoryBatch.id, TrajectoryBatch.step).where(
                TrajectoryBatch.model_id.in_(owned)
            )
        ).all()
        jobs = select(TrainingJob.id).where(TrainingJob.model_id.in_(owned))
        rows += session.execute(
            select(TrainingJob.id, TrainingJob.status, TrainingJob.cancel_requested).where(
                TrainingJob.model_id.in_(owned)
            )
        ).all()
        rows += session.execute(
            select(TrainingJobEvent.id).where(TrainingJobEvent.job_id.in_(jobs))
        ).all()
    objects = [(info.key, info.size) for info in store.list(keys.tenant_prefix(tenant_id))]
    return sorted(rows, key=repr), objects


def queued_job_events(http: httpx.Client, *, project: str = "tests") -> str:
    """The events path of a job that stays queued (no workers): a long-poll on it waits. A
    new model of ``project`` (named ``agent``) on a base model no worker serves."""
    model = http.post(
        "/v1/models", json={"project": project, "name": "agent", "base_model": "tiny/llama"}
    )
    assert model.status_code == 201, model.text
    job = http.post(
        "/v1/training-jobs",
        json={"model_id": model.json()["id"], "trajectory_groups": [group(1.0, 0.0)]},
    )
    assert job.status_code == 201, job.text
    return f"/v1/training-jobs/{job.json()['id']}/events"


def add_checkpoint(
    sessions: sessionmaker[Session],
    store: ObjectStore,
    *,
    tenant_id: str,
    model_id: str,
    step: int,
    files: dict[str, bytes],
    metrics: dict[str, float] | None = None,
) -> None:
    """Commit a checkpoint the way a worker does: files first, then the row (its metrics
    ``{"train/reward": 0.5}`` unless given)."""
    for name, data in files.items():
        store.put_bytes(
            keys.checkpoint_key(tenant_id=tenant_id, model_id=model_id, step=step, file=name), data
        )
    prefix = keys.checkpoint_prefix(tenant_id=tenant_id, model_id=model_id, step=step)
    with sessions() as session:
        session.add(
            Checkpoint(
                model_id=model_id,
                step=step,
                uri=store.uri(prefix.rstrip("/")),
                metrics={"train/reward": 0.5} if metrics is None else metrics,
                size_bytes=sum(len(data) for data in files.values()),
            )
        )
        session.commit()

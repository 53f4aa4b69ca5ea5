"""The series Prometheus reads from the database when it scrapes: what every control plane on
the database sees alike, so any of them may be scraped (or all: the values agree).

- ``skytrain_training_jobs{status}``: jobs queued or running now (a gauge goes up and down:
  jobs that ended are counted by ``skytrain_training_jobs_ended_total``);
  ``skytrain_training_queue_depth`` and ``skytrain_training_queue_oldest_wait_seconds``: the
  queue;
- ``skytrain_workers{status,provider}``: live workers by status (ended ones are in
  ``skytrain workers list --all``, not here); ``skytrain_models_placed``: models on a worker now;
- from each live worker's last heartbeat: ``skytrain_worker_engine_running_requests``,
  ``skytrain_worker_engine_kv_cache_usage_ratio``, ``skytrain_worker_gpu_memory_used_bytes``
  and ``..._total_bytes``, labelled by worker id only (live workers are few, at most the
  operator's ``max_workers``, and the series of a worker that ended goes with it; its base
  model is a string a tenant chose, so never a label).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily
from prometheus_client.registry import Collector
from sqlalchemy import func, select
from sqlalchemy.orm import Session

from skytrain_backend.db.models import Model, ModelReplica, TrainingJob, Worker, utcnow
from skytrain_backend.db.workers import LIVE_STATUSES

logger = logging.getLogger(__name__)

# The statuses a job is in until it ends: the gauge's (ended jobs only grow: a counter's).
ACTIVE_JOB_STATUSES = ("queued", "running")
# What a heartbeat's ``stats`` may carry, and the gauge each goes to.
WORKER_STATS = {
    "running_requests": (
        "skytrain_worker_engine_running_requests",
        "Requests the worker's engine is generating for now (its batch).",
    ),
    "kv_cache_usage": (
        "skytrain_worker_engine_kv_cache_usage_ratio",
        "Share of the engine's KV cache in use (0-1; vLLM only).",
    ),
    "gpu_memory_used_bytes": (
        "skytrain_worker_gpu_memory_used_bytes",
        "GPU memory in use on the worker, all its GPUs together.",
    ),
    "gpu_memory_total_bytes": (
        "skytrain_worker_gpu_memory_total_bytes",
        "GPU memory of the worker, all its GPUs together.",
    ),
}


class DatabaseCollector(Collector):
    """Reads the series above in one short session per scrape."""

    def __init__(self, sessions: Callable[[], Session]) -> None:
        self._sessions = sessions

    def describe(self) -> list[Any]:
        return []  # read at scrape time only: registering must not query the database

    def collect(self) -> Iterator[GaugeMetricFamily]:
        try:
            with self._sessions() as session:
                families = _families(session)
        except Exception:
            logger.exception("metrics: reading the database failed")
            families = []
        up = GaugeMetricFamily(
            "skytrain_metrics_database_up",
            "1 when this scrape read the database's series, 0 when reading them failed.",
            value=1 if families else 0,
        )
        yield from families
        yield up


def _families(session: Session) -> list[GaugeMetricFamily]:
    jobs = GaugeMetricFamily(
        "skytrain_training_jobs", "Training jobs, by status.", labels=["status"]
    )
    counts: dict[str, int] = {
        status: count
        for status, count in session.execute(
            select(TrainingJob.status, func.count())
            .where(TrainingJob.status.in_(ACTIVE_JOB_STATUSES))
            .group_by(TrainingJob.status)
        )
    }
    for status in ACTIVE_JOB_STATUSES:
        jobs.add_metric([status], counts.get(status, 0))
    oldest = session.scalar(
        select(func.min(TrainingJob.created_at)).where(TrainingJob.status == "queued")
    )
    depth = GaugeMetricFamily(
        "skytrain_training_queue_depth",
        "Training jobs queued, waiting for a worker.",
        value=counts.get("queued", 0),
    )
    wait = GaugeMetricFamily(
        "skytrain_training_queue_oldest_wait_seconds",
        "How long the oldest queued training job has waited (0 when none waits).",
        value=0 if oldest is None else max(0.0, (utcnow() - oldest).total_seconds()),
    )
    workers = GaugeMetricFamily(
        "skytrain_workers", "Workers, by status and provider.", labels=["status", "provider"]
    )
    for status, provider, count in session.execute(
        select(Worker.status, Worker.provider, func.count())
        .where(Worker.status.in_(LIVE_STATUSES))
        .group_by(Worker.status, Worker.provider)
    ):
        workers.add_metric([status, provider], count)
    placed = GaugeMetricFamily(
        "skytrain_models_placed",
        "Models placed on a worker now (their adapters served there).",
        value=session.scalar(select(func.count(Model.id)).where(Model.worker_id.is_not(None))) or 0,
    )
    replicas = GaugeMetricFamily(
        "skytrain_model_replicas",
        "Replicas of models on workers besides their homes, by status (serving, draining).",
        labels=["status"],
    )
    for status, count in session.execute(
        select(ModelReplica.status, func.count()).group_by(ModelReplica.status)
    ):
        replicas.add_metric([status], count)
    stats = {
        key: GaugeMetricFamily(name, text, labels=["worker_id"])
        for key, (name, text) in WORKER_STATS.items()
    }
    live = session.execute(
        select(Worker.id, Worker.hardware).where(Worker.status.in_(LIVE_STATUSES))
    )
    for worker_id, hardware in live:
        reported = (hardware or {}).get("stats") or {}
        for key, family in stats.items():
            value = reported.get(key)
            if isinstance(value, int | float) and not isinstance(value, bool):
                family.add_metric([worker_id], float(value))
    return [jobs, depth, wait, workers, placed, replicas, *stats.values()]

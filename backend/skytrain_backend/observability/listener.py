"""The metrics listener: Prometheus' text format at ``/metrics`` on a port of its own
(``SKYTRAIN_METRICS_PORT`` on ``SKYTRAIN_METRICS_HOST``, 127.0.0.1 by default), never on the
public port.

With ``PROMETHEUS_MULTIPROC_DIR`` set (uvicorn with several worker processes), every process
writes its values to files in that directory and the listener adds them up; without it, the
listener serves this process's own registry. The database's series (``collector``) come from
one small engine of the listener's own.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable
from dataclasses import dataclass
from wsgiref.simple_server import WSGIServer

from prometheus_client import REGISTRY, CollectorRegistry, start_http_server
from prometheus_client.metrics_core import Metric
from prometheus_client.multiprocess import MultiProcessCollector, mark_process_dead
from prometheus_client.registry import Collector
from sqlalchemy import Engine

from skytrain_backend.config import Settings
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.observability.collector import DatabaseCollector


@dataclass
class MetricsListener:
    server: WSGIServer
    thread: threading.Thread
    engine: Engine

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
        self.thread.join(timeout=5)
        self.engine.dispose()


def registry_for(settings: Settings) -> CollectorRegistry:
    """Where the listener reads the counted series: this process's, or every process's."""
    if settings.observability.prometheus_multiproc_dir is None:
        return REGISTRY
    registry = CollectorRegistry()
    MultiProcessCollector(registry, path=str(settings.observability.prometheus_multiproc_dir))
    return registry


def process_ended(settings: Settings) -> None:
    """With ``PROMETHEUS_MULTIPROC_DIR``: this process's live gauges leave the sums (its
    counters stay counted)."""
    if settings.observability.prometheus_multiproc_dir is not None:
        mark_process_dead(os.getpid(), str(settings.observability.prometheus_multiproc_dir))


def start_metrics_listener(settings: Settings) -> MetricsListener | None:
    """Serve ``/metrics`` on the metrics port in a thread; None when the port is unset (0)."""
    if not settings.observability.metrics_port:
        return None
    engine = create_db_engine(
        settings.storage.resolved_database_url, pool_size=1, max_connections=2
    )
    registry = registry_for(settings)
    collector = DatabaseCollector(session_factory(engine))
    if registry is REGISTRY:
        # One registry per process: a second listener (tests) gets a registry of its own.
        registry = CollectorRegistry()
        registry.register(_Forward())
    registry.register(collector)
    server, thread = start_http_server(
        settings.observability.metrics_port,
        addr=settings.observability.metrics_host,
        registry=registry,
    )
    return MetricsListener(server=server, thread=thread, engine=engine)


class _Forward(Collector):
    """This process's default registry, read through another one."""

    def collect(self) -> Iterable[Metric]:
        return REGISTRY.collect()

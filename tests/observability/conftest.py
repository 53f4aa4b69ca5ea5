"""The metrics listener beside the session's real control plane (``control_plane``)."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest

from skytrain_backend.observability.listener import MetricsListener, start_metrics_listener
from tests.fixtures.ports import free_port
from tests.fixtures.services import ControlPlane


@pytest.fixture(scope="module")
def listener(control_plane: ControlPlane) -> Iterator[MetricsListener]:
    """What `skytrain serve` starts with SKYTRAIN_METRICS_PORT set, on the same settings."""
    settings = control_plane.settings
    observability = settings.observability.model_copy(update={"metrics_port": free_port()})
    settings = settings.model_copy(update={"observability": observability})
    started = start_metrics_listener(settings)
    assert started is not None
    yield started
    started.close()


def scrape(listener: MetricsListener) -> str:
    response = httpx.get(f"http://127.0.0.1:{listener.port}/metrics", timeout=10)
    assert response.status_code == 200
    return response.text


def value(text: str, series: str) -> float:
    """The value of one exact series line (``name{labels}``), 0 when absent."""
    for line in text.splitlines():
        if line.startswith(series + " "):
            return float(line.rsplit(" ", 1)[1])
    return 0.0

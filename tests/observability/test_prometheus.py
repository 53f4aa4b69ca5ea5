"""infra/ against the real thing: Debian's Prometheus server, with infra/prometheus's scrape
config pointed at the metrics listener of the session's control plane, scrapes it and answers
a query for a skytrain_ series; every query of the Grafana board names series skytrain
exports."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import time
from pathlib import Path

import httpx
import pytest
import yaml
from prometheus_client import REGISTRY

from skytrain_backend.observability.collector import DatabaseCollector
from skytrain_backend.observability.listener import MetricsListener
from tests.fixtures.services import ControlPlane
from tests.observability.conftest import free_port

INFRA = Path(__file__).resolve().parents[2] / "infra"
BOARD = INFRA / "grafana" / "dashboards" / "skytrain.json"
SCRAPE_WAIT_S = 60
_SUFFIXES = ("_bucket", "_sum", "_count", "_total", "_created")


def _exported_names(db_sessions: object) -> set[str]:
    """Every series name skytrain exports: the counted families (a histogram's _bucket, _sum
    and _count) and the database's."""
    names = set()
    families = [*REGISTRY.collect(), *DatabaseCollector(db_sessions).collect()]  # type: ignore[arg-type]
    for family in families:
        if family.name.startswith("skytrain_"):
            names.add(family.name)
            names.update(family.name + suffix for suffix in _SUFFIXES)
    return names


def test_every_grafana_query_names_series_skytrain_exports(db_sessions: object) -> None:
    board = json.loads(BOARD.read_text())
    exprs = [target["expr"] for panel in board["panels"] for target in panel.get("targets", [])]
    assert len(exprs) >= 20
    exported = _exported_names(db_sessions)
    named = {name for expr in exprs for name in re.findall(r"\bskytrain_[a-z0-9_]+", expr)}
    assert named and not named - exported, sorted(named - exported)
    # Every area the issue names has a panel.
    for family in ("http_requests", "gateway_", "training_", "worker", "db_query", "object_store"):
        assert any(family in name for name in named), family


@pytest.mark.slow
def test_prometheus_scrapes_the_listener_with_the_infra_config(
    tmp_path: Path, control_plane: ControlPlane, listener: MetricsListener
) -> None:
    binary = shutil.which("prometheus")
    assert binary, "no prometheus on PATH: scripts/setup.sh installs Debian's package"
    httpx.get(f"{control_plane.url}/health")  # at least one request counted
    config = yaml.safe_load((INFRA / "prometheus" / "prometheus.yml").read_text())
    config["global"]["scrape_interval"] = "1s"
    config["scrape_configs"][0]["static_configs"][0]["targets"] = [f"127.0.0.1:{listener.port}"]
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(tmp_path / "prometheus.log", "wb") as log_file:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={tmp_path / 'prometheus.yml'}",
                f"--storage.tsdb.path={tmp_path / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=subprocess.DEVNULL,
            stderr=log_file,
        )
    try:
        query = 'skytrain_http_requests_total{route="/health"}'
        deadline = time.monotonic() + SCRAPE_WAIT_S
        result: list[dict[str, object]] = []
        while not result and time.monotonic() < deadline:
            time.sleep(0.5)
            try:
                answer = httpx.get(
                    f"http://127.0.0.1:{port}/api/v1/query", params={"query": query}, timeout=5
                )
            except httpx.TransportError:
                continue
            if answer.status_code == 200:
                result = answer.json()["data"]["result"]
        log = (tmp_path / "prometheus.log").read_text(errors="replace")[-2000:]
        assert result, f"Prometheus never had {query}:\n{log}"
        assert result[0]["metric"]["job"] == "skytrain"
        assert result[0]["metric"]["deployment"] == "compose"
        targets = httpx.get(f"http://127.0.0.1:{port}/api/v1/targets", timeout=5).json()
        (target,) = targets["data"]["activeTargets"]
        assert target["health"] == "up"
    finally:
        process.terminate()
        process.wait(timeout=30)

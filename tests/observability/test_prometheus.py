"""infra/ against the real thing: Debian's Prometheus server, with infra/prometheus's scrape
config pointed at the metrics listener of the session's control plane, scrapes it and answers
a query for a skytrain_ series; every query of the Grafana board names series skytrain
exports, and the board imports into any Grafana (tests/e2e/test_observability.py runs each of
its queries in Prometheus after a real workload)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import httpx
import pytest
from prometheus_client import REGISTRY

from skytrain_backend.observability.collector import DatabaseCollector
from skytrain_backend.observability.listener import MetricsListener
from tests.fixtures.prometheus import BOARD, board_expressions, prometheus_scraping
from tests.fixtures.services import ControlPlane

_SUFFIXES = ("_bucket", "_sum", "_count", "_total")


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
    exprs = [expr for _, expr in board_expressions()]
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
    httpx.get(f"{control_plane.url}/health")  # at least one request counted
    with prometheus_scraping(f"127.0.0.1:{listener.port}", tmp_path) as prometheus:
        result = prometheus.wait_for('skytrain_http_requests_total{route="/health"}')
        assert result[0]["metric"]["job"] == "skytrain"
        assert result[0]["metric"]["deployment"] == "compose"
        targets = httpx.get(f"{prometheus.url}/api/v1/targets", timeout=5).json()
        (target,) = targets["data"]["activeTargets"]
        assert target["health"] == "up"


def test_the_board_imports_into_any_grafana_and_keeps_one_unit_per_axis() -> None:
    """Issue 36: the board named its datasource by a uid only this compose file provisions,
    and one panel plotted a count and seconds on one axis."""
    board = json.loads(BOARD.read_text())
    (variable,) = [v for v in board["templating"]["list"] if v["type"] == "datasource"]
    assert variable["query"] == "prometheus"
    uids = re.findall(r'"uid":\s*"([^"]*)"', BOARD.read_text())
    assert uids and set(uids) - {board["uid"]} == {"${" + variable["name"] + "}"}
    for panel in board["panels"]:
        exprs = [target["expr"] for target in panel.get("targets", [])]
        units = {panel.get("fieldConfig", {}).get("defaults", {}).get("unit")}
        overridden = {
            prop["value"]
            for override in panel.get("fieldConfig", {}).get("overrides", [])
            for prop in override["properties"]
            if prop["id"] == "unit"
        }
        seconds = [e for e in exprs if "_seconds" in e and "histogram_quantile" not in e]
        counts = [e for e in exprs if "_seconds" not in e]
        if seconds and counts:  # both kinds in one panel: each on an axis of its own unit
            assert "s" in overridden or "s" in units, panel["title"]
            assert overridden - units, panel["title"]

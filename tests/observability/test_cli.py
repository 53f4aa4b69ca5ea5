"""`skytrain models list|show|delete` and `skytrain status` on the session's database, through
Typer's runner (the commands read the settings from the environment, as a user's shell)."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import get_settings
from skytrain_backend.scheduler.leader import open_leadership
from tests.fixtures.services import ApiKey, ControlPlane, MakeSettings


def _model(control_plane: ControlPlane, key: ApiKey, name: str) -> dict[str, Any]:
    response = httpx.post(
        f"{control_plane.url}/v1/models",
        headers=key.headers,
        json={"project": "cli", "name": name, "base_model": "tiny/llama"},
    )
    assert response.status_code == 201, response.text
    return dict(response.json())


def test_models_list_shows_every_tenants_models_and_filters_by_tenant(
    control_plane_cli: Callable[..., str],
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
) -> None:
    alice, bob = api_key(), api_key()
    mine, theirs = _model(control_plane, alice, "a"), _model(control_plane, bob, "b")
    listed = control_plane_cli("models", "list")
    assert mine["id"] in listed and theirs["id"] in listed
    assert alice.tenant_name in listed and bob.tenant_name in listed
    only = control_plane_cli("models", "list", "--tenant", alice.tenant_name)
    assert mine["id"] in only and theirs["id"] not in only


def test_models_show_and_delete_by_name(
    control_plane_cli: Callable[..., str],
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
) -> None:
    key = api_key()
    model = _model(control_plane, key, f"m{uuid.uuid4().hex[:6]}")
    shown = control_plane_cli("models", "show", model["inference_name"])
    assert model["id"] in shown and key.tenant_name in shown and "tiny/llama" in shown
    assert "Deleted model" in control_plane_cli("models", "delete", model["id"], "--yes")
    gone = httpx.get(
        f"{control_plane.url}/v1/models/{model['id']}", headers=key.headers, timeout=60
    )
    assert gone.status_code == 404
    assert "no model" in control_plane_cli("models", "show", model["id"], code=1)


def test_status_shows_the_control_plane_workers_queue_and_errors(
    control_plane_cli: Callable[..., str],
) -> None:
    shown = control_plane_cli("status")
    for part in ("control plane", "workers", "queue:", "running jobs", "last errors"):
        assert part in shown


@pytest.mark.postgres
def test_status_names_the_leading_control_plane_on_postgresql(
    make_settings: MakeSettings, monkeypatch: pytest.MonkeyPatch
) -> None:
    url = make_settings(database="postgres").storage.resolved_database_url
    # Another deployment in another schema of the same database, with its own leader.
    elsewhere = make_settings(database="postgres").storage.resolved_database_url
    monkeypatch.setenv("SKYTRAIN_DATABASE_URL", url)
    get_settings.cache_clear()
    leader, follower = open_leadership(url), open_leadership(url)
    other = open_leadership(elsewhere)
    try:
        assert leader.hold() and not follower.hold() and other.hold()
        result = CliRunner().invoke(app, ["status"])
    finally:
        for leadership in (other, follower, leader):
            leadership.release()
        get_settings.cache_clear()
    assert result.exit_code == 0, result.output
    # Only this schema's two: other deployments' schedulers (the other schema's here, other
    # tests' in the suite) are not listed.
    assert result.output.count("leader") == 1 and result.output.count("follower") == 1

"""`skytrain jobs show ID [--follow]`, `--json` on the list and show commands, and sizes in
human units (issue 36: no command followed a job, none but `workers plan` printed JSON, and
checkpoint sizes printed as `225027 B`)."""

from __future__ import annotations

import json
import threading
import uuid
from collections.abc import Callable
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.cli._common import _human_size
from skytrain_backend.db import api_keys, jobs
from skytrain_backend.db.models import Model, ModelReplica, TrainingJob, utcnow
from tests.fixtures.callers import Caller
from tests.fixtures.cli import run_cli
from tests.fixtures.rows import add_ready_worker, add_rl_job
from tests.fixtures.services import (
    ApiKey,
    ControlPlane,
    MakeSettings,
    database_sessions,
    serve_in_thread,
)
from tests.gateway.conftest import wait_until


@pytest.fixture
def queued_job(caller: Caller, db_sessions: sessionmaker[Session]) -> tuple[dict[str, Any], str]:
    """A model made through the API and a queued job of it (as the API adds one)."""
    model = caller.create_model("shown", project="cli")
    with db_sessions() as session:
        job = add_rl_job(session, model["id"])
        jobs.add_event(session, job_id=job.id, type="training_started", data={"steps": 1})
        session.commit()
        return model, job.id


def test_jobs_show_prints_the_job_and_its_events_and_json(
    control_plane_cli: Callable[..., str], queued_job: tuple[dict[str, Any], str]
) -> None:
    model, job_id = queued_job
    shown = control_plane_cli("jobs", "show", job_id)
    assert f"job         {job_id}" in shown and "status      queued" in shown
    assert model["id"] in shown and "training_started" in shown
    as_json = json.loads(control_plane_cli("jobs", "show", job_id, "--json"))
    assert as_json["job"] == job_id and as_json["status"] == "queued"
    assert [event["type"] for event in as_json["events"]] == ["training_started"]
    assert "no training job 'nope'" in control_plane_cli("jobs", "show", "nope", code=1)


def test_jobs_show_follow_prints_new_events_until_the_job_ends(
    control_plane_cli: Callable[..., str],
    queued_job: tuple[dict[str, Any], str],
    db_sessions: sessionmaker[Session],
) -> None:
    _, job_id = queued_job

    def cancel() -> None:
        with db_sessions() as session:
            jobs.cancel_job(session, job=session.get_one(TrainingJob, job_id))

    later = threading.Timer(1.5, cancel)
    later.start()
    try:
        followed = control_plane_cli("jobs", "show", job_id, "--follow")
    finally:
        later.join()
    assert followed.index("training_started") < followed.index("training_failed")
    assert followed.rstrip().endswith("the job ended: cancelled")


def test_list_and_show_commands_print_json(
    control_plane_cli: Callable[..., str], queued_job: tuple[dict[str, Any], str]
) -> None:
    model, job_id = queued_job
    listed = json.loads(control_plane_cli("jobs", "list", "--json", "--limit", "100"))
    (row,) = [row for row in listed if row["id"] == job_id]
    assert row["status"] == "queued" and row["model"].endswith("/cli/shown")
    models = json.loads(control_plane_cli("models", "list", "--json"))
    assert model["id"] in {row["id"] for row in models}
    shown = json.loads(control_plane_cli("models", "show", model["id"], "--json"))
    assert shown["model"] == model["id"] and shown["base_model"] == "tiny/llama"
    assert [job["id"] for job in shown["training_jobs"]] == [job_id]
    assert isinstance(json.loads(control_plane_cli("workers", "list", "--all", "--json")), list)
    status = json.loads(control_plane_cli("status", "--json"))
    assert status["queue"]["queued"] >= 1 and status["queue"]["oldest_wait_s"] >= 0
    assert {"workers", "running_jobs", "last_errors", "control_planes"} <= set(status)
    assert all(set(row) == {"when", "what", "error"} for row in status["last_errors"])


@pytest.mark.parametrize(
    ("size", "shown"),
    [(0, "0 B"), (1023, "1023 B"), (1536, "1.5 KiB"), (225027, "220 KiB"), (3 * 2**30, "3.0 GiB")],
)
def test_sizes_read_in_human_units(size: int, shown: str) -> None:
    assert _human_size(size) == shown


@pytest.mark.parametrize(
    ("message", "cell"),
    [
        (
            "exited with code 1; the last lines of /home/w.log:\n"
            "╭──── Traceback ────╮\n│ main.py:3 in run │\n╰───────────────────╯\n"
            "OSError: [Errno 28] No space left on device\n",
            "OSError: [Errno 28] No space left on device",
        ),
        (
            "exited with code 1; the last lines of /home/w.log:\n"
            '{"level": "error", "message": "the worker stopped: boom", '
            '"exception": "Traceback (most recent call last):\\nOSError: boom"}',
            "OSError: boom",
        ),
        ("draining: scale-in", "draining: scale-in"),
        (None, ""),
    ],
)
def test_status_shows_the_line_of_a_workers_message_that_names_the_error(
    message: str | None, cell: str
) -> None:
    """Issue 36: `skytrain status`'s "last errors" cell showed the log's path and then `│`."""
    from skytrain_backend.cli.status import _error_cell

    assert _error_cell(message) == cell


def test_keys_create_refuses_a_new_tenant_named_as_another_tenants_entity(
    control_plane_cli: Callable[..., str],
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
) -> None:
    # A tenant's name is its entity: a tenant created under a name another tenant's models
    # use took those names over.
    owner = api_key()
    entity = f"team-{owner.tenant_id[:8]}"
    with httpx.Client(base_url=control_plane.url, headers=owner.headers, timeout=60) as http:
        body = {"entity": entity, "project": "p", "name": "m0", "base_model": "m"}
        assert http.post("/v1/models", json=body).status_code == 201
    output = control_plane_cli("keys", "create", "--tenant", entity, code=1)
    assert f"tenant name {entity!r} is taken" in output
    assert owner.tenant_name in output
    assert entity not in control_plane_cli("tenants", "list")


def test_models_replicas_sets_the_bounds_and_show_prints_the_events(
    control_plane_cli: Callable[..., str], queued_job: tuple[dict[str, Any], str]
) -> None:
    """Issue 35: the operator sets a model's replicas; `models show` says what the scheduler
    decided about them and why."""
    model, _ = queued_job
    said = control_plane_cli("models", "replicas", model["id"], "--min", "1", "--max", "2")
    assert "min_replicas=1 max_replicas=2" in said
    shown = json.loads(control_plane_cli("models", "show", model["id"], "--json"))
    assert shown["config"]["max_replicas"] == 2
    (event,) = shown["replica_events"]
    assert event["event"] == "replicas_set" and "max_replicas=2" in event["reason"]
    assert "replica events" in control_plane_cli("models", "show", model["id"])
    refused = control_plane_cli("models", "replicas", model["id"], "--max", "3", code=1)
    assert "max_workers=2" in refused


def test_models_show_prints_the_replicas_and_the_demand_per_replica(
    make_settings: MakeSettings,
) -> None:
    """Issue 35: `models show` printed a model's replicas and events, but not the demand the
    scheduler scales them by (that lived in the leader's memory). Each scheduling pass now
    writes it on the model's row. A control plane of its own (a short replica window, no
    scale-out), its scheduler counting requests in flight on the model as its gateway does
    for each request it sends; the model's home and replica are worker rows."""
    settings = make_settings(
        scheduler={
            "replica_window_s": 0.5,
            "replica_scale_out_in_flight": 100.0,
            "replica_cooldown_s": 0.0,
        }
    )
    app = create_app(settings)
    with database_sessions(settings) as sessions, serve_in_thread(app) as url:
        with sessions() as session:
            _, key = api_keys.create_key(session, tenant_name=f"demand-{uuid.uuid4().hex[:6]}")
        response = httpx.post(
            f"{url}/v1/models",
            headers={"Authorization": f"Bearer {key}"},
            json={"project": "cli", "name": "busy", "base_model": "tiny/demand"},
        )
        assert response.status_code == 201, response.text
        model_id = response.json()["id"]
        with sessions() as session:
            home, replica = (add_ready_worker(session, base_model="tiny/demand") for _ in "12")
            row = session.get_one(Model, model_id)
            row.worker_id, row.last_active_at = home.id, utcnow()
            row.config = {**row.config, "max_replicas": 2}
            session.add(ModelReplica(model_id=model_id, worker_id=replica.id))
            session.commit()
        # Three requests in flight on the model: 1.5 per replica once the window is past.
        ends = [app.state.scheduler.demand.begin(model_id, home.id) for _ in range(3)]

        def written() -> float | None:
            with sessions() as session:
                return session.get_one(Model, model_id).demand_per_replica

        wait_until(lambda: written() == 1.5, what="the scheduler's reading on the model")
        shown = run_cli(settings, "models", "show", model_id)
        assert shown.exit_code == 0, shown.output
        assert "demand per replica: 1.5 requests in flight per replica" in shown.output
        as_json = json.loads(run_cli(settings, "models", "show", model_id, "--json").output)
        assert as_json["demand_per_replica"] == 1.5
        assert {(r["worker"], r["role"]) for r in as_json["replicas"]} == {
            (home.id, "home"),
            (replica.id, "replica"),
        }
        for end in ends:
            end()
        wait_until(lambda: written() == 0.0, what="the demand gone with its requests")
        assert (
            "demand per replica: 0 requests" in run_cli(settings, "models", "show", model_id).output
        )

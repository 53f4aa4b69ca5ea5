"""``skytrain models list|show|delete``: every tenant's models, for the operator (a tenant
sees only its own through the API and the dashboard)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from skytrain_backend.cli._common import (
    JSON_OPTION,
    _ago,
    _fail,
    _human_size,
    _output,
    _print_json,
    _rows,
    _session,
    command_group,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

    from skytrain_backend.db.models import Model

models_app = command_group("models", "See and delete the models of every tenant.")

MODEL_ARGUMENT = typer.Argument(..., help="The model's id, or its entity/project/name.")


def _find(session: Session, ref: str) -> Model:
    """The model ``ref`` names: an id, or entity/project/name (unique across tenants)."""
    from sqlalchemy import select

    from skytrain_backend.db.models import Model

    parts = ref.split("/")
    if len(parts) == 3:
        entity, project, name = parts
        found = session.scalars(
            select(Model).where(
                Model.entity == entity, Model.project == project, Model.name == name
            )
        ).first()
    else:
        found = session.get(Model, ref)
    if found is None:
        raise _fail(f"no model {ref!r}: see `skytrain models list`")
    return found


@models_app.command("list")
def models_list(
    tenant: str | None = typer.Option(None, help="Only this tenant's models (its name)."),
    limit: int = typer.Option(100, min=1, max=100_000, help="Most recent models to show."),
    json_: bool = JSON_OPTION,
) -> None:
    """List models, newest first: id, tenant, name, base model, latest step, the worker it is
    placed on, last activity."""
    from sqlalchemy import select

    from skytrain_backend.db import registry
    from skytrain_backend.db.models import Model, Tenant

    with _session() as session:
        statement = (
            select(Model, Tenant.name)
            .join(Tenant, Tenant.id == Model.tenant_id)
            .order_by(Model.created_at.desc())
            .limit(limit)
        )
        if tenant is not None:
            statement = statement.where(Tenant.name == tenant)
        found = [(model, owner) for model, owner in session.execute(statement)]
        steps = registry.latest_steps(session, model_ids=[model.id for model, _ in found])
        rows = [
            [
                model.id,
                owner,
                f"{model.entity}/{model.project}/{model.name}",
                model.base_model,
                str(steps.get(model.id, 0)),
                model.worker_id or "-",
                _ago(model.last_active_at),
            ]
            for model, owner in found
        ]
    columns = ["id", "tenant", "name", "base model", "step", "worker", "active"]
    _output("models", columns, rows, as_json=json_)


@models_app.command("show")
def models_show(model: str = MODEL_ARGUMENT, json_: bool = JSON_OPTION) -> None:
    """Show a model: owner, base model, config, where it is served, its checkpoints, its
    latest training jobs, its replicas with the demand per replica, and the replica events."""
    import json

    from sqlalchemy import select

    from skytrain_backend.db.models import Checkpoint, Tenant, TrainingJob
    from skytrain_backend.scheduler import replicas

    with _session() as session:
        row = _find(session, model)
        owner = session.get_one(Tenant, row.tenant_id).name
        fields = {
            "model": row.id,
            "name": f"{row.entity}/{row.project}/{row.name}",
            "tenant": owner,
            "base model": row.base_model,
            "worker": row.worker_id or "- (not placed)",
            "created": _ago(row.created_at),
            "last active": _ago(row.last_active_at),
        }
        checkpoints = [
            [str(c.step), _human_size(c.size_bytes), _ago(c.created_at)]
            for c in session.scalars(
                select(Checkpoint)
                .where(Checkpoint.model_id == row.id, Checkpoint.deleted_at.is_(None))
                .order_by(Checkpoint.step.desc())
                .limit(20)
            )
        ]
        jobs = [
            [
                job.id,
                job.status,
                "-" if job.result_step is None else str(job.result_step),
                _ago(job.created_at),
                (job.error or "")[:80],
            ]
            for job in session.scalars(
                select(TrainingJob)
                .where(TrainingJob.model_id == row.id)
                .order_by(TrainingJob.created_at.desc())
                .limit(10)
            )
        ]
        config = row.config or {}
        demand = row.demand_per_replica
        replica_rows = [
            [item.worker_id, item.role, item.status]
            for item in replicas.placed_on(session, model=row)
        ]
        events = [
            [_ago(event.created_at), event.kind, str(event.replicas), event.reason]
            for event in replicas.events(session, model_id=row.id, limit=20)
        ]
    checkpoint_columns = ["step", "size", "created"]
    job_columns = ["id", "status", "step", "created", "error"]
    replica_columns = ["worker", "role", "status"]
    event_columns = ["when", "event", "replicas", "reason"]
    if json_:
        _print_json(
            {
                **{key.replace(" ", "_"): value for key, value in fields.items()},
                "demand_per_replica": demand,
                "config": config,
                "checkpoints": _rows(checkpoint_columns, checkpoints),
                "training_jobs": _rows(job_columns, jobs),
                "replicas": _rows(replica_columns, replica_rows),
                "replica_events": _rows(event_columns, events),
            }
        )
        return
    for key, value in fields.items():
        typer.echo(f"{key:<12} {value}")
    typer.echo(f"{'config':<12} {json.dumps(config, sort_keys=True)}")
    _output("checkpoints", checkpoint_columns, checkpoints, as_json=False)
    _output("training jobs", job_columns, jobs, as_json=False)
    _output("replicas", replica_columns, replica_rows, as_json=False)
    said = "-" if demand is None else f"{demand:g} requests in flight per replica"
    typer.echo(f"demand per replica: {said} (the scheduler's last pass, over its window)")
    _output("replica events (newest first)", event_columns, events, as_json=False)


@models_app.command("replicas")
def models_replicas(
    model: str = MODEL_ARGUMENT,
    min_replicas: int | None = typer.Option(
        None, "--min", min=1, max=64, help="Workers serving it at least."
    ),
    max_replicas: int | None = typer.Option(
        None,
        "--max",
        min=1,
        max=64,
        help="Workers serving it at most (<= its tenant's max_workers).",
    ),
) -> None:
    """Set how many workers may serve a model (as its tenant can with PATCH /v1/models/{id});
    the scheduler follows demand between the two."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants
    from skytrain_backend.db.models import Tenant
    from skytrain_backend.errors import InvalidRequest
    from skytrain_backend.scheduler import replicas

    if min_replicas is None and max_replicas is None:
        raise _fail("give --min, --max or both")
    with _session() as session:
        row = _find(session, model)
        limits = tenants.limits_of(session.get_one(Tenant, row.tenant_id), get_settings())
        try:
            config = replicas.set_bounds(
                session,
                model=row,
                min_replicas=min_replicas,
                max_replicas=max_replicas,
                limits=limits,
            )
        except InvalidRequest as exc:
            raise _fail(str(exc)) from None
    typer.echo(f"min_replicas={config.min_replicas} max_replicas={config.max_replicas}")


@models_app.command("delete")
def models_delete(
    model: str = MODEL_ARGUMENT,
    yes: bool = typer.Option(False, "--yes", "-y", help="Do not ask for confirmation."),
) -> None:
    """Delete a model with its checkpoints, logs and jobs: its objects first, then its rows
    (a failed delete can be run again). Refused while one of its jobs runs."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import registry
    from skytrain_backend.storage import keys, open_object_store

    settings = get_settings()
    with _session() as session:
        row = _find(session, model)
        name = f"{row.entity}/{row.project}/{row.name}"
        if not yes:
            typer.confirm(f"Delete model {row.id} ({name}) and all its checkpoints?", abort=True)
        registry.check_deletable(session, model=row)
        store = open_object_store(settings.storage.resolved_object_store_url, settings)
        store.delete_prefix(keys.model_prefix(tenant_id=row.tenant_id, model_id=row.id))
        registry.delete_model_rows(session, model=row)
    typer.echo(f"Deleted model {row.id} ({name}).")

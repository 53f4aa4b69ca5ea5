"""``skytrain status``: the deployment on one screen, read from the database every control
plane shares: the control planes and which one leads (runs the scheduler), the workers, the
queue, the running jobs and the last errors."""

from __future__ import annotations

from typing import TYPE_CHECKING

import typer

from skytrain_backend.cli._common import (
    JSON_OPTION,
    _ago,
    _print_json,
    _rows,
    _session,
    _table,
    _worker_cells,
    app,
)

if TYPE_CHECKING:
    from sqlalchemy.orm import Session

LAST_ERRORS = 5
PLANE_COLUMNS = ["process", "address", "since", "role"]
WORKER_COLUMNS = ["id", "provider", "status", "base model", "models", "heartbeat"]
RUNNING_COLUMNS = ["id", "model", "worker", "attempt", "leased"]
ERROR_COLUMNS = ["when", "what", "error"]
# What a boxed (rich) traceback draws around its lines.
_BOX = " \t│┃╭╮╰╯─━┌┐└┘|"


def _error_cell(message: str | None, limit: int = 160) -> str:
    """The line of a status message that says what went wrong: its last line with words (a
    worker's message ends in its log's tail, whose last line is the error, in a box or a JSON
    line), after the message's first line when that is all there is."""
    import json

    lines = (message or "").splitlines()
    for line in reversed(lines[1:]):
        text = line.strip(_BOX)
        if text.startswith("{"):
            try:
                entry = json.loads(text)
            except ValueError:
                entry = None
            if isinstance(entry, dict):
                exception = str(entry.get("exception") or "").strip().splitlines()
                text = exception[-1] if exception else str(entry.get("message", ""))
        if any(character.isalnum() for character in text):
            return text[:limit]
    return (lines[0] if lines else "")[:limit]


@app.command()
def status(as_json: bool = JSON_OPTION) -> None:
    """Show the control planes (and the leader), live workers, the queue, running jobs and
    the last errors (failed jobs, workers that failed or were lost). ``--json``: one object
    of those sections, each a list of rows (the queue a count and the oldest job's wait)."""
    from sqlalchemy import func, select

    from skytrain_backend.db import workers
    from skytrain_backend.db.models import Model, TrainingJob, Worker, utcnow

    with _session() as session:
        planes = _control_planes(session)
        live = [
            [*_worker_cells(session, row), _ago(row.last_heartbeat_at)]
            for row in workers.list_workers(session, include_ended=False)
        ]
        queued, oldest = session.execute(
            select(func.count(TrainingJob.id), func.min(TrainingJob.created_at)).where(
                TrainingJob.status == "queued"
            )
        ).one()
        oldest_s = None if oldest is None else int((utcnow() - oldest).total_seconds())
        running = [
            [
                job.id,
                f"{model.entity}/{model.project}/{model.name}",
                job.worker_id or "-",
                str(job.attempts),
                _ago(job.leased_at),
            ]
            for job, model in session.execute(
                select(TrainingJob, Model)
                .join(Model, Model.id == TrainingJob.model_id)
                .where(TrainingJob.status == "running")
                .order_by(TrainingJob.leased_at)
            )
        ]
        errors = [
            [_ago(job.created_at), f"job {job.id}", (job.error or "")[:160]]
            for job in session.scalars(
                select(TrainingJob)
                .where(TrainingJob.status == "failed")
                .order_by(TrainingJob.created_at.desc())
                .limit(LAST_ERRORS)
            )
        ]
        errors += [
            [_ago(row.stopped_at or row.last_heartbeat_at), f"worker {row.id} {row.status}",
             _error_cell(row.status_message)]
            for row in session.scalars(
                select(Worker)
                .where(Worker.status.in_(("failed", "lost")))
                .order_by(Worker.created_at.desc())
                .limit(LAST_ERRORS)
            )
        ]  # fmt: skip
    sections = {
        "workers": (WORKER_COLUMNS, live),
        "running jobs": (RUNNING_COLUMNS, running),
        "last errors": (ERROR_COLUMNS, errors),
    }
    if as_json:
        _print_json(
            {
                "control_planes": None if planes is None else _rows(PLANE_COLUMNS, planes),
                "queue": {"queued": queued, "oldest_wait_s": oldest_s},
                **{name.replace(" ", "_"): _rows(*section) for name, section in sections.items()},
            }
        )
        return
    if planes is None:
        typer.echo("control plane: embedded (SQLite): the one process on this database leads")
    else:
        _table("control planes", PLANE_COLUMNS, planes)
    _table("workers", *sections["workers"])
    wait = "" if oldest_s is None else f", the oldest for {oldest_s}s"
    typer.echo(f"\nqueue: {queued} training job(s) waiting{wait}")
    _table("running jobs", *sections["running jobs"])
    _table("last errors", *sections["last errors"])


def _control_planes(session: Session) -> list[list[str]] | None:
    """The processes that run a scheduler on this deployment's schema, and the one holding its
    lock (the leader); None when the database is SQLite (one embedded process). Each names its
    lock connection with the schema's tag, so deployments in other schemas of the same
    database are left out."""
    from sqlalchemy import text

    from skytrain_backend.scheduler.leader import APPLICATION_NAME_PREFIX, lock_key, schema_tag

    if session.get_bind().dialect.name != "postgresql":
        return None
    key = lock_key(str(session.scalar(text("SELECT current_schema()"))))
    unsigned = key % 2**64
    prefix = f"{APPLICATION_NAME_PREFIX} {schema_tag(key)} "
    found = session.execute(
        text(
            "SELECT a.application_name, a.client_addr, a.backend_start, l.pid IS NOT NULL "
            "FROM pg_stat_activity a LEFT JOIN pg_locks l ON l.pid = a.pid "
            "AND l.locktype = 'advisory' AND l.granted "
            "AND l.classid = :high AND l.objid = :low "
            "WHERE a.application_name LIKE :prefix AND a.datname = current_database() "
            "ORDER BY a.backend_start"
        ),
        {
            "high": unsigned >> 32,
            "low": unsigned & 0xFFFFFFFF,
            "prefix": prefix + "%",
        },
    )
    return [
        [
            name.removeprefix(prefix),
            str(address or "local"),
            _ago(since) if since else "-",
            "leader" if leads else "follower",
        ]
        for name, address, since, leads in found
    ]

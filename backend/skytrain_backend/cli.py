"""The ``skytrain`` command line.

Every command imports what it needs inside its function, so ``skytrain --help`` and the
control plane's commands never load torch.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING

import typer

from skytrain_backend import __version__
from skytrain_backend.engine.cli import engine_app

if TYPE_CHECKING:
    from types import FrameType

    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

app = typer.Typer(
    name="skytrain",
    help="skytrain: a self-hosted backend that trains LLM agents with reinforcement learning.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
)


def _print_version(value: bool) -> None:
    if value:
        typer.echo(f"skytrain {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: bool = typer.Option(
        False, "--version", callback=_print_version, is_eager=True, help="Print the version."
    ),
) -> None:
    """skytrain: a self-hosted backend that trains LLM agents with reinforcement learning."""


# --- control plane: serve, keys, db ----------------------------------------------------------

keys_app = typer.Typer(help="Create, list and revoke API keys.", no_args_is_help=True)
db_app = typer.Typer(
    help="Upgrade, downgrade or inspect the database schema.", no_args_is_help=True
)
app.add_typer(keys_app, name="keys")
app.add_typer(db_app, name="db")


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=1)


def _engine() -> Engine:
    from skytrain_backend.config import get_settings
    from skytrain_backend.db.session import create_db_engine

    return create_db_engine(get_settings().resolved_database_url)


@contextlib.contextmanager
def _session() -> Iterator[Session]:
    """A session on a schema that is current (upgraded first where auto-migration is on)."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import migrations
    from skytrain_backend.db.session import session_factory
    from skytrain_backend.errors import SkytrainError

    engine = _engine()
    try:
        migrations.prepare_schema(engine, auto_migrate=get_settings().should_auto_migrate)
        with session_factory(engine)() as session:
            yield session
    except SkytrainError as exc:
        raise _fail(exc.message) from None
    finally:
        engine.dispose()


@app.command()
def serve(
    host: str | None = typer.Option(None, help="Address to listen on. [default: SKYTRAIN_HOST]"),
    port: int | None = typer.Option(None, help="Port to listen on. [default: SKYTRAIN_PORT]"),
) -> None:
    """Run the control plane: the REST API under /v1 and the web dashboard at /, with the
    database and object store of the settings."""
    import uvicorn
    from sqlalchemy.engine import make_url

    from skytrain_backend.app import create_app
    from skytrain_backend.config import get_settings

    overrides = {key: value for key, value in (("host", host), ("port", port)) if value}
    settings = get_settings().model_copy(update=overrides)
    with _session():  # refuse to start on an outdated schema, with the fix in the message
        pass
    database = make_url(settings.resolved_database_url).render_as_string(hide_password=True)
    store = settings.resolved_object_store_url
    if settings.s3_endpoint_url and store.startswith("s3://"):
        store += f" (endpoint {settings.s3_endpoint_url})"
    typer.echo(f"skytrain {__version__} listening on http://{settings.host}:{settings.port}")
    typer.echo(f"  database:     {database}")
    typer.echo(f"  object store: {store}")
    typer.echo(f"  dashboard:    http://{settings.host}:{settings.port}/ (sign in with an API key)")
    _log_to_stderr()  # the scheduler's decisions (leadership, launches, placements) show
    application = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # Uvicorn waits for the requests in flight before the app's shutdown: end the
            # long-polls (workers' lease requests wait up to 30 s) now.
            notifier = getattr(application.state, "notifier", None)
            if notifier is not None:
                notifier.close_threadsafe()

    Server(uvicorn.Config(application, host=settings.host, port=settings.port)).run()


def _log_to_stderr() -> None:
    """skytrain's own log lines (INFO and up) on stderr, with a time and the logger's name."""
    import logging

    logging.basicConfig(
        level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Option(..., help="Tenant the key acts for; created if new."),
    name: str | None = typer.Option(None, help="A label to recognise the key by."),
    tinker: bool = typer.Option(
        False,
        "--tinker",
        help="Print it in the tinker SDK's form ('tml-' + the key, for TINKER_API_KEY); the "
        "same key works both ways.",
    ),
) -> None:
    """Create an API key and print it (the key alone on stdout). It is shown only once."""
    from skytrain_backend.api.deps import TINKER_KEY_PREFIX
    from skytrain_backend.db import keys
    from skytrain_backend.errors import SkytrainError

    with _session() as session:
        try:
            row, key = keys.create_key(session, tenant_name=tenant, name=name)
        except SkytrainError as exc:
            raise _fail(exc.message) from None
    typer.echo(f"Created key {row.id} ({row.prefix}...) for tenant {tenant!r}.", err=True)
    typer.echo("Store it now: it is not shown again.", err=True)
    typer.echo(TINKER_KEY_PREFIX + key if tinker else key)


def _when(moment: datetime | None, default: str = "") -> str:
    """A time as the list commands show it (UTC, to the minute)."""
    return f"{moment:%Y-%m-%d %H:%M}" if moment else default


def _columns(rows: Sequence[Sequence[str]]) -> None:
    """Plain aligned columns: readable in a terminal, greppable in a pipe, never wrapped, so
    ids stay whole to copy into `revoke`."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        typer.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


@keys_app.command("list")
def keys_list(tenant: str | None = typer.Option(None, help="Only this tenant's keys.")) -> None:
    """List keys: id, prefix, tenant, label, created, last used, revoked (times in UTC)."""
    from skytrain_backend.db import keys

    rows = [("id", "prefix", "tenant", "name", "created", "last used", "revoked")]
    with _session() as session:
        for key, owner in keys.list_keys(session, tenant_name=tenant):
            rows.append(
                (
                    key.id,
                    f"{key.prefix}...",
                    owner.name,
                    key.name or "",
                    _when(key.created_at),
                    _when(key.last_used_at, "never"),
                    _when(key.revoked_at),
                )
            )
    _columns(rows)


@keys_app.command("revoke")
def keys_revoke(
    key: str = typer.Argument(..., help="The key's id or its prefix (sk-st-xxxxxx)."),
) -> None:
    """Revoke a key: requests with it get 401 from now on."""
    from skytrain_backend.db import keys
    from skytrain_backend.errors import SkytrainError

    with _session() as session:
        try:
            row = keys.revoke_key(session, id_or_prefix=key.removesuffix("..."))
        except SkytrainError as exc:
            raise _fail(exc.message) from None
    typer.echo(f"Revoked key {row.id} ({row.prefix}...).")


tenants_app = typer.Typer(
    help="See tenants and set their limits and quotas (defaults: SKYTRAIN_TENANT_*).",
    no_args_is_help=True,
)
app.add_typer(tenants_app, name="tenants")


@tenants_app.command("list")
def tenants_list() -> None:
    """List tenants: models owned and every limit in force ('*': set for this tenant)."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants

    names = tenants.TenantLimits.names()
    rows = [("tenant", "models", *names)]
    with _session() as session:
        for tenant, owned in tenants.list_tenants(session):
            limits = vars(tenants.limits_of(tenant, get_settings()))
            own = tenant.limits or {}
            rows.append(
                (
                    tenant.name,
                    str(owned),
                    *(f"{limits[name]}{'*' if name in own else ''}" for name in names),
                )
            )
    _columns(rows)


@tenants_app.command("limits")
def tenants_limits(
    tenant: str = typer.Argument(..., help="The tenant's name (see `skytrain tenants list`)."),
    max_concurrent_requests: int | None = typer.Option(
        None, min=1, help="Inference requests in flight at once."
    ),
    max_sequences_in_flight: int | None = typer.Option(
        None, min=1, help="Sequences being generated at once (n x prompts of each request)."
    ),
    max_tokens_in_flight: int | None = typer.Option(
        None, min=1, help="Tokens in flight at once (body bytes + n x max_tokens per request)."
    ),
    max_waiting_polls: int | None = typer.Option(
        None, min=1, help="Long-polls (jobs' events followed) waiting at once, per process."
    ),
    max_models: int | None = typer.Option(None, min=0, help="Models the tenant may own."),
    max_placed_models: int | None = typer.Option(
        None, min=0, help="Models placed on workers at once."
    ),
    max_workers: int | None = typer.Option(
        None, min=0, help="Workers the tenant's models may occupy at once."
    ),
    reset: list[str] = typer.Option(
        [], "--reset", help="A limit to return to its default (the setting); repeatable."
    ),
) -> None:
    """Set a tenant's limits and quotas, then print those in force.

    Limits not given stay as they are; a limit never set for the tenant follows its default
    setting (SKYTRAIN_TENANT_MAX_MODELS, ...). Over a quota, creating a model is a 403;
    models over the placement quotas wait, and their requests get 429 with Retry-After.
    """
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants
    from skytrain_backend.errors import SkytrainError

    given = {
        "max_concurrent_requests": max_concurrent_requests,
        "max_sequences_in_flight": max_sequences_in_flight,
        "max_tokens_in_flight": max_tokens_in_flight,
        "max_waiting_polls": max_waiting_polls,
        "max_models": max_models,
        "max_placed_models": max_placed_models,
        "max_workers": max_workers,
    }
    values = {name: value for name, value in given.items() if value is not None}
    with _session() as session:
        try:
            if values or reset:
                row = tenants.set_limits(
                    session,
                    tenant_name=tenant,
                    values=values,
                    reset=[r.replace("-", "_") for r in reset],
                )
            else:
                row = tenants.get_tenant_by_name(session, name=tenant)
        except SkytrainError as exc:
            raise _fail(exc.message) from None
        limits = vars(tenants.limits_of(row, get_settings()))
        own = row.limits or {}
    _columns(
        [("limit", "value", "set by")]
        + [
            (name, str(value), "this tenant" if name in own else "default")
            for name, value in limits.items()
        ]
    )


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Upgrade the schema of SKYTRAIN_DATABASE_URL (to the newest revision by default)."""
    from skytrain_backend.db import migrations

    engine = _engine()
    try:
        migrations.upgrade(engine, revision)
        typer.echo(
            f"database at revision {', '.join(sorted(migrations.current_revisions(engine)))}"
        )
    finally:
        engine.dispose()


@db_app.command("downgrade")
def db_downgrade(
    revision: str = typer.Argument(..., help="Target revision: an id, -1 for one step, or base."),
) -> None:
    """Downgrade the schema (base drops every skytrain table and its data)."""
    from skytrain_backend.db import migrations

    engine = _engine()
    try:
        migrations.downgrade(engine, revision)
        current = migrations.current_revisions(engine)
        typer.echo(f"database at revision {', '.join(sorted(current)) or 'base (empty)'}")
    finally:
        engine.dispose()


@db_app.command("current")
def db_current() -> None:
    """Show the schema's revision and whether `skytrain db upgrade` is needed."""
    from skytrain_backend.db import migrations

    engine = _engine()
    try:
        current, heads = migrations.current_revisions(engine), migrations.head_revisions()
    finally:
        engine.dispose()
    shown = ", ".join(sorted(current)) or "base (empty)"
    state = "up to date" if current == heads else "outdated: run `skytrain db upgrade`"
    typer.echo(f"{shown} ({state}; newest is {', '.join(sorted(heads))})")


app.add_typer(engine_app, name="engine")


# --- workers and jobs: worker, workers list, jobs list, logs ---------------------------------

workers_app = typer.Typer(
    help="See the workers and manage their join tokens.", no_args_is_help=True
)
jobs_app = typer.Typer(help="See training jobs.", no_args_is_help=True)
app.add_typer(workers_app, name="workers")
app.add_typer(jobs_app, name="jobs")


def _ago(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    from skytrain_backend.db.models import utcnow

    seconds = int((utcnow() - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _table(title: str, columns: list[str], rows: list[list[str]]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, title_justify="left")
    for column in columns:
        table.add_column(column, overflow="fold")
    for row in rows:
        table.add_row(*row)
    # Piped into another program, ids must come out whole rather than folded to 80 columns.
    Console(width=None if sys.stdout.isatty() else 240).print(table)


@app.command()
def worker(
    control_plane: str | None = typer.Option(
        None, help="URL of the control plane. [default: SKYTRAIN_CONTROL_PLANE_URL]"
    ),
    token: str | None = typer.Option(
        None, help="Worker token to register with. [default: SKYTRAIN_WORKER_TOKEN]"
    ),
    base_model: str | None = typer.Option(
        None, help="Base model the engine serves. [default: SKYTRAIN_WORKER_BASE_MODEL]"
    ),
    engine: str | None = typer.Option(
        None, help="auto (vLLM with CUDA), vllm or hf. [default: SKYTRAIN_ENGINE]"
    ),
    host: str | None = typer.Option(
        None,
        help="Address the worker's front door (HTTPS, engine secret) listens on. "
        "[default: SKYTRAIN_WORKER_HOST, 0.0.0.0]",
    ),
    port: int | None = typer.Option(
        None,
        help="Port of the worker's front door; 0: a free one. [default: SKYTRAIN_WORKER_PORT, 8100]",
    ),
    advertise_url: str | None = typer.Option(
        None,
        help="The front door's URL as the control plane reaches it (https://HOST:PORT). "
        "[default: the address the worker's registration comes from, on --port]",
    ),
    device: str | None = typer.Option(None, help="Trainer device (cuda, cpu). [default: auto]"),
) -> None:
    """Run a worker: start the inference engine (on 127.0.0.1) and the front door the control
    plane reaches it through, join the control plane, serve and train."""
    import asyncio

    from skytrain_backend.config import get_settings
    from skytrain_backend.errors import SkytrainError
    from skytrain_backend.worker.main import WorkerConfig, run_worker

    _log_to_stderr()
    settings = get_settings()
    try:
        config = WorkerConfig.from_settings(
            settings,
            control_plane_url=control_plane,
            token=token,
            base_model=base_model,
            engine=engine,
            host=host,
            port=port,
            advertise_url=advertise_url,
            device=device,
        )
        asyncio.run(run_worker(config, settings))
    except SkytrainError as exc:
        raise _fail(exc.message) from None


@workers_app.command("list")
def workers_list(
    all_: bool = typer.Option(False, "--all", help="Include stopped, lost and failed workers."),
) -> None:
    """List workers: status, base model, models placed, the address the control plane
    reaches them at, last heartbeat."""
    from sqlalchemy import func, select

    from skytrain_backend.db import workers
    from skytrain_backend.db.models import Model

    with _session() as session:
        rows = []
        for row in workers.list_workers(session, include_ended=all_):
            placed = session.scalar(select(func.count(Model.id)).where(Model.worker_id == row.id))
            rows.append(
                [
                    row.id,
                    row.provider,
                    row.status,
                    row.base_model,
                    str(placed),
                    row.engine_endpoint or "",
                    _ago(row.last_heartbeat_at),
                    row.status_message or "",
                ]
            )
    _table(
        "workers",
        ["id", "provider", "status", "base model", "models", "address", "heartbeat", "message"],
        rows,
    )


token_app = typer.Typer(
    help="Join tokens for workers started by hand (`sky launch sky/worker.yaml`).",
    no_args_is_help=True,
)
workers_app.add_typer(token_app, name="token")


@token_app.command("create")
def workers_token_create(
    name: str | None = typer.Option(None, help="A label to recognise the token by."),
    base_model: str | None = typer.Option(
        None, help="Only workers serving this base model may join with it. [default: any]"
    ),
) -> None:
    """Create a join token and print it (the token alone on stdout). It is shown only once."""
    from skytrain_backend.db import worker_tokens
    from skytrain_backend.errors import SkytrainError

    with _session() as session:
        try:
            row, token = worker_tokens.create_join_token(session, name=name, base_model=base_model)
        except SkytrainError as exc:
            raise _fail(exc.message) from None
    scope = f"workers for {base_model!r}" if base_model else "workers of any base model"
    typer.echo(f"Created join token {row.id} ({row.prefix}...) for {scope}.", err=True)
    typer.echo("Store it now: it is not shown again.", err=True)
    typer.echo(token)


@token_app.command("list")
def workers_token_list() -> None:
    """List join tokens: id, prefix, label, base model scope, created, last used, revoked (UTC)."""
    from skytrain_backend.db import worker_tokens

    rows = [("id", "prefix", "name", "base model", "created", "last used", "revoked")]
    with _session() as session:
        rows.extend(
            (
                row.id,
                f"{row.prefix}...",
                row.name or "",
                row.base_model or "any",
                _when(row.created_at),
                _when(row.last_used_at, "never"),
                _when(row.revoked_at),
            )
            for row in worker_tokens.list_join_tokens(session)
        )
    _columns(rows)


@token_app.command("revoke")
def workers_token_revoke(
    token: str = typer.Argument(..., help="The token's id or its prefix (swj-xxxxxx)."),
) -> None:
    """Revoke a join token: no new worker joins with it (running workers keep their own)."""
    from skytrain_backend.db import worker_tokens
    from skytrain_backend.errors import SkytrainError

    with _session() as session:
        try:
            row = worker_tokens.revoke_join_token(session, id_or_prefix=token.removesuffix("..."))
        except SkytrainError as exc:
            raise _fail(exc.message) from None
    typer.echo(f"Revoked join token {row.id} ({row.prefix}...).")


@jobs_app.command("list")
def jobs_list(
    status: str | None = typer.Option(None, help="Only jobs in this status (queued, running...)."),
    limit: int = typer.Option(20, help="Most recent jobs to show."),
) -> None:
    """List the most recent training jobs of every tenant."""
    from sqlalchemy import select

    from skytrain_backend.db.models import Model, TrainingJob

    with _session() as session:
        statement = (
            select(TrainingJob, Model)
            .join(Model, Model.id == TrainingJob.model_id)
            .order_by(TrainingJob.created_at.desc())
            .limit(limit)
        )
        if status is not None:
            statement = statement.where(TrainingJob.status == status)
        rows = [
            [
                job.id,
                f"{model.entity}/{model.project}/{model.name}",
                job.kind,
                job.status,
                str(job.attempts),
                "-" if job.result_step is None else str(job.result_step),
                job.worker_id or "-",
                _ago(job.created_at),
                (job.error or "")[:80],
            ]
            for job, model in session.execute(statement)
        ]
    _table(
        "training jobs",
        ["id", "model", "kind", "status", "attempts", "step", "worker", "created", "error"],
        rows,
    )


@app.command()
def logs(
    worker_id: str = typer.Argument(..., help="The worker's id (see `skytrain workers list`)."),
    lines: int = typer.Option(100, "--lines", "-n", help="How many of the last lines to show."),
) -> None:
    """Show a worker's log: everything a local worker printed; a SkyPilot worker's launch."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db.models import Worker
    from skytrain_backend.provision.local import log_tail, worker_log_path

    with _session() as session:
        row = session.get(Worker, worker_id)
        if row is None:
            raise _fail(f"no worker {worker_id!r}: see `skytrain workers list --all`")
        provider, cluster = row.provider, row.cluster_name
    path = worker_log_path(get_settings().home / "workers", worker_id)
    text = log_tail(path, lines)
    if text:
        typer.echo(text)
    if provider == "skypilot" and cluster:
        typer.echo(f"(the worker's own output: `sky logs {cluster}`)", err=True)
    elif not text:
        where = "on its own host" if provider == "manual" else f"at {path}"
        raise _fail(f"no log for worker {worker_id} {where}")


@app.command()
def demo(
    steps: int = typer.Option(12, min=1, help="GRPO training steps."),
    groups_per_step: int = typer.Option(8, min=1, help="Training questions per step."),
    rollouts_per_group: int = typer.Option(
        4, min=2, help="Answers sampled per question (GRPO compares them)."
    ),
    learning_rate: float = typer.Option(5e-4, help="Learning rate of the LoRA update."),
    seed: int = typer.Option(
        0, help="Seed of the question order, of every sampled answer and of training."
    ),
    eval_questions: int = typer.Option(
        16, min=1, max=16, help="Held-out questions evaluated after each step."
    ),
    output_dir: Path | None = typer.Option(
        None, help="Where the plot and table go. [default: HOME/runs/<time>]"
    ),
    port: int | None = typer.Option(
        None, min=1, max=65535, help="Port of the embedded control plane. [default: a free one]"
    ),
    base_model: str = typer.Option(
        "HuggingFaceTB/SmolLM2-135M-Instruct", help="Any Hugging Face model id or local directory."
    ),
    home: Path = typer.Option(
        Path("~/.skytrain/demo"), help="The demo's database, objects and worker logs."
    ),
) -> None:
    """Train SmolLM2-135M-Instruct with GRPO here, then plot its reward per step.

    An embedded control plane and a local worker; the task: answer with one word. Prints a
    table, writes a PNG of the rewards, and stops everything at the end or on Ctrl-C.
    """
    import skytrain
    from skytrain_backend.config import get_settings
    from skytrain_backend.demo import DemoOptions, LoopOptions, run_demo
    from skytrain_backend.errors import SkytrainError

    if not learning_rate > 0:
        raise typer.BadParameter(f"{learning_rate} is not positive", param_hint="--learning-rate")
    options = DemoOptions(
        loop=LoopOptions(
            steps=steps,
            groups_per_step=groups_per_step,
            rollouts_per_group=rollouts_per_group,
            learning_rate=learning_rate,
            seed=seed,
            eval_questions=eval_questions,
        ),
        base_model=base_model,
        home=home.expanduser().resolve(),
        output_dir=output_dir.expanduser().resolve() if output_dir else None,
        port=port,
        model_cache_dir=get_settings().resolved_model_cache_dir,
    )
    try:
        run_demo(options)
    except KeyboardInterrupt:
        typer.echo("interrupted: the control plane and its workers are stopped", err=True)
        raise typer.Exit(code=130) from None
    except (SkytrainError, skytrain.SkytrainError) as exc:
        raise _fail(str(exc)) from None


def main() -> None:
    app()

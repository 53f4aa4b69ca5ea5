"""The control plane's commands: ``serve``, ``keys``, ``tenants``, ``db`` (and ``engine``)."""

from __future__ import annotations

import gc
from typing import TYPE_CHECKING

import typer

from skytrain_backend import __version__
from skytrain_backend.cli._common import (
    JSON_OPTION,
    _database,
    _fail,
    _interruptible,
    _log_to_stderr,
    _object_store,
    _output,
    _session,
    _when,
    app,
    command_group,
)
from skytrain_backend.engine.cli import engine_app

if TYPE_CHECKING:
    from types import FrameType

keys_app = command_group("keys", "Create, list and revoke API keys.")
db_app = command_group("db", "Upgrade, downgrade or inspect the database schema.")

# Allocations between two collections of the youngest generation (CPython's default: 700).
GC_YOUNG_THRESHOLD = 10_000


def freeze_startup_heap() -> None:
    """Take what startup made (the imported modules and the app: some 160,000 objects) out of
    the cyclic collector's scans, and collect the youngest generation less often.

    Under eight tenants' bursts the collector took most of the server's time
    (bench/README.md): each full collection walked that whole heap again, holding the event
    loop for up to a second on a busy machine, and young collections ran every 700
    allocations. Frozen objects are still freed by reference counting; only a cycle among
    them would never be collected, and what startup made lives as long as the process.
    """
    gc.collect()
    gc.freeze()
    gc.set_threshold(GC_YOUNG_THRESHOLD, 10, 10)


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
    from skytrain_backend.connections import ConnectionLimits, guarded_protocol
    from skytrain_backend.observability.listener import start_metrics_listener

    _interruptible()
    # First: in JSON mode every line from here on is one JSON object, this banner included.
    _log_to_stderr()
    settings = get_settings()
    overrides = {key: value for key, value in (("host", host), ("port", port)) if value}
    server = settings.server.model_copy(update=overrides)
    settings = settings.model_copy(update={"server": server})
    with _session():  # refuse to start on an outdated schema, with the fix in the message
        pass
    _object_store(settings)  # nor on a store it cannot use
    database = make_url(settings.storage.resolved_database_url).render_as_string(hide_password=True)
    store = settings.storage.resolved_object_store_url
    if settings.storage.s3_endpoint_url and store.startswith("s3://"):
        store += f" (endpoint {settings.storage.s3_endpoint_url})"
    typer.echo(
        f"skytrain {__version__} listening on http://{settings.server.host}:{settings.server.port}"
    )
    typer.echo(f"  database:     {database}")
    typer.echo(f"  object store: {store}")
    typer.echo(
        f"  dashboard:    http://{settings.server.host}:{settings.server.port}/ (sign in with an API key)"
    )
    metrics = (
        f"http://{settings.observability.metrics_host}:{settings.observability.metrics_port}/metrics"
        if settings.observability.metrics_port
        else "off (set SKYTRAIN_METRICS_PORT)"
    )
    typer.echo(f"  metrics:      {metrics}")
    limits = ConnectionLimits.from_settings(settings)
    typer.echo(
        f"  connections:  at most {limits.max_connections}, {limits.max_per_client} per client "
        f"address; headers within {limits.header_timeout_s:g} s"
    )
    application = create_app(settings)

    class Server(uvicorn.Server):
        def handle_exit(self, sig: int, frame: FrameType | None) -> None:
            super().handle_exit(sig, frame)
            # Uvicorn waits for the requests in flight before the app's shutdown: end the
            # long-polls (workers' lease requests wait up to 30 s) now.
            notifier = getattr(application.state, "notifier", None)
            if notifier is not None:
                notifier.close_threadsafe()

    # Its own listener, never the public port; the log lines are ours (access lines included,
    # with the request id), so uvicorn's own configuration and access log stay off.
    try:
        listener = start_metrics_listener(settings)
    except OSError as exc:
        raise _fail(
            f"the metrics listener cannot listen on {settings.observability.metrics_host}:"
            f"{settings.observability.metrics_port} ({exc.strerror}): set SKYTRAIN_METRICS_PORT to a free port"
        ) from None
    try:
        config = uvicorn.Config(
            application,
            host=settings.server.host,
            port=settings.server.port,
            # Connections counted and timed before a request is parsed (connections.py).
            http=guarded_protocol(limits),
            timeout_keep_alive=settings.server.keep_alive_s,
            log_config=None,
            access_log=False,
        )
        freeze_startup_heap()
        Server(config).run()
    finally:
        if listener is not None:
            listener.close()


@app.command("metrics-listener")
def metrics_listener() -> None:
    """Serve only the metrics listener (SKYTRAIN_METRICS_PORT): for the app run under several
    processes (uvicorn --workers, gunicorn) with PROMETHEUS_MULTIPROC_DIR, whose values it adds
    up. `skytrain serve` starts its own."""
    import threading

    from skytrain_backend.config import get_settings
    from skytrain_backend.observability.listener import start_metrics_listener

    settings = get_settings()
    if settings.observability.prometheus_multiproc_dir is None:
        raise _fail("set PROMETHEUS_MULTIPROC_DIR to the directory the server processes write")
    if not settings.observability.metrics_port:
        raise _fail("set SKYTRAIN_METRICS_PORT to the port to serve the metrics on")
    listener = start_metrics_listener(settings)
    assert listener is not None
    typer.echo(f"metrics on http://{settings.observability.metrics_host}:{listener.port}/metrics")
    try:
        threading.Event().wait()
    except KeyboardInterrupt:
        pass
    finally:
        listener.close()


@keys_app.command("create")
def keys_create(
    tenant: str = typer.Option(
        ...,
        help="Tenant the key acts for; created if new (not under a name another tenant's "
        "models use as their entity: a tenant's name is its default entity).",
    ),
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
    from skytrain_backend.db import api_keys as keys

    with _session() as session:
        row, key = keys.create_key(session, tenant_name=tenant, name=name)
    typer.echo(f"Created key {row.id} ({row.prefix}...) for tenant {tenant!r}.", err=True)
    typer.echo("Store it now: it is not shown again.", err=True)
    typer.echo(TINKER_KEY_PREFIX + key if tinker else key)


@keys_app.command("list")
def keys_list(
    tenant: str | None = typer.Option(None, help="Only this tenant's keys."),
    json_: bool = JSON_OPTION,
) -> None:
    """List keys: id, prefix, tenant, label, created, last used, revoked (times in UTC)."""
    from skytrain_backend.db import api_keys as keys

    columns = ["id", "prefix", "tenant", "name", "created", "last used", "revoked"]
    rows: list[list[str]] = []
    with _session() as session:
        for key, owner in keys.list_keys(session, tenant_name=tenant):
            rows.append(
                [
                    key.id,
                    f"{key.prefix}...",
                    owner.name,
                    key.name or "",
                    _when(key.created_at),
                    _when(key.last_used_at, "never"),
                    _when(key.revoked_at),
                ]
            )
    _output(None, columns, rows, as_json=json_)


@keys_app.command("revoke")
def keys_revoke(
    key: str = typer.Argument(..., help="The key's id or its prefix (sk-st-xxxxxx)."),
) -> None:
    """Revoke a key: requests with it get 401 from now on."""
    from skytrain_backend.db import api_keys as keys

    with _session() as session:
        row = keys.revoke_key(session, id_or_prefix=key.removesuffix("..."))
    typer.echo(f"Revoked key {row.id} ({row.prefix}...).")


tenants_app = command_group(
    "tenants", "See tenants and set their limits and quotas (defaults: SKYTRAIN_TENANT_*)."
)


@tenants_app.command("list")
def tenants_list(json_: bool = JSON_OPTION) -> None:
    """List tenants: models owned and every limit in force ('*': set for this tenant)."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants

    names = tenants.TenantLimits.names()
    columns = ["tenant", "models", *names]
    rows: list[list[str]] = []
    with _session() as session:
        for tenant, owned in tenants.list_tenants(session):
            limits = vars(tenants.limits_of(tenant, get_settings()))
            own = tenant.limits or {}
            rows.append(
                [
                    tenant.name,
                    str(owned),
                    *(f"{limits[name]}{'*' if name in own else ''}" for name in names),
                ]
            )
    _output(None, columns, rows, as_json=json_)


@tenants_app.command("limits")
def tenants_limits(
    tenant: str = typer.Argument(..., help="The tenant's name (see `skytrain tenants list`)."),
    max_concurrent_requests: int | None = typer.Option(
        None, min=1, help="Inference requests in flight at once."
    ),
    max_concurrent_rest_requests: int | None = typer.Option(
        None,
        min=1,
        help="REST requests in flight at once (everything but inference; long-polls count "
        "while they wait).",
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
    max_storage_bytes: int | None = typer.Option(
        None,
        min=0,
        help="Bytes the tenant may hold: checkpoints, trajectory batches, Tinker sessions' "
        "metadata and queued operations' payloads.",
    ),
    max_metadata_bytes: int | None = typer.Option(
        None, min=0, help="Bytes (as JSON) of one user_metadata (Tinker sessions and runs)."
    ),
    max_sessions: int | None = typer.Option(
        None, min=0, help="Tinker sessions (ServiceClients) open at once."
    ),
    max_queued_jobs: int | None = typer.Option(
        None, min=0, help="RL and SFT training jobs queued or running at once."
    ),
    max_queued_operations: int | None = typer.Option(
        None, min=0, help="Operations queued and not done per Tinker training run."
    ),
    reset: list[str] = typer.Option(
        [], "--reset", help="A limit to return to its default (the setting); repeatable."
    ),
    json_: bool = JSON_OPTION,
) -> None:
    """Set a tenant's limits and quotas, then print those in force.

    Limits not given stay as they are; a limit never set for the tenant follows its default
    setting (SKYTRAIN_TENANT_MAX_MODELS, ...). Over a quota, creating a model is a 403;
    models over the placement quotas wait, and their requests get 429 with Retry-After; a
    request that would store more than max_storage_bytes is a 403, a user_metadata over
    max_metadata_bytes a 413, an operation past max_queued_operations a 429.
    """
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants

    given = {
        "max_concurrent_requests": max_concurrent_requests,
        "max_concurrent_rest_requests": max_concurrent_rest_requests,
        "max_sequences_in_flight": max_sequences_in_flight,
        "max_tokens_in_flight": max_tokens_in_flight,
        "max_waiting_polls": max_waiting_polls,
        "max_models": max_models,
        "max_placed_models": max_placed_models,
        "max_workers": max_workers,
        "max_storage_bytes": max_storage_bytes,
        "max_metadata_bytes": max_metadata_bytes,
        "max_sessions": max_sessions,
        "max_queued_jobs": max_queued_jobs,
        "max_queued_operations": max_queued_operations,
    }
    values = {name: value for name, value in given.items() if value is not None}
    with _session() as session:
        if values or reset:
            row = tenants.set_limits(
                session,
                tenant_name=tenant,
                values=values,
                reset=[r.replace("-", "_") for r in reset],
            )
        else:
            row = tenants.get_tenant_by_name(session, name=tenant)
        limits = vars(tenants.limits_of(row, get_settings()))
        own = row.limits or {}
    _output(
        None,
        ["limit", "value", "set by"],
        [
            [name, str(value), "this tenant" if name in own else "default"]
            for name, value in limits.items()
        ],
        as_json=json_,
    )


@tenants_app.command("show")
def tenants_show(
    tenant: str = typer.Argument(..., help="The tenant's name (see `skytrain tenants list`)."),
    json_: bool = JSON_OPTION,
) -> None:
    """Show a tenant's quotas: what it holds (models, Tinker sessions open, stored bytes)
    against each limit."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants

    with _session() as session:
        row = tenants.get_tenant_by_name(session, name=tenant)
        limits = vars(tenants.limits_of(row, get_settings()))
        used = {
            k: str(v) for k, v in tenants.usage_of(session, tenant_id=row.id).by_limit().items()
        }
        own = row.limits or {}
    _output(
        None,
        ["limit", "used", "value", "set by"],
        [
            [name, used.get(name, "-"), str(value), "this tenant" if name in own else "default"]
            for name, value in limits.items()
        ],
        as_json=json_,
    )


@db_app.command("upgrade")
def db_upgrade(revision: str = typer.Argument("head", help="Target revision.")) -> None:
    """Upgrade the schema of SKYTRAIN_DATABASE_URL (to the newest revision by default)."""
    from skytrain_backend.db import migrations

    with _database() as engine:
        migrations.upgrade(engine, revision)
        typer.echo(
            f"database at revision {', '.join(sorted(migrations.current_revisions(engine)))}"
        )


# "-1" is the revision, not an option.
@db_app.command("downgrade", context_settings={"ignore_unknown_options": True})
def db_downgrade(
    revision: str = typer.Argument(..., help="Target revision: an id, -1 for one step, or base."),
) -> None:
    """Downgrade the schema (base drops every skytrain table and its data)."""
    from skytrain_backend.db import migrations

    with _database() as engine:
        migrations.downgrade(engine, revision)
        current = migrations.current_revisions(engine)
        typer.echo(f"database at revision {', '.join(sorted(current)) or 'base (empty)'}")


@db_app.command("current")
def db_current() -> None:
    """Show the schema's revision and whether `skytrain db upgrade` is needed: exits 1 when
    it is (outdated), as a check in a script or a deploy."""
    from skytrain_backend.db import migrations

    with _database() as engine:
        current, heads = migrations.current_revisions(engine), migrations.head_revisions()
    shown = ", ".join(sorted(current)) or "base (empty)"
    state = "up to date" if current == heads else "outdated: run `skytrain db upgrade`"
    typer.echo(f"{shown} ({state}; newest is {', '.join(sorted(heads))})")
    if current != heads:
        raise typer.Exit(code=1)


app.add_typer(engine_app, name="engine")

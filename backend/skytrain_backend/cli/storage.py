"""``skytrain storage check``: the rows whose objects the store lost or holds damaged."""

from __future__ import annotations

import typer

from skytrain_backend.cli._common import (
    JSON_OPTION,
    _object_store,
    _print_json,
    _rows,
    _session,
    _table,
    command_group,
)

storage_app = command_group("storage", "Check the object store against the database.")


@storage_app.command("check")
def storage_check(
    read: bool = typer.Option(
        False,
        "--read",
        help="Also read every checkpoint file and uploaded file back and check its SHA-256 "
        "(slow: every byte).",
    ),
    fix_usage: bool = typer.Option(
        False,
        "--fix-usage",
        help="Set each tenant's running total of stored bytes to the sum over its rows.",
    ),
    as_json: bool = JSON_OPTION,
) -> None:
    """List every row whose object is missing from the store or not the size recorded: each
    file of a live checkpoint (or, for rows committed before files were recorded, their
    total), logged batches, the inputs of unfinished jobs and uploaded files. Reads one
    listing per model and one per tenant with files; with --read, also each checkpoint file
    and uploaded file (``corrupt``: not the SHA-256 recorded). Exits 1 when it finds any, so a
    cron job or a health check can alert on it.

    Also recounts each tenant's stored bytes (the running total its storage quota is checked
    against) from its rows and lists the tenants whose total differs; --fix-usage sets them
    to the count (a difference not fixed also exits 1). ``--json``: one object, the store,
    the rows found (``problems``) and the tenants whose totals differ (``tenants``), with the
    same exit code."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import tenants
    from skytrain_backend.scheduler import integrity

    settings = get_settings()
    store = _object_store(settings)
    with _session() as session:
        problems = list(integrity.check_storage(session, store=store, read=read))
        recounts = tenants.recount_storage(session, fix=fix_usage)
    tenant_rows = [[item.tenant, str(item.recorded), str(item.counted)] for item in recounts]
    rows = [
        [
            problem.row_id,
            problem.kind,
            problem.model_id or "-",
            problem.state,
            "-" if problem.expected_size is None else str(problem.expected_size),
            "-" if problem.found_size is None else str(problem.found_size),
            problem.key,
        ]
        for problem in problems
    ]
    failed = bool(problems) or (bool(recounts) and not fix_usage)
    if as_json:
        _print_json(
            {
                "store": store.url,
                "problems": _rows(PROBLEM_COLUMNS, rows),
                "tenants": _rows(TENANT_COLUMNS, tenant_rows),
                "tenants_fixed": fix_usage and bool(recounts),
            }
        )
    else:
        _print(store.url, rows, tenant_rows, fixed=fix_usage)
    if failed:
        raise typer.Exit(code=1)


PROBLEM_COLUMNS = ["row", "kind", "model", "state", "bytes recorded", "bytes found", "key"]
TENANT_COLUMNS = ["tenant", "bytes recorded", "bytes counted"]


def _print(url: str, rows: list[list[str]], tenant_rows: list[list[str]], *, fixed: bool) -> None:
    if tenant_rows:
        _table(
            f"{len(tenant_rows)} tenants whose stored bytes differ from their rows' "
            + ("(fixed)" if fixed else "(--fix-usage sets them to the count)"),
            TENANT_COLUMNS,
            tenant_rows,
        )
    else:
        typer.echo("Every tenant's stored bytes match its rows.")
    if not rows:
        typer.echo(f"Every row's objects are in {url}, at the size recorded.")
        return
    _table(f"{len(rows)} rows whose objects are missing or damaged in {url}", PROBLEM_COLUMNS, rows)

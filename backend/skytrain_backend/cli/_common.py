"""What every command of the ``skytrain`` command line shares: the Typer app, the database
session, and how lists are printed. Commands import what they need inside their function, so
``skytrain --help`` and the control plane's commands never load torch."""

from __future__ import annotations

import collections
import contextlib
import os
import sys
import time
from collections.abc import Iterator, Sequence
from datetime import datetime
from pathlib import Path
from typing import TYPE_CHECKING, Literal, TextIO

import typer

from skytrain_backend import __version__

if TYPE_CHECKING:
    from sqlalchemy import Engine
    from sqlalchemy.orm import Session

    from skytrain_backend.config import Settings
    from skytrain_backend.db.models import Worker
    from skytrain_backend.storage import ObjectStore

# Help as Markdown: a docstring's paragraphs reflow to the terminal's width. Typer's "rich" mode
# keeps every line break of the source, so help text broke lines mid-sentence.
MARKUP: Literal["markdown"] = "markdown"

app = typer.Typer(
    rich_markup_mode=MARKUP,
    name="skytrain",
    help="skytrain: a self-hosted backend that trains LLM agents with reinforcement learning.",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    # `-h` as `--help`, on every command: Click's contexts inherit the names from the root.
    context_settings={"help_option_names": ["-h", "--help"]},
)


def command_group(name: str, help: str, *, parent: typer.Typer = app) -> typer.Typer:
    """The commands ``skytrain [parent] <name> ...``, listed when it is run bare."""
    group = typer.Typer(rich_markup_mode=MARKUP, help=help, no_args_is_help=True)
    parent.add_typer(group, name=name)
    return group


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


def _fail(message: str) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code=1)


@contextlib.contextmanager
def _database() -> Iterator[Engine]:
    """The settings' database; one that cannot be reached, or a URL that names none skytrain
    can open, is a short error naming its URL (password hidden) and what to check, not the
    driver's traceback."""
    from sqlalchemy.engine import make_url
    from sqlalchemy.exc import ArgumentError, InterfaceError, OperationalError

    from skytrain_backend.config import get_settings
    from skytrain_backend.db.session import create_db_engine

    url = get_settings().storage.resolved_database_url
    try:
        engine = create_db_engine(url)
    except (ArgumentError, ImportError, ValueError) as exc:
        # Unparsable, an unknown dialect, a driver that is not installed, a port that is not a
        # number. A URL that does not parse is not shown: its password cannot be told apart.
        try:
            shown = f" {make_url(url).render_as_string(hide_password=True)}"
        except (ArgumentError, ValueError):
            shown = ""
        raise _fail(
            f"SKYTRAIN_DATABASE_URL is not a database URL skytrain can open{shown}: {exc}\n"
            "  give postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE or sqlite:///PATH"
        ) from None
    try:
        yield engine
    except (OperationalError, InterfaceError) as exc:
        shown = make_url(url).render_as_string(hide_password=True)
        reason = str(exc.orig or exc).strip().splitlines()[0][:200]
        raise _fail(
            f"cannot reach the database {shown}: {reason}\n"
            "  check that it runs and this host can reach it, and SKYTRAIN_DATABASE_URL "
            "(its host, port, user and password)"
        ) from None
    finally:
        engine.dispose()


def _object_store(settings: Settings) -> ObjectStore:
    """The settings' object store, listed once: one that cannot be reached, or has no such
    bucket, is a short error naming its URL and what to check, not a scheduler's traceback
    every few seconds once the server runs."""
    from skytrain_backend.errors import SkytrainError
    from skytrain_backend.storage import open_object_store

    shown = settings.storage.resolved_object_store_url
    if settings.storage.s3_endpoint_url and shown.startswith("s3://"):
        shown += f" (endpoint {settings.storage.s3_endpoint_url})"
    try:
        store = open_object_store(settings.storage.resolved_object_store_url, settings)
        store.list("health/")
    except SkytrainError as exc:
        reason = exc.message.strip().splitlines()[0][:300]
        raise _fail(
            f"cannot use the object store {shown}: {reason}\n"
            "  check that it runs and this host can reach it, SKYTRAIN_OBJECT_STORE_URL and "
            "SKYTRAIN_S3_ENDPOINT_URL, and the store's credentials (AWS_ACCESS_KEY_ID, ...)"
        ) from None
    return store


@contextlib.contextmanager
def _session() -> Iterator[Session]:
    """A session on a schema that is current (upgraded first where auto-migration is on); a
    ``SkytrainError`` raised in the block is the command's error (its message, exit code 1)."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.db import migrations
    from skytrain_backend.db.session import session_factory
    from skytrain_backend.errors import SkytrainError

    with _database() as engine:
        try:
            migrations.prepare_schema(
                engine, auto_migrate=get_settings().storage.should_auto_migrate
            )
            with session_factory(engine)() as session:
                yield session
        except SkytrainError as exc:
            raise _fail(exc.message) from None


def _when(moment: datetime | None, default: str = "") -> str:
    """A time as the list commands show it (UTC, to the minute)."""
    return f"{moment:%Y-%m-%d %H:%M}" if moment else default


def _columns(rows: Sequence[Sequence[str]]) -> None:
    """Plain aligned columns (``_table`` is the one to call)."""
    widths = [max(len(row[column]) for row in rows) for column in range(len(rows[0]))]
    for row in rows:
        typer.echo(
            "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip()
        )


def _ago(moment: datetime | None) -> str:
    if moment is None:
        return "-"
    from skytrain_backend.db.models import utcnow

    seconds = int((utcnow() - moment).total_seconds())
    for unit, size in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= size:
            return f"{seconds // size}{unit} ago"
    return f"{seconds}s ago"


def _worker_cells(session: Session, row: Worker) -> list[str]:
    """The cells every list of workers starts with: id, provider, status, base model and
    the number of models placed on it."""
    from sqlalchemy import func, select

    from skytrain_backend.db.models import Model

    placed = session.scalar(select(func.count(Model.id)).where(Model.worker_id == row.id))
    return [row.id, row.provider, row.status, row.base_model, str(placed)]


def _table(title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Every table of the CLI, in one style (as `sky status` and `kubectl get` print theirs):
    an optional title line, a header in capitals, then aligned plain columns, never wrapped or
    folded, so that ids come out whole to copy and every row is one line for grep. A cell's line
    breaks become spaces."""
    if title:
        typer.echo(title)
    cells = [[" ".join(str(cell).split()) for cell in row] for row in rows]
    _columns([[column.upper() for column in columns], *cells])


def _interruptible() -> None:
    """Ctrl-C (SIGINT) stops this command, even when it was started with SIGINT ignored.

    A shell without job control starts a background command (``cmd &``, a CI script's
    steps) with SIGINT ignored, and every process below it inherits that: Python then installs
    no KeyboardInterrupt handler and asyncio no cancelling one, so a demo sent SIGINT trained
    on to its last step (issue 36's lost Ctrl-C). The long-running commands take SIGINT back.
    """
    import signal

    if signal.getsignal(signal.SIGINT) == signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def _follow(path: Path, *, lines: int, waiting: str, poll_s: float = 0.5) -> None:
    """Print the last ``lines`` of the log at ``path``, then what is appended as it comes,
    like ``tail -F``, until Ctrl-C (which ends it with exit code 0). A file not there yet is
    waited for, saying ``waiting`` once on stderr, and printed whole when it appears; one
    truncated or replaced (a worker started again) is read from its start."""
    _interruptible()
    handle: TextIO | None = None
    first = True
    try:
        while True:
            if handle is None:
                try:
                    handle = open(path, errors="replace")  # noqa: SIM115 (held across polls)
                except FileNotFoundError:
                    if first:
                        typer.echo(waiting, err=True)
                    first = False  # whatever appears later is new: all of it
                    time.sleep(poll_s)
                    continue
                if first:  # the tail of what is there; a later file is new: all of it
                    sys.stdout.write("".join(collections.deque(handle, maxlen=lines)))
                first = False
            chunk = handle.read()
            if chunk:
                sys.stdout.write(chunk)
                sys.stdout.flush()
                continue
            sys.stdout.flush()
            try:
                now = os.stat(path)
            except FileNotFoundError:
                now = None
            opened = os.fstat(handle.fileno())
            if now is None or now.st_ino != opened.st_ino or now.st_size < handle.tell():
                handle.close()
                handle = None
                continue
            time.sleep(poll_s)
    except KeyboardInterrupt:
        pass
    finally:
        if handle is not None:
            handle.close()


JSON_OPTION = typer.Option(
    False, "--json", help="Print JSON (an array of rows, or one object) for scripts."
)


def _human_size(size: int) -> str:
    """A byte count as people read it: 225027 -> 220 KiB."""
    value = float(size)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{value:.0f} {unit}" if unit == "B" or value >= 10 else f"{value:.1f} {unit}"
        value /= 1024
    raise AssertionError("unreachable")


def _print_json(value: object) -> None:
    import json

    typer.echo(json.dumps(value, indent=2, default=str))


def _rows(columns: Sequence[str], rows: Sequence[Sequence[str]]) -> list[dict[str, str]]:
    """Table rows as objects, keyed by the columns' names (spaces as underscores)."""
    keys = [column.replace(" ", "_") for column in columns]
    return [dict(zip(keys, row, strict=True)) for row in rows]


def _output(
    title: str | None, columns: Sequence[str], rows: Sequence[Sequence[str]], *, as_json: bool
) -> None:
    """A list command's rows: a table, or a JSON array of objects with ``--json``."""
    if as_json:
        _print_json(_rows(columns, rows))
    else:
        _table(title, columns, rows)


def _log_to_stderr() -> None:
    """skytrain's own log lines (INFO and up) on stderr, as SKYTRAIN_LOG_FORMAT says (text
    or one JSON object a line), with the request's context; in JSON mode every other line
    the process prints too (the server's and a worker's commands, whose output is a log)."""
    from skytrain_backend.config import get_settings
    from skytrain_backend.observability.logs import configure_logging

    settings = get_settings()
    configure_logging(
        settings.observability.log_format, whole_process=True, worker_id=settings.worker.id
    )

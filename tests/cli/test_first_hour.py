"""The command line as an operator first meets it (issue 36): ``-h`` everywhere, choices
validated, an unreachable database in a few lines rather than a traceback, and ``db current``
failing on an outdated schema so a script can check it."""

from __future__ import annotations

import inspect
import os
import socket
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from skytrain_backend.cli import app
from skytrain_backend.config import get_settings
from tests.fixtures.services import MakeSettings

SKYTRAIN = str(Path(sys.executable).parent / "skytrain")


@pytest.fixture
def cli(monkeypatch: pytest.MonkeyPatch) -> Iterator[Callable[..., tuple[int, str]]]:
    """Runs a command in this process (Typer's runner) on the environment's settings."""
    runner = CliRunner()

    def run(*args: str) -> tuple[int, str]:
        get_settings.cache_clear()
        result = runner.invoke(app, list(args))
        return result.exit_code, result.output

    yield run
    get_settings.cache_clear()


@pytest.mark.parametrize(
    "command", [[], ["jobs"], ["jobs", "list"], ["db", "current"], ["workers", "plan"]]
)
def test_dash_h_is_help_on_every_level(
    cli: Callable[..., tuple[int, str]], command: list[str]
) -> None:
    code, output = cli(*command, "-h")
    assert code == 0, output
    assert "Usage:" in output and "--help" in output


def test_jobs_list_refuses_an_unknown_status_naming_the_choices(
    cli: Callable[..., tuple[int, str]],
) -> None:
    code, output = cli("jobs", "list", "--status", "bogus")
    assert code == 2, output
    assert "bogus" in output
    for status in ("queued", "running", "succeeded", "failed", "cancelled"):
        assert status in output


def test_jobs_list_filters_by_a_known_status(
    cli: Callable[..., tuple[int, str]],
    make_settings: MakeSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv("SKYTRAIN_DATABASE_URL", make_settings().storage.resolved_database_url)
    code, output = cli("jobs", "list", "--status", "queued")
    assert code == 0, output
    assert "training jobs" in output


def test_db_current_exits_non_zero_while_the_schema_is_outdated(
    cli: Callable[..., tuple[int, str]],
    make_settings: MakeSettings,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setenv(
        "SKYTRAIN_DATABASE_URL", make_settings(database="postgres").storage.resolved_database_url
    )
    assert cli("db", "current")[0] == 0
    assert cli("db", "downgrade", "-1")[0] == 0
    code, output = cli("db", "current")
    assert code == 1 and "outdated: run `skytrain db upgrade`" in output
    assert cli("db", "upgrade")[0] == 0
    code, output = cli("db", "current")
    assert code == 0 and "up to date" in output


def _closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@pytest.mark.parametrize(
    "command",
    [["status"], ["models", "list"], ["workers", "list"], ["db", "current"]],
    ids=" ".join,
)
def test_an_unreachable_database_is_a_few_lines_naming_it(
    command: list[str], tmp_path: Path
) -> None:
    """The installed command in a process of its own: what an operator's terminal shows."""
    port = _closed_port()
    env = {
        **os.environ,
        "SKYTRAIN_HOME": str(tmp_path),
        "SKYTRAIN_DATABASE_URL": f"postgresql+psycopg://ops:s3cret@127.0.0.1:{port}/skytrain",
    }
    result = subprocess.run(
        [SKYTRAIN, *command], env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert len(output.strip().splitlines()) <= 5, output
    assert f"ops:***@127.0.0.1:{port}/skytrain" in output
    assert "s3cret" not in output and "Traceback" not in output
    assert "SKYTRAIN_DATABASE_URL" in output


@pytest.mark.parametrize(
    ("url", "shown"),
    [
        ("ops:s3cret@db.internal/skytrain", None),  # no scheme: not a URL at all
        ("mysql://ops:s3cret@db.internal/skytrain", "mysql://ops:***@db.internal/skytrain"),
        ("postgres+psycopg://ops:s3cret@db.internal/skytrain", "postgres+psycopg://ops:***@"),
        ("postgresql+psycopg://ops:s3cret@db.internal:port/skytrain", None),
    ],
    ids=["not a URL", "driver not installed", "unknown dialect", "port not a number"],
)
def test_a_database_url_skytrain_cannot_open_is_a_few_lines_naming_the_variable(
    url: str, shown: str | None, tmp_path: Path
) -> None:
    """A mistyped SKYTRAIN_DATABASE_URL printed SQLAlchemy's traceback (about 100 lines) from
    every command that reads the database."""
    env = {**os.environ, "SKYTRAIN_HOME": str(tmp_path), "SKYTRAIN_DATABASE_URL": url}
    result = subprocess.run(
        [SKYTRAIN, "status"], env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert len(output.strip().splitlines()) <= 5, output
    assert "SKYTRAIN_DATABASE_URL is not a database URL skytrain can open" in output
    assert "postgresql+psycopg://USER:PASSWORD@HOST:PORT/DATABASE" in output
    assert "s3cret" not in output and "Traceback" not in output
    if shown is not None:
        assert shown in output


@pytest.mark.parametrize(
    ("command", "variable", "value", "said"),
    [
        (["status"], "SKYTRAIN_METRICS_PORT", "s3cret", "Input should be a valid integer"),
        (["serve"], "SKYTRAIN_LOG_FORMAT", "s3cret", "Input should be 'text' or 'json'"),
        (["workers", "list"], "SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS", "-1", "greater than 0"),
    ],
    ids=["status", "serve", "workers list"],
)
def test_a_setting_with_a_wrong_value_is_a_few_lines_naming_its_variable(
    command: list[str], variable: str, value: str, said: str, tmp_path: Path
) -> None:
    """A wrong SKYTRAIN_* value printed pydantic's traceback (about 110 lines) from whichever
    command read the settings. Now one line names the variable and what it should be, never
    its value (which could be a secret)."""
    env = {**os.environ, "SKYTRAIN_HOME": str(tmp_path), variable: value}
    result = subprocess.run(
        [SKYTRAIN, *command], env=env, capture_output=True, text=True, timeout=120
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    assert len(output.strip().splitlines()) <= 5, output
    (error,) = [line for line in output.splitlines() if line.startswith("error:")]
    assert error.startswith(f"error: {variable}: ") and said in error
    assert "docs/operators.md" in output
    assert "s3cret" not in output and "Traceback" not in output


def test_the_status_choices_are_the_protocols() -> None:
    from typing import get_args

    from skytrain_backend.cli.workers import JobStatusChoice
    from skytrain_backend.protocol.worker import JobStatus

    assert [choice.value for choice in JobStatusChoice] == list(get_args(JobStatus))


def _commands(group: Any, path: list[str]) -> Iterator[tuple[list[str], Any]]:
    """Every command below ``group`` (Typer's own Click groups), with its path."""
    for name, command in group.commands.items():
        yield [*path, name], command
        if hasattr(command, "commands"):
            yield from _commands(command, [*path, name])


def test_help_text_reflows_its_paragraphs_to_the_terminal() -> None:
    """Issue 36: help kept every line break of the docstring, so at 80 columns it broke lines
    mid-sentence. On a wide terminal each paragraph of every command's help is one line."""
    root = typer.main.get_command(app)
    runner = CliRunner()
    checked = 0
    for path, command in _commands(root, []):
        paragraphs = inspect.cleandoc(command.help or "").split("\n\n")
        result = runner.invoke(app, [*path, "-h"], env={"COLUMNS": "400"})
        assert result.exit_code == 0, (path, result.output)
        lines = [" ".join(line.split()) for line in result.output.splitlines()]
        for paragraph in paragraphs:
            if "\n" not in paragraph or paragraph.lstrip().startswith(("-", "*", "1.")):
                continue  # one source line already, or a list
            first, second = (" ".join(line.replace("`", "").split()) for line in
                             paragraph.splitlines()[:2])  # fmt: skip
            # Reflowed: the paragraph's first source line goes on with the next one's words.
            joined = f"{first} {second.split()[0]}"
            assert any(joined in line for line in lines), (path, joined, result.output)
            checked += 1
    assert checked >= 10


@pytest.mark.parametrize("command", [["serve", "--port", "0"], ["storage", "check"]])
def test_an_unreachable_object_store_is_a_few_lines_naming_it(
    command: list[str], tmp_path: Path
) -> None:
    """Issue 36: `skytrain serve` started on a store it could not reach and logged a
    scheduler traceback every pass; `storage check` said every object was there."""
    port = _closed_port()
    env = {
        **os.environ,
        "SKYTRAIN_HOME": str(tmp_path),
        "SKYTRAIN_OBJECT_STORE_URL": "s3://checkpoints/prod",
        "SKYTRAIN_S3_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "operator",
        "AWS_SECRET_ACCESS_KEY": "s3cret-store-key",
    }
    upgrade = subprocess.run([SKYTRAIN, "db", "upgrade"], env=env, capture_output=True, timeout=300)
    assert upgrade.returncode == 0, upgrade.stderr  # the database is fine: only the store is not
    result = subprocess.run(
        [SKYTRAIN, *command], env=env, capture_output=True, text=True, timeout=300
    )
    output = result.stdout + result.stderr
    assert result.returncode == 1, output
    errors = [line for line in output.splitlines() if "cannot use the object store" in line]
    assert errors and f"s3://checkpoints/prod (endpoint http://127.0.0.1:{port})" in errors[0]
    assert "SKYTRAIN_S3_ENDPOINT_URL" in output
    assert "s3cret-store-key" not in output and "Traceback" not in output
    assert "listening on" not in output  # never started
    # Besides the log lines before it (the schema check's, boto's): the error, two lines.
    said = [line for line in output.strip().splitlines() if not line[:4].isdigit()]
    assert len(said) <= 2, output

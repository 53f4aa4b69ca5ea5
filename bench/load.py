"""What the load benches share: the --postgres-url option, the hardware line, a fresh schema,
a server process started and stopped around a run.

``bench/rest_burst.py``, ``bench/admission.py``, ``bench/slow_clients.py`` and
``bench/quota_cost.py`` run against PostgreSQL in a schema of their own, dropped at the end.
The scripts run as ``python bench/<name>.py``, so this module is importable as ``load``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import time
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import machine
from sqlalchemy import create_engine, text
from sqlalchemy.engine import make_url


def add_postgres_url(parser: argparse.ArgumentParser) -> None:
    """--postgres-url: the database whose fresh schema the bench uses
    (SKYTRAIN_TEST_POSTGRES_URL by default, as the suite)."""
    parser.add_argument(
        "--postgres-url",
        default=os.environ.get(
            "SKYTRAIN_TEST_POSTGRES_URL", "postgresql+psycopg://postgres@127.0.0.1:5432/test"
        ),
    )


def print_hardware() -> None:
    print(
        f"hardware: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU (shared by the "
        "control plane, the database and the clients)"
    )


@contextmanager
def fresh_schema(postgres_url: str, prefix: str) -> Iterator[str]:
    """A new schema ``<prefix>_<12 hex digits>`` in ``postgres_url``'s database, dropped with
    all in it afterwards; yields a URL whose connections use it."""
    schema = f"{prefix}_{uuid.uuid4().hex[:12]}"
    admin = create_engine(postgres_url, isolation_level="AUTOCOMMIT")
    with admin.connect() as connection:
        connection.execute(text(f'CREATE SCHEMA "{schema}"'))
    try:
        url = make_url(postgres_url).update_query_dict({"options": f"-csearch_path={schema}"})
        yield url.render_as_string(hide_password=False)
    finally:
        with admin.connect() as connection:
            connection.execute(text(f'DROP SCHEMA "{schema}" CASCADE'))
        admin.dispose()


def service_env(database_url: str) -> dict[str, str]:
    """`skytrain serve`'s environment on ``database_url``, its schema migrated at start."""
    return {"SKYTRAIN_DATABASE_URL": database_url, "SKYTRAIN_AUTO_MIGRATE": "true"}


@contextmanager
def served(
    argv: list[str], env: dict[str, str], health_url: str, log: Path, *, timeout_s: float = 300
) -> Iterator[subprocess.Popen[bytes]]:
    """``argv`` running (its output in ``log``) from when ``health_url`` answers 200 until the
    block ends; SystemExit with the log's tail if it exits or is not up within ``timeout_s``."""
    with open(log, "wb") as out:
        process = subprocess.Popen(argv, env=env, stdout=out, stderr=subprocess.STDOUT)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            if process.poll() is not None or time.monotonic() > deadline:
                raise SystemExit(f"{argv[1:3]} did not start:\n{log.read_text()[-3000:]}")
            try:
                if httpx.get(health_url, timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        yield process
    finally:
        process.terminate()
        try:
            process.wait(30)
        except subprocess.TimeoutExpired:
            process.kill()

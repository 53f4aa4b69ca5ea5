"""The `skytrain` command: serve, keys and db, run as a user runs them (real processes)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import httpx
import pytest
from sqlalchemy.engine import make_url

from skytrain_backend.db import migrations
from tests.fixtures.ports import free_port

pytestmark = pytest.mark.e2e

SKYTRAIN = str(Path(sys.executable).parent / "skytrain")


def _env(home: Path, **settings: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("SKYTRAIN_")}
    env["SKYTRAIN_HOME"] = str(home)
    env["SKYTRAIN_PROVIDER"] = "none"  # these servers never need a worker
    env.update({f"SKYTRAIN_{k.upper()}": v for k, v in settings.items()})
    return env


def _run(env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [SKYTRAIN, *args], env=env, capture_output=True, text=True, timeout=120, check=False
    )


@contextmanager
def _serving(env: dict[str, str]) -> Iterator[tuple[str, Callable[[], str]]]:
    """`skytrain serve` on a free port; yields its URL and a function reading its output."""
    port = free_port()
    process = subprocess.Popen(
        [SKYTRAIN, "serve", "--port", str(port)],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert process.poll() is None, process.communicate()[0]
            try:
                if httpx.get(f"{url}/health").status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "skytrain serve did not answer in 60 s"
            time.sleep(0.2)
        output: list[str] = []

        def read() -> str:
            process.terminate()
            output.append(process.communicate(timeout=30)[0])
            return output[0]

        yield url, read
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


@pytest.mark.slow
def test_keys_create_list_revoke_against_a_running_server(tmp_path: Path) -> None:
    env = _env(tmp_path)
    created = _run(env, "keys", "create", "--tenant", "acme", "--name", "laptop")
    assert created.returncode == 0, created.stderr
    key = created.stdout.strip()
    assert re.fullmatch(r"sk-st-[A-Za-z0-9_-]{43}", key)
    assert "not shown again" in created.stderr

    with _serving(env) as (url, output):
        headers = {"Authorization": f"Bearer {key}"}
        response = httpx.post(
            f"{url}/v1/models",
            json={"project": "p", "name": "m", "base_model": "b"},
            headers=headers,
        )
        assert response.status_code == 201
        assert response.json()["entity"] == "acme"

        listed = _run(env, "keys", "list", "--tenant", "acme")
        assert key[:12] in listed.stdout
        assert "laptop" in listed.stdout
        assert key not in listed.stdout

        revoked = _run(env, "keys", "revoke", key[:12])
        assert revoked.returncode == 0, revoked.stderr
        after = httpx.get(f"{url}/v1/models", headers=headers)
        assert after.status_code == 401
        assert "revoked" in after.json()["error"]["message"]
        printed = output()
    assert f"listening on {url}" in printed
    assert f"sqlite:///{tmp_path}/skytrain.db" in printed
    assert f"file://{tmp_path}/objects" in printed


def test_revoke_unknown_key_fails_with_a_message(tmp_path: Path) -> None:
    result = _run(_env(tmp_path), "keys", "revoke", "sk-st-nothing")
    assert result.returncode == 1
    assert "no API key has id or prefix 'sk-st-nothing'" in result.stderr


@pytest.mark.postgres
@pytest.mark.slow
def test_serve_refuses_an_outdated_schema_and_hides_the_password(
    tmp_path: Path, make_postgres_url: Callable[[], str]
) -> None:
    # Trust authentication ignores the password, so a secret can be put in the URL.
    url = make_url(make_postgres_url()).set(password="hunter2-secret")
    env = _env(tmp_path, database_url=url.render_as_string(hide_password=False))
    refused = _run(env, "serve", "--port", str(free_port()))
    assert refused.returncode == 1
    assert "run `skytrain db upgrade`" in refused.stderr
    assert "Traceback" not in refused.stderr

    upgraded = _run(env, "db", "upgrade")
    assert upgraded.returncode == 0, upgraded.stderr
    with _serving(env) as (_, output):
        printed = output()
    assert "postgresql+psycopg://postgres:***@" in printed
    assert "hunter2-secret" not in printed


@pytest.mark.slow
def test_db_commands_report_and_move_the_revision(tmp_path: Path) -> None:
    env = _env(tmp_path)
    (head,) = migrations.head_revisions()
    assert "outdated" in _run(env, "db", "current").stdout
    assert "database at revision 0001" in _run(env, "db", "upgrade", "0001").stdout
    assert "outdated" in _run(env, "db", "current").stdout
    assert f"database at revision {head}" in _run(env, "db", "upgrade").stdout
    assert "up to date" in _run(env, "db", "current").stdout
    assert "base (empty)" in _run(env, "db", "downgrade", "base").stdout
    assert "outdated" in _run(env, "db", "current").stdout


def test_help_lists_the_commands() -> None:
    top = subprocess.run([SKYTRAIN, "--help"], capture_output=True, text=True, check=True)
    for command in ("serve", "keys", "db"):
        assert command in top.stdout
    create = subprocess.run(
        [SKYTRAIN, "keys", "create", "--help"], capture_output=True, text=True, check=True
    )
    assert "--tenant" in create.stdout
    assert "shown only once" in " ".join(create.stdout.split())


def test_serve_takes_its_startup_heap_out_of_the_collectors_scans(tmp_path: Path) -> None:
    """`serve` freezes what startup made before it takes requests: under bursts the cyclic
    collector's full collections, each walking the whole heap of imported modules and the
    app, took most of the server's time (bench/admission.py). Run in a process of its own, as
    `serve` runs: the freeze is process-wide."""
    code = (
        "import gc\n"
        "from skytrain_backend.app import create_app\n"
        "from skytrain_backend.cli.control import freeze_startup_heap\n"
        "create_app()\n"
        "gc.collect()\n"
        "tracked = len(gc.get_objects())\n"
        "freeze_startup_heap()\n"
        "print(tracked, gc.get_freeze_count(), len(gc.get_objects()), gc.get_threshold()[0])\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code],
        env=_env(tmp_path),
        capture_output=True,
        text=True,
        timeout=120,
        check=True,
    )
    tracked, frozen, still_scanned, young_threshold = map(int, result.stdout.split())
    assert tracked > 50_000  # the imported modules and the app
    assert frozen >= tracked * 0.99  # (a few of those may have been freed in between)
    assert still_scanned < tracked // 100
    assert young_threshold > 700  # CPython's default: a young collection every 700 allocations

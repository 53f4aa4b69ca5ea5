"""Limits that hold before a request costs anything: the worker token and the body's size and
time, checked before the body is read; a batch counted as it is read; base models from an
allow-list; failures told without the host's paths or tenants' ids."""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import tracemalloc
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.db import workers
from skytrain_backend.storage import ObjectStore, keys
from tests.api.support import group
from tests.fixtures.callers import Caller
from tests.fixtures.models import model_cache_dir
from tests.fixtures.services import ControlPlane
from tests.gateway.conftest import serve_in_thread
from tests.hostile.conftest import INFERENCE_LIMIT

RESPONSE_TIMEOUT_S = 30


def _send_head(url: str, head: str, body_start: bytes) -> str:
    """Send a request's head and the first bytes of its body, then read the server's answer
    (status line and headers) without sending the rest."""
    address = urlsplit(url)
    with socket.create_connection(
        (address.hostname, address.port), timeout=RESPONSE_TIMEOUT_S
    ) as sock:
        sock.sendall(head.replace("\n", "\r\n").encode() + b"\r\n" + body_start)
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = sock.recv(65536)
            if not chunk:
                break
            answer += chunk
    return answer.decode("latin-1")


def _head(path: str, *, length: int, token: str | None = None, method: str = "POST") -> str:
    lines = [
        f"{method} {path} HTTP/1.1",
        "Host: localhost",
        "Content-Type: application/json",
        f"Content-Length: {length}",
    ]
    if token is not None:
        lines.append(f"Authorization: Bearer {token}")
    return "\n".join(lines) + "\n"


@pytest.fixture
def worker_token(db_sessions: sessionmaker[Session]) -> str:
    with db_sessions() as session:
        _, token = workers.create_worker(
            session, provider="manual", base_model="tiny/llama", max_models=1, status="ready"
        )
        session.commit()
    return token


@pytest.mark.parametrize("token", [None, "swt-forged", "swj-forged", "sk-st-not-a-worker"])
def test_a_300_mb_worker_post_without_a_valid_token_gets_401_before_its_body(
    control_plane: ControlPlane, token: str | None
) -> None:
    for path in ("/v1/worker/heartbeat", "/v1/worker/register", "/v1/worker/jobs/x/files/y"):
        method = "PUT" if path.endswith("/y") else "POST"
        answer = _send_head(
            control_plane.url,
            _head(path, length=300_000_000, token=token, method=method),
            b"x" * 65536,  # of 300 MB declared: the server answers without waiting for the rest
        )
        assert answer.startswith("HTTP/1.1 401"), answer


def test_a_worker_body_over_the_limit_gets_413_once_the_token_is_checked(
    control_plane: ControlPlane, worker_token: str
) -> None:
    answer = _send_head(
        control_plane.url,
        _head("/v1/worker/heartbeat", length=300_000_000, token=worker_token),
        b"x" * 65536,
    )
    assert answer.startswith("HTTP/1.1 413"), answer
    heartbeat = httpx.post(
        f"{control_plane.url}/v1/worker/heartbeat",
        json={"status": "ready", "served": []},
        headers={"Authorization": f"Bearer {worker_token}"},
        timeout=RESPONSE_TIMEOUT_S,
    )
    assert heartbeat.status_code == 200, heartbeat.text


def test_an_inference_body_over_its_limit_gets_413_naming_the_setting(caller: Caller) -> None:
    prompt = "word " * (INFERENCE_LIMIT // 5 + 1)
    response = caller.http.post("/v1/completions", json={"model": "a/b/c", "prompt": prompt})
    assert response.status_code == 413, response.text
    assert "SKYTRAIN_MAX_INFERENCE_REQUEST_BYTES" in response.json()["error"]["message"]
    # Under the limit, the same request goes on to be routed (a model that does not exist).
    response = caller.http.post("/v1/completions", json={"model": "a/b/c", "prompt": "word"})
    assert response.status_code == 404, response.text


@pytest.fixture
def impatient_url(control_plane: ControlPlane) -> Iterator[str]:
    """A second control plane on the same database that waits 1 s for a body."""
    settings = control_plane.settings
    server = settings.server.model_copy(update={"request_body_timeout_s": 1.0})
    settings = settings.model_copy(update={"server": server})
    with serve_in_thread(create_app(settings)) as url:
        yield url


@pytest.mark.slow
def test_a_body_trickled_too_slowly_gets_408(impatient_url: str, caller: Caller) -> None:
    for path in ("/v1/models", "/v1/training-jobs", "/v1/chat/completions"):
        answer = _send_head(
            impatient_url,
            _head(path, length=1000, token=caller.key.key),
            b'{"project": ',  # and then nothing more, for longer than the timeout
        )
        assert answer.startswith("HTTP/1.1 408"), answer
        assert "SKYTRAIN_REQUEST_BODY_TIMEOUT_S" in answer or "Content-Length" in answer


def test_a_batch_over_the_trajectory_limit_is_refused_holding_one_group_in_memory(
    caller: Caller, stored: Callable[[Caller], Any]
) -> None:
    """10,000 small trajectories (the limit is 500): the server stops reading at the 6th group
    and never holds the batch as Python objects (it used to hold all of it, 1.45 GB for 60 MB)."""
    model_id = caller.create_model()["id"]
    small = {"messages_and_choices": [{"role": "assistant", "content": "a"}], "reward": 0.0}
    body = json.dumps({"trajectory_groups": [{"trajectories": [small] * 100}] * 100}).encode()
    before = stored(caller)
    tracemalloc.start()
    try:
        response = caller.http.post(
            f"/v1/models/{model_id}/log",
            content=body,
            headers={"content-type": "application/json"},
        )
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert response.status_code == 413, response.text
    assert "more than 500 trajectories" in response.json()["error"]["message"]
    assert stored(caller) == before
    # The body's bytes (twice: spooled, then viewed), the split, and a few groups; the whole
    # batch as objects takes over ten times the body.
    assert peak < 6 * len(body), f"{peak / 1e6:.1f} MB traced for a {len(body) / 1e6:.1f} MB body"


def test_base_models_are_hub_ids_or_paths_inside_the_allowed_directories(
    caller: Caller, control_plane: ControlPlane, stored: Callable[[Caller], Any]
) -> None:
    allowed = control_plane.settings.storage.home / "allowed-models"
    (allowed / "my-model").mkdir(exist_ok=True)
    escape = allowed / "escape"
    if not escape.is_symlink():
        escape.symlink_to("/etc")

    def register(base_model: str) -> httpx.Response:
        return caller.http.post(
            "/v1/models",
            json={"project": "base", "name": f"m{len(base_model)}", "base_model": base_model},
        )

    for name in ("Qwen/Qwen2.5-0.5B-Instruct", "gpt2", str(allowed / "my-model")):
        assert register(name).status_code == 201, name
    tiny = model_cache_dir() / "tiny-smollm2"
    assert register(str(tiny)).json()["base_model"] == str(tiny)
    for name in ("/etc", f"{allowed}/../../etc", str(escape), str(allowed), "../models/x"):
        before = stored(caller)
        response = register(name)
        assert response.status_code == 400, (name, response.text)
        message = response.json()["error"]["message"]
        assert "Hugging Face model id" in message
        # The operator's directories are not the tenant's to see.
        assert str(allowed) not in message.replace(repr(name), "")
        assert str(model_cache_dir()) not in message
        assert stored(caller) == before
    for name in ("org--x/model", "a/b/c", "org/model..", "-org/model", "x" * 97):
        assert register(name).status_code == 400, name


TRACEBACK = """worker process exited with code 1; last lines of /srv/skytrain/workers/w1.log:
Traceback (most recent call last):
  File "/opt/venv/lib/python3.11/site-packages/transformers/modeling_utils.py", line 3, in load
OSError: /etc does not appear to have a file named config.json"""


def test_a_failed_worker_names_the_base_model_without_the_hosts_paths(
    caller: Caller, db_sessions: sessionmaker[Session]
) -> None:
    base = f"test-org/failing-{os.getpid()}"
    with db_sessions() as session:
        row, _ = workers.create_worker(
            session, provider="local", base_model=base, max_models=1, status="failed"
        )
        row.status_message = TRACEBACK
        session.commit()
        worker_id = row.id
    model = caller.create_model(base_model=base, name="fails")
    serving = caller.http.get(f"/v1/models/{model['id']}").json()["serving"]
    assert serving["state"] == "failed"
    assert f"base model {base!r}" in serving["message"]
    assert f"skytrain logs {worker_id}" in serving["message"]
    assert "Traceback" not in serving["message"]
    assert not re.search(r"/(srv|opt|etc)\b", serving["message"])


def test_storage_failures_name_no_paths_or_tenant_ids(
    caller: Caller,
    stored: Callable[[Caller], Any],
    object_store: ObjectStore,
    control_plane: ControlPlane,
) -> None:
    tenant_id = caller.key.tenant_id
    model_id = caller.create_model(name="stored")["id"]
    logged = caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    assert logged.status_code == 201
    batch_id = logged.json()["id"]
    # The batch's object is gone from the store: its log cannot be read.
    object_store.delete(keys.log_key(tenant_id=tenant_id, model_id=model_id, batch_id=batch_id))
    missing = caller.http.get(f"/v1/models/{model_id}/logs/{batch_id}")
    assert missing.status_code == 404
    # A file where the store needs a directory: every write under the model fails.
    root = Path(urlsplit(control_plane.settings.storage.resolved_object_store_url).path)
    blocker = root / keys.model_prefix(tenant_id=tenant_id, model_id=model_id) / "logs"
    shutil.rmtree(blocker, ignore_errors=True)
    blocker.parent.mkdir(parents=True, exist_ok=True)
    blocker.write_text("not a directory")
    before = stored(caller)
    failed = caller.http.post(f"/v1/models/{model_id}/log", json={"trajectory_groups": [group()]})
    assert failed.status_code == 502
    assert stored(caller) == before
    for response in (missing, failed):
        message = response.json()["error"]["message"]
        assert "reference" in message, message
        assert tenant_id not in message and str(root) not in message and "/" not in message

"""Where the control plane reaches a worker, and what it says when it cannot: the worker's
side of ``/v1/worker/register`` and ``/heartbeat`` played over real HTTP against the real
control plane, with a front door over real TLS on loopback (answering ``/health`` only: no
engine is needed to be reached)."""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from skytrain_backend import tls
from skytrain_backend.db import tenants, worker_tokens
from skytrain_backend.db.models import Model, Worker
from skytrain_backend.scheduler import placement
from tests.api.support import group
from tests.fixtures.ports import free_port
from tests.fixtures.services import ApiKey, ControlPlane
from tests.fixtures.tls import serve_tls
from tests.gateway.conftest import wait_until

BASE_MODEL = "tests/registration"
# Its own base model: no other test's worker takes its models.
UNREACHABLE_BASE_MODEL = "tests/unreachable"


def _health_only(secret: str) -> Starlette:
    async def health(request: Request) -> Response:
        ok = request.headers.get("authorization") == f"Bearer {secret}"
        return Response(status_code=200 if ok else 401)

    return Starlette(routes=[Route("/health", health)])


@pytest.fixture
def join(control_plane: ControlPlane, db_sessions: sessionmaker[Session]) -> Iterator[httpx.Client]:
    """A worker's client of the control plane, holding a fresh join token."""
    with db_sessions() as session:
        _, token = worker_tokens.create_join_token(session, name=None, base_model=None)
    with httpx.Client(
        base_url=control_plane.url + "/v1/worker",
        headers={"Authorization": f"Bearer {token}"},
        timeout=60,
    ) as http:
        yield http


def _register(
    http: httpx.Client,
    *,
    secret: str,
    port: int,
    certificate: str,
    base_model: str = BASE_MODEL,
    **extra: Any,
) -> dict[str, Any]:
    response = http.post(
        "/register",
        json={
            "base_model": base_model,
            "served_model_name": base_model,
            "engine_secret": secret,
            "port": port,
            "certificate": certificate,
            "capacity": {"max_models": 2, "max_lora_rank": 64},
            **extra,
        },
    )
    assert response.status_code == 200, response.text
    answer = dict(response.json())
    http.headers["Authorization"] = f"Bearer {answer['worker_token']}"
    return answer


def _row(sessions: sessionmaker[Session], worker_id: str) -> Worker:
    with sessions() as session:
        row = session.get(Worker, worker_id)
        assert row is not None
        return row


def test_a_worker_is_reached_at_the_address_its_registration_came_from(
    join: httpx.Client, db_sessions: sessionmaker[Session]
) -> None:
    secret = secrets.token_urlsafe(24)
    with serve_tls(_health_only(secret)) as door:
        answer = _register(join, secret=secret, port=door.port, certificate=door.certificate)
    assert answer["reachable"] is True and answer["message"] is None
    assert answer["endpoint"] == f"https://127.0.0.1:{door.port}"
    row = _row(db_sessions, answer["worker_id"])
    assert (row.status, row.engine_endpoint) == ("ready", answer["endpoint"])
    assert row.engine_certificate == door.certificate


@dataclass(frozen=True)
class Unreached:
    """A worker registered with an address where nothing listens yet (``.answer``, the
    control plane's answer; ``.address``)."""

    answer: dict[str, Any]
    address: str
    secret: str
    credentials: tuple[str, str]

    @contextmanager
    def front_door_up(self) -> Iterator[None]:
        """Its front door listening at its address, for the block."""
        port = int(self.address.rsplit(":", 1)[1])
        with serve_tls(_health_only(self.secret), port=port, credentials=self.credentials):
            yield


def _register_unreached(join: httpx.Client, base_model: str) -> Unreached:
    secret = secrets.token_urlsafe(24)
    credentials = tls.self_signed_certificate(["127.0.0.1"])
    address = f"https://127.0.0.1:{free_port()}"  # nothing listens there yet
    answer = _register(
        join,
        secret=secret,
        port=8100,
        certificate=credentials[0],
        base_model=base_model,
        advertise_url=address,
    )
    return Unreached(answer=answer, address=address, secret=secret, credentials=credentials)


def test_an_unreachable_worker_says_where_it_was_tried_and_is_routed_to_once_reached(
    join: httpx.Client,
    db_sessions: sessionmaker[Session],
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
) -> None:
    unreached = _register_unreached(join, UNREACHABLE_BASE_MODEL)
    answer, address = unreached.answer, unreached.address
    assert answer["reachable"] is False and answer["endpoint"] == address
    assert address in answer["message"] and "--advertise-url" in answer["message"]
    row = _row(db_sessions, answer["worker_id"])
    assert (row.status, row.status_message) == ("unreachable", answer["message"])

    # Its models wait, told why without the address (the operator's, not the tenant's).
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as user:
        model = user.post(
            "/v1/models",
            json={"project": "reach", "name": "m", "base_model": UNREACHABLE_BASE_MODEL},
        ).json()
        heartbeat = join.post("/heartbeat", json={"status": "ready"})
        assert heartbeat.status_code == 200
        assert _row(db_sessions, answer["worker_id"]).status == "unreachable"
        serving = user.get(f"/v1/models/{model['id']}").json()["serving"]
        assert serving["state"] == "unreachable" and not serving["ready"]
        assert "127.0.0.1" not in serving["message"]
        assert "skytrain workers list" in serving["message"]

        # The front door comes up there: the next heartbeat reaches it, and it serves.
        with unreached.front_door_up():
            assert join.post("/heartbeat", json={"status": "ready"}).status_code == 200
        row = _row(db_sessions, answer["worker_id"])
        assert (row.status, row.status_message) == ("ready", None)
        # The scheduler places the model on it on its next pass.
        wait_until(
            lambda: user.get(f"/v1/models/{model['id']}").json()["serving"]["state"] == "ready",
            what="the model served on the worker once reached",
        )


def test_a_worker_must_register_a_pinnable_certificate_and_an_https_address(
    join: httpx.Client,
) -> None:
    secret = secrets.token_urlsafe(24)
    certificate, _ = tls.self_signed_certificate(["127.0.0.1"])
    base = {
        "base_model": BASE_MODEL,
        "served_model_name": BASE_MODEL,
        "engine_secret": secret,
        "port": 8100,
        "capacity": {"max_models": 1},
    }
    refused = join.post("/register", json={**base, "certificate": "not a certificate"})
    assert refused.status_code == 400
    assert "certificate" in refused.json()["error"]["message"]
    plain = join.post(
        "/register",
        json={**base, "certificate": certificate, "advertise_url": "http://gpu.example.com:8100"},
    )
    assert plain.status_code == 400
    assert "must be an https:// URL" in plain.json()["error"]["message"]


def test_a_worker_checks_its_token_before_it_starts_anything(
    control_plane: ControlPlane, db_sessions: sessionmaker[Session]
) -> None:
    """``GET /v1/worker/check``: what registering would answer, with no worker row made."""
    with db_sessions() as session:
        row, token = worker_tokens.create_join_token(session, name=None, base_model=BASE_MODEL)
        token_id = row.id

    def check(base_model: str, credential: str = token) -> httpx.Response:
        return httpx.get(
            control_plane.url + "/v1/worker/check",
            params={"base_model": base_model},
            headers={"Authorization": f"Bearer {credential}"},
            timeout=60,
        )

    with db_sessions() as session:
        workers_before = session.query(Worker).count()
    assert check(BASE_MODEL).status_code == 204
    other = check("tests/another-model")
    assert other.status_code == 401 and "only joins workers for" in other.text, other.text
    unknown = check(BASE_MODEL, credential="swj-" + "x" * 40)
    assert unknown.status_code == 401 and "unknown join token" in unknown.text, unknown.text
    for bad in ("", "m" * 513):
        refused = check(bad)
        assert refused.status_code == 400 and "base_model" in refused.text, refused.text
    with db_sessions() as session:
        worker_tokens.revoke_join_token(session, id_or_prefix=token_id)
    revoked = check(BASE_MODEL)
    assert revoked.status_code == 401 and "was revoked" in revoked.text, revoked.text
    with db_sessions() as session:
        assert session.query(Worker).count() == workers_before


def test_a_join_token_worker_that_cannot_be_reached_gets_no_model_and_no_job(
    join: httpx.Client,
    db_sessions: sessionmaker[Session],
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
) -> None:
    """Anyone holding a join token can make a worker that advertises an address nobody can
    reach: until the control plane reaches it, no tenant's model is placed on it and it
    leases no job (what it trained could not be served). Once reached, it gets both."""
    base_model = f"tests/unreached-{secrets.token_hex(4)}"
    unreached = _register_unreached(join, base_model)
    answer = unreached.answer
    assert answer["reachable"] is False
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as user:
        model = user.post(
            "/v1/models", json={"project": "reach", "name": "m", "base_model": base_model}
        ).json()
        job = user.post(
            "/v1/training-jobs", json={"model_id": model["id"], "trajectory_groups": [group()]}
        )
        assert job.status_code == 201, job.text

        def place() -> str | None:
            """One placement pass, as the scheduler runs it; where the model is now."""
            with db_sessions() as session:
                placement.place_models(
                    session,
                    idle_timeout_s=control_plane.settings.scheduler.resolved_model_idle_timeout_s,
                    max_workers=0,
                    launch=None,
                    limits=tenants.limits_by_id(session, control_plane.settings),
                )
                return session.get_one(Model, model["id"]).worker_id

        assert place() is None
        assert join.post("/jobs/lease").status_code == 204
        serving = user.get(f"/v1/models/{model['id']}").json()["serving"]
        assert serving["state"] == "unreachable" and "127.0.0.1" not in serving["message"]

        with unreached.front_door_up():
            assert join.post("/heartbeat", json={"status": "ready"}).status_code == 200
        assert place() == answer["worker_id"]
        leased = join.post("/jobs/lease")
        assert leased.status_code == 200, leased.text
        assert leased.json()["job"]["id"] == job.json()["id"]

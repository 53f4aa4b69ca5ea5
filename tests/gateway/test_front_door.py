"""A worker's public port: the real front door (``worker.frontdoor``) over TLS on loopback, in
front of the real CPU engine with the tiny model, reached directly and through the gateway.

What anyone who can reach a worker's port gets: nothing without the engine secret, nothing
but the four inference routes with it, nothing at all over plain HTTP. What the gateway does
with a worker that does not present the certificate it registered: sends it nothing.
"""

from __future__ import annotations

import secrets
from collections.abc import Callable, Iterator

import httpx
import pytest

from skytrain_backend import tls
from skytrain_backend.worker.frontdoor import FrontDoor
from tests.fixtures.services import ServedPlane
from tests.fixtures.tls import TlsServer, serve_tls
from tests.gateway.conftest import Engine, Tenant, add_worker

# Every route the engine itself has besides the four the front door forwards (the CPU engine's
# control routes, and vLLM's dev-mode and admin routes, which its API key does not guard).
CLOSED_ROUTES = [
    ("POST", "/sleep"),
    ("POST", "/wake_up"),
    ("GET", "/is_sleeping"),
    ("GET", "/control_log"),
    ("POST", "/v1/load_lora_adapter"),
    ("POST", "/v1/unload_lora_adapter"),
    ("POST", "/collective_rpc"),
    ("POST", "/pause"),
    ("POST", "/resume"),
    ("POST", "/update_weights"),
    ("POST", "/reset_prefix_cache"),
    ("GET", "/server_info"),
    ("POST", "/tokenize"),
    ("GET", "/metrics"),
    ("GET", "/openapi.json"),
    ("GET", "/docs"),
]


class FrontDoorUnderTest:
    def __init__(self, server: TlsServer, secret: str) -> None:
        self.server = server
        self.secret = secret
        self.http = server.client()

    def call(
        self, method: str, path: str, *, secret: str | None = None, **kwargs: object
    ) -> httpx.Response:
        headers = {"Authorization": f"Bearer {secret}"} if secret is not None else {}
        return self.http.request(method, path, headers=headers, **kwargs)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def front_door(engine: Engine) -> Iterator[FrontDoorUnderTest]:
    secret = secrets.token_urlsafe(24)
    app = FrontDoor(
        engine_url=engine.url,
        engine_api_key=engine.secret,
        secret=secret,
        max_body_bytes=1 << 20,
    )
    with serve_tls(app) as server:
        door = FrontDoorUnderTest(server, secret)
        yield door
        door.http.close()


def _completion(
    front_door: FrontDoorUnderTest, engine: Engine, secret: str | None
) -> httpx.Response:
    body = {"model": engine.served_name, "prompt": "Hello", "max_tokens": 2}
    return front_door.call("POST", "/v1/completions", secret=secret, json=body)


def _engine_control_calls(engine: Engine) -> list[str]:
    log = httpx.get(engine.url + "/control_log", headers=engine.headers, timeout=30)
    assert log.status_code == 200, log.text
    return [entry["call"] for entry in log.json()["data"]]


def test_control_and_dev_mode_routes_are_refused_with_and_without_the_secret(
    front_door: FrontDoorUnderTest, engine: Engine
) -> None:
    calls_before = _engine_control_calls(engine)
    for method, path in CLOSED_ROUTES:
        body = {"lora_name": "x", "lora_path": "/tmp"} if method == "POST" else None
        without = front_door.call(method, path, json=body)
        assert without.status_code == 401, (path, without.text)
        wrong = front_door.call(method, path, secret="not-the-secret", json=body)
        assert wrong.status_code == 401, (path, wrong.text)
        with_secret = front_door.call(method, path, secret=front_door.secret, json=body)
        assert with_secret.status_code == 404, (path, with_secret.text)
        assert f"{method} {path} not found" in with_secret.json()["error"]["message"]
    # None of it reached the engine: it never slept, loaded or unloaded anything, and serves.
    assert _engine_control_calls(engine) == calls_before
    assert _completion(front_door, engine, front_door.secret).status_code == 200


def test_inference_needs_the_secret_and_gets_the_engines_answer(
    front_door: FrontDoorUnderTest, engine: Engine
) -> None:
    assert _completion(front_door, engine, None).status_code == 401
    assert _completion(front_door, engine, "not-the-secret").status_code == 401
    assert _completion(front_door, engine, engine.secret).status_code == 401  # the engine's own
    answer = _completion(front_door, engine, front_door.secret)
    assert answer.status_code == 200
    assert answer.json()["choices"][0]["text"]
    models = front_door.call("GET", "/v1/models", secret=front_door.secret)
    assert models.json()["data"][0]["id"] == engine.served_name
    assert front_door.call("GET", "/health", secret=front_door.secret).status_code == 200
    assert front_door.call("GET", "/health").status_code == 401


def test_streams_pass_through_event_by_event(
    front_door: FrontDoorUnderTest, engine: Engine
) -> None:
    body = {
        "model": engine.served_name,
        "messages": [{"role": "user", "content": "Hi"}],
        "max_tokens": 4,
        "stream": True,
    }
    headers = {"Authorization": f"Bearer {front_door.secret}"}
    with front_door.http.stream("POST", "/v1/chat/completions", json=body, headers=headers) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        events = [line for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]" and len(events) >= 3


def test_plain_http_gets_no_answer(front_door: FrontDoorUnderTest) -> None:
    plain = front_door.server.url.replace("https://", "http://")
    with pytest.raises(httpx.HTTPError):
        httpx.get(plain + "/health", headers={"Authorization": f"Bearer {front_door.secret}"})


def test_a_certificate_other_than_the_pinned_one_is_refused_before_anything_is_sent(
    front_door: FrontDoorUnderTest,
) -> None:
    other, _ = tls.self_signed_certificate(["127.0.0.1"])
    assert tls.probe(front_door.server.url, certificate_pem=other, secret=front_door.secret)
    problem = tls.probe(
        front_door.server.url,
        certificate_pem=front_door.server.certificate,
        secret=front_door.secret,
    )
    assert problem is None


@pytest.mark.slow
def test_the_gateway_refuses_a_worker_whose_certificate_is_not_the_registered_one(
    tenant: Callable[[], Tenant],
    gateway_plane: ServedPlane,
    front_door: FrontDoorUnderTest,
    engine: Engine,
) -> None:
    alice = tenant()
    other, _ = tls.self_signed_certificate(["127.0.0.1"])
    impostor = add_worker(
        gateway_plane.sessions,
        base_model="tests/impostor",
        engine_endpoint=front_door.server.url,
        engine_secret=front_door.secret,
        served_model_name=engine.served_name,
        engine_certificate=other,
    )
    name = alice.create_model(base_model="tests/impostor", worker_id=impostor)["inference_name"]
    response = alice.chat(name)
    assert response.status_code == 502
    message = response.json()["error"]["message"]
    assert f"worker {impostor} did not present the certificate it registered" in message
    assert str(front_door.server.port) not in message

    genuine = add_worker(
        gateway_plane.sessions,
        base_model="tests/genuine",
        engine_endpoint=front_door.server.url,
        engine_secret=front_door.secret,
        served_model_name=engine.served_name,
        engine_certificate=front_door.server.certificate,
    )
    name = alice.create_model(base_model="tests/genuine", worker_id=genuine)["inference_name"]
    answer = alice.chat(name)
    assert answer.status_code == 200, answer.text
    assert answer.headers["x-skytrain-worker"] == genuine


def test_the_gateway_sends_nothing_to_a_remote_worker_without_a_certificate(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane, engine: Engine
) -> None:
    alice = tenant()
    remote = add_worker(
        gateway_plane.sessions,
        base_model="tests/no-certificate",
        engine_endpoint="http://203.0.113.9:8100",  # TEST-NET-3: never routed anywhere
        engine_secret=engine.secret,
        served_model_name=engine.served_name,
    )
    name = alice.create_model(base_model="tests/no-certificate", worker_id=remote)["inference_name"]
    response = alice.chat(name)
    assert response.status_code == 502
    assert "registered no TLS certificate" in response.json()["error"]["message"]


def test_the_cpu_engines_control_routes_need_its_key(engine: Engine) -> None:
    calls_before = _engine_control_calls(engine)  # the engine is shared by the module's tests
    for method, path in [("POST", "/sleep"), ("POST", "/wake_up"), ("GET", "/control_log")]:
        refused = httpx.request(method, engine.url + path, timeout=30)
        assert refused.status_code == 401, (path, refused.text)
    assert _engine_control_calls(engine) == calls_before
    answer = engine.post(
        "/v1/completions", {"model": engine.served_name, "prompt": "Hi", "max_tokens": 2}
    )
    assert answer.status_code == 200

"""Backend: configuration, authentication, error mapping, retries and pagination.

Every request goes to the real control plane. Errors are ones the real server gives to real
requests; the faults a network or a load balancer causes (dropped connections, 502/503/429
pages, stalls, answers lost on the way back) come from ``FaultProxy`` in front of it.
"""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import httpx
import pytest

import skytrain
from skytrain import _backend
from tests.client.faults import Answer, Drop, FaultProxy, LoseAnswer, Stall, eventually
from tests.client.server_side import sampled_group
from tests.fixtures.services import ApiKey, ControlPlane

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def test_backend_reads_url_and_key_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYTRAIN_BASE_URL", "https://train.example.com/v1/")
    monkeypatch.setenv("SKYTRAIN_API_KEY", "sk-st-from-env")
    backend = skytrain.Backend()
    assert backend.base_url == "https://train.example.com"
    assert backend.api_key == "sk-st-from-env"


def test_backend_defaults_to_the_local_server(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYTRAIN_BASE_URL", raising=False)
    backend = skytrain.Backend(api_key="sk-st-x")
    assert backend.base_url == "http://127.0.0.1:8000"


def test_backend_without_a_key_says_how_to_get_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYTRAIN_API_KEY", raising=False)
    with pytest.raises(skytrain.ConfigurationError, match="SKYTRAIN_API_KEY"):
        skytrain.Backend("http://127.0.0.1:8000")


def test_backend_refuses_a_url_that_is_not_http() -> None:
    with pytest.raises(skytrain.ConfigurationError, match="not an http"):
        skytrain.Backend("127.0.0.1:8000", "sk-st-x")


def test_backend_repr_hides_the_key() -> None:
    assert "sk-st-secret" not in repr(skytrain.Backend("http://127.0.0.1:8000", "sk-st-secret"))


async def test_requests_carry_the_bearer_key_and_a_user_agent(
    proxy: FaultProxy, key: ApiKey, backend: skytrain.Backend
) -> None:
    page = await backend._get("/v1/models")
    assert page["data"] == []  # the real server took the key: a fresh tenant has no models
    (request,) = proxy.seen("GET", "/v1/models")
    assert request.headers["authorization"] == f"Bearer {key.key}"
    assert request.headers["user-agent"] == f"skytrain-python/{skytrain.__version__}"


# --- errors the real server gives -------------------------------------------------------------


@dataclass(frozen=True)
class Refused:
    """A request the control plane refuses, and what the SDK must make of it."""

    error_class: type[skytrain.APIError]
    also: type[Exception]  # a class the error must also be
    status: int
    phrase: str  # a part of the server's message
    method: str
    path: Callable[[skytrain.TrainableModel], str]
    body: Callable[[skytrain.TrainableModel], Any] = lambda _: None


REFUSED = {
    "400 a body missing fields": Refused(
        skytrain.InvalidRequestError,
        ValueError,
        400,
        "project: Field required",
        "POST",
        lambda _: "/v1/models",
        lambda _: {"name": "agent"},
    ),
    "401 an unknown key": Refused(
        skytrain.AuthenticationError,
        PermissionError,
        401,
        "the API key is not valid",
        "GET",
        lambda _: "/v1/models",
    ),
    "404 an unknown model": Refused(
        skytrain.NotFoundError,
        LookupError,
        404,
        "model 'mdl_unknown' not found",
        "GET",
        lambda _: "/v1/models/mdl_unknown",
    ),
    "405 a method the route lacks": Refused(
        skytrain.APIError, Exception, 405, "method not allowed", "PATCH", lambda _: "/v1/models"
    ),
    "409 a name taken with another base model": Refused(
        skytrain.ConflictError,
        Exception,
        409,
        f"exists with base model {BASE_MODEL!r}, not 'other/base'",
        "POST",
        lambda _: "/v1/models",
        lambda m: (
            {"project": m.project, "name": m.name, "base_model": "other/base"}
            | {"return_existing": True}
        ),
    ),
    "413 a body over the server's limit": Refused(
        skytrain.InvalidRequestError,
        ValueError,
        413,
        "over the limit of 1048576 bytes (SKYTRAIN_MAX_REQUEST_BYTES)",
        "POST",
        lambda m: f"/v1/models/{m.id}/log",
        lambda _: {"split": "val", "trajectory_groups": [], "padding": "x" * 1024 * 1024},
    ),
    "503 a model no worker serves yet": Refused(
        skytrain.ServiceUnavailableError,
        skytrain.ServerError,
        503,
        f"waiting for a worker for {BASE_MODEL} to be placed on",
        "POST",
        lambda _: "/v1/chat/completions",
        lambda m: {
            "model": m.get_inference_name(),
            "messages": [{"role": "user", "content": "hi"}],
        },
    ),
}


@pytest.mark.parametrize("case", list(REFUSED.values()), ids=list(REFUSED))
async def test_a_refusal_maps_to_its_class_with_the_servers_message(
    control_plane: ControlPlane, proxy: FaultProxy, key: ApiKey, case: Refused
) -> None:
    async with skytrain.Backend(control_plane.url, key.key) as owner:
        model = skytrain.TrainableModel(name="agent", project="errors", base_model=BASE_MODEL)
        await model.register(owner, wait=False)
    sent_key = "sk-st-not-a-key" if case.status == 401 else key.key
    path, body = case.path(model), case.body(model)

    async with skytrain.Backend(proxy.url, sent_key, max_retries=2) as backend:
        with pytest.raises(case.error_class) as caught:
            await backend._send(case.method, path, json=body)

    # What the server answers the same request sent without the SDK.
    async with httpx.AsyncClient(base_url=control_plane.url) as http:
        raw = await http.request(
            case.method, path, json=body, headers={"Authorization": f"Bearer {sent_key}"}
        )
    error = caught.value
    assert raw.status_code == error.status_code == case.status
    assert type(error) is case.error_class
    assert isinstance(error, case.also)
    assert str(error) == error.message == raw.json()["error"]["message"]
    assert case.phrase in str(error)
    assert error.type == raw.json()["error"]["type"]
    if case.status == 503:
        assert error.retry_after == float(raw.headers["retry-after"]) > 0
    else:
        assert error.retry_after is None
    # Sent once: refusals are final, and a POST is not sent twice even on a 503.
    assert len(proxy.seen(case.method, f"^{path}$")) == 1


# --- faults between the SDK and the server ------------------------------------------------------


async def test_a_load_balancers_error_page_stays_readable(proxy: FaultProxy, key: ApiKey) -> None:
    page = "<html><body><h1>502 Bad Gateway</h1>nginx</body></html>"
    proxy.fault("GET", "^/v1/models$", Answer(502, page, content_type="text/html"))
    async with skytrain.Backend(proxy.url, key.key, max_retries=0) as backend:
        with pytest.raises(skytrain.ServerError) as caught:
            await backend._get("/v1/models")
    assert type(caught.value) is skytrain.ServerError
    assert caught.value.status_code == 502
    assert caught.value.type == "http_error"
    assert str(caught.value).startswith(f"HTTP 502 from {proxy.url}/v1/models")
    assert str(caught.value).endswith(f": {page}")


@pytest.mark.parametrize(
    ("status", "error_class", "retry_after"),
    [
        (429, skytrain.RateLimitError, "3"),
        (503, skytrain.ServiceUnavailableError, "7"),
        (502, skytrain.ServerError, None),
        (504, skytrain.ServerError, None),
    ],
)
async def test_a_busy_answer_is_retried_and_carries_retry_after(
    proxy: FaultProxy,
    key: ApiKey,
    status: int,
    error_class: type[skytrain.APIError],
    retry_after: str | None,
) -> None:
    headers = {"Retry-After": retry_after} if retry_after else {}
    proxy.fault("GET", "^/v1/models$", Answer(status, "busy", headers))
    async with skytrain.Backend(proxy.url, key.key, max_retries=2) as backend:
        with pytest.raises(error_class) as caught:
            await backend._get("/v1/models")
    assert type(caught.value) is error_class
    assert caught.value.status_code == status
    assert caught.value.retry_after == (float(retry_after) if retry_after else None)
    assert len(proxy.seen("GET", "^/v1/models$")) == 3  # the first try and two retries


async def test_get_is_retried_through_busy_answers_until_the_server_answers(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    model = skytrain.TrainableModel(name="agent", project="retries", base_model=BASE_MODEL)
    await model.register(backend, wait=False)
    path = f"^/v1/models/{model.id}$"
    proxy.fault("GET", path, Answer(503, "busy", {"Retry-After": "7"}), times=1)
    proxy.fault("GET", path, Answer(429, "slow down", {"Retry-After": "1"}), times=1)
    proxy.fault("GET", path, Answer(502, "bad gateway"), times=1)
    got = await backend._get(f"/v1/models/{model.id}")
    assert got["id"] == model.id
    assert got["inference_name"] == model.get_inference_name()
    assert [s.fault is None for s in proxy.seen("GET", path)] == [False, False, False, True]


async def test_get_is_retried_after_the_connection_drops(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    proxy.fault("GET", "^/v1/models$", Drop(), times=2)
    assert (await backend._get("/v1/models"))["data"] == []
    assert [s.fault for s in proxy.seen("GET", "^/v1/models$")] == [Drop(), Drop(), None]


async def test_get_gives_up_when_every_connection_drops(proxy: FaultProxy, key: ApiKey) -> None:
    proxy.fault("GET", "^/v1/models$", Drop())
    async with skytrain.Backend(proxy.url, key.key, max_retries=3) as backend:
        with pytest.raises(skytrain.APIConnectionError, match="could not reach") as caught:
            await backend._get("/v1/models")
    assert isinstance(caught.value, ConnectionError)
    assert not isinstance(caught.value, TimeoutError)
    assert len(proxy.seen("GET", "^/v1/models$")) == 4


@pytest.fixture
def closed_port() -> Iterator[socket.socket]:
    """A loopback port bound but not listening: connecting to it is refused."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.bind(("127.0.0.1", 0))
    yield sock
    sock.close()


@pytest.fixture
def retry_delays(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The attempt numbers the SDK computed a retry delay for (one per retry)."""
    attempts: list[int] = []
    compute = _backend._retry_delay_s

    def record(attempt: int, error: Exception) -> float:
        attempts.append(attempt)
        return compute(attempt, error)

    monkeypatch.setattr(_backend, "_retry_delay_s", record)
    return attempts


async def test_nothing_listening_gives_up_after_max_retries_naming_the_server(
    closed_port: socket.socket, retry_delays: list[int]
) -> None:
    host, port = closed_port.getsockname()
    async with skytrain.Backend(f"http://{host}:{port}", "sk-st-x", max_retries=2) as backend:
        with pytest.raises(skytrain.APIConnectionError) as caught:
            await backend._get("/v1/models")
    assert f"could not reach the skytrain server at http://{host}:{port}" in str(caught.value)
    assert "is `skytrain serve` running there?" in str(caught.value)
    assert isinstance(caught.value.__cause__, httpx.ConnectError)
    assert retry_delays == [0, 1]


async def test_a_server_that_starts_listening_late_is_reached_by_a_retry(
    control_plane: ControlPlane,
    key: ApiKey,
    closed_port: socket.socket,
    retry_delays: list[int],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The first try is refused; the server (a proxy to the control plane) starts listening
    on that port while the SDK waits to retry, and the retry reaches it."""
    late = FaultProxy(control_plane.url, sock=closed_port)
    compute = _backend._retry_delay_s

    def start_then_wait(attempt: int, error: Exception) -> float:
        assert isinstance(error, skytrain.APIConnectionError)
        late.start()
        return compute(attempt, error)

    monkeypatch.setattr(_backend, "_retry_delay_s", start_then_wait)
    try:
        async with skytrain.Backend(late.url, key.key) as backend:
            assert (await backend._get("/v1/models"))["data"] == []
        assert len(late.seen("GET", "^/v1/models$")) == 1  # the refused try never arrived
    finally:
        late.stop()


async def test_get_is_not_retried_on_a_client_error(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    with pytest.raises(skytrain.NotFoundError):
        await backend._get("/v1/models/mdl_unknown")
    assert len(proxy.seen("GET", "^/v1/models/mdl_unknown$")) == 1


async def test_a_timeout_is_a_builtin_timeout_error_and_is_retried(
    proxy: FaultProxy, key: ApiKey
) -> None:
    proxy.fault("GET", "^/v1/models$", Stall())
    async with skytrain.Backend(proxy.url, key.key, timeout=0.2, max_retries=1) as backend:
        with pytest.raises(TimeoutError, match=r"no answer from \S+ within 0\.2 s") as caught:
            await backend._get("/v1/models")
    assert isinstance(caught.value, skytrain.APITimeoutError)
    await eventually(lambda: len(proxy.seen("GET", "^/v1/models$")) >= 2, "the retry to arrive")
    assert len(proxy.seen("GET", "^/v1/models$")) == 2


async def test_a_stalled_request_is_retried_and_then_answered(
    proxy: FaultProxy, key: ApiKey
) -> None:
    proxy.fault("GET", "^/v1/models$", Stall(), times=1)
    async with skytrain.Backend(proxy.url, key.key, timeout=0.5, max_retries=1) as backend:
        assert (await backend._get("/v1/models"))["data"] == []
    assert [s.fault for s in proxy.seen("GET", "^/v1/models$")] == [Stall(), None]


async def _jobs_of(backend: skytrain.Backend, model: skytrain.TrainableModel) -> list[Any]:
    page = await backend._get("/v1/training-jobs", params={"model_id": model.id})
    return list(page["data"])


async def test_post_creating_a_job_is_never_retried(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    model = skytrain.TrainableModel(name="agent", project="retries", base_model=BASE_MODEL)
    await model.register(backend, wait=False)

    proxy.fault("POST", "^/v1/training-jobs$", Answer(503, "queue full"), times=1)
    with pytest.raises(skytrain.ServiceUnavailableError, match="queue full"):
        await model.train([sampled_group(0.0, 1.0)], progress=False)
    assert len(proxy.seen("POST", "^/v1/training-jobs$")) == 1
    assert await _jobs_of(backend, model) == []

    # The server creates the job, but its answer is lost: sending again would train twice.
    proxy.fault("POST", "^/v1/training-jobs$", LoseAnswer(), times=1)
    with pytest.raises(skytrain.APIConnectionError, match="could not reach"):
        await model.train([sampled_group(0.0, 1.0)], progress=False)
    assert len(proxy.seen("POST", "^/v1/training-jobs$")) == 2
    (job,) = await _jobs_of(backend, model)
    assert job["status"] == "queued"


async def test_registering_is_retried_because_it_returns_the_existing_model(
    proxy: FaultProxy, key: ApiKey, backend: skytrain.Backend
) -> None:
    # The server creates the model, but its answer is lost; the retry finds it.
    proxy.fault("POST", "^/v1/models$", LoseAnswer(), times=1)
    model = skytrain.TrainableModel(name="agent", project="retries", base_model=BASE_MODEL)
    await model.register(backend, wait=False)
    assert [s.fault for s in proxy.seen("POST", "^/v1/models$")] == [LoseAnswer(), None]
    (only,) = (await backend._get("/v1/models", params={"project": "retries"}))["data"]
    assert model.id == only["id"]
    assert model.entity == key.tenant_name


async def test_pagination_follows_the_cursor_until_has_more_is_false(
    proxy: FaultProxy, backend: skytrain.Backend, monkeypatch: pytest.MonkeyPatch
) -> None:
    ids = []
    for name in ("a", "b", "c", "d", "e"):
        model = skytrain.TrainableModel(name=name, project="pages", base_model=BASE_MODEL)
        await model.register(backend, wait=False)
        ids.append(model.id)
    monkeypatch.setattr(_backend, "_PAGE_SIZE", 2)

    items = [item async for item in backend._paginate("/v1/models", params={"order": "asc"})]

    assert [item["id"] for item in items] == ids
    pages = proxy.seen("GET", "^/v1/models$")
    assert [page.query.get("after") for page in pages] == [None, ids[1], ids[3]]
    assert all(page.query["order"] == "asc" and page.query["limit"] == "2" for page in pages)

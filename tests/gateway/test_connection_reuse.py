"""The gateway keeps its connections to an engine and reuses them: sequential requests share
one, and C requests at once keep to about C, instead of a new connection per request. A request
counts as in flight to its engine until its answer is closed, which gives the connection back
(or drops it): it must leave that count however it ends: a caller leaving mid-stream or before
the answer, an engine failing mid-stream.

The engine here is a small engine-like HTTP server in this process (``CountingEngine``) that
answers at once, or as the prompt tells it to misbehave, and notes the client port of every
request: each port is one TCP connection the gateway opened to it.
"""

from __future__ import annotations

import asyncio
import json
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field

import aiohttp
import anyio
import httpx
import pytest
from fastapi import FastAPI
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from skytrain_backend.api.gateway.upstream import EnginePool
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import (
    TENANT_LIMIT,
    Tenant,
    add_worker,
    serve_in_thread,
    wait_until,
)

# How connections are pooled does not depend on the database: SQLite only.
pytestmark = pytest.mark.parametrize("gateway_settings", ["sqlite"], indirect=True)

BASE_MODEL = "tests/counting-engine"
SERVED_NAME = "counting-base"
SEQUENTIAL = 24
# Tenants sending at once, each with as many clients as its limit lets in flight.
TENANTS = 4
CONCURRENCY = TENANTS * TENANT_LIMIT
REQUESTS_PER_CLIENT = 8
REFUSED = "Refuse this."
# A stream's first event, then nothing more until the caller (the gateway) leaves.
HELD = "Hold this."
# No answer at all, not even its status line, until the caller leaves.
STALLED = "Stall this."
# A stream's first event, then, a moment later, the engine fails and drops the connection.
BROKEN = "Break this."
# A whole answer that is not JSON (NaN is Python's, not JSON's).
GARBLED = "Garble this."
# An answer that sets a cookie, as a server behind a worker's front door might.
COOKIE = "Set a cookie."
# A redirect elsewhere (to the engine's own /elsewhere, which counts what reaches it).
REDIRECT = "Redirect this."


@dataclass
class CountingEngine:
    """Answers chat completions as an engine would (a stream when asked, a 400 when told to
    refuse, or misbehaving as the prompt says) and notes the client port of each request."""

    secret: str = field(default_factory=lambda: secrets.token_urlsafe(16))
    ports: set[int] = field(default_factory=set)
    requests: int = 0
    # Requests of the STALLED prompt that arrived and are left unanswered.
    stalled: int = 0
    # The Cookie header of each request (None when it had none).
    cookies: list[str | None] = field(default_factory=list)
    # Requests that reached /elsewhere.
    elsewhere: int = 0

    def app(self) -> Starlette:
        return Starlette(
            routes=[
                Route("/v1/chat/completions", self._chat, methods=["POST"]),
                Route("/elsewhere", self._elsewhere, methods=["GET", "POST"]),
            ]
        )

    async def _elsewhere(self, _request: Request) -> Response:
        self.elsewhere += 1
        return JSONResponse({"model": "elsewhere", "choices": []})

    async def _chat(self, request: Request) -> Response:
        assert request.client is not None
        self.ports.add(request.client.port)
        self.requests += 1
        self.cookies.append(request.headers.get("cookie"))
        if request.headers.get("authorization") != f"Bearer {self.secret}":
            return JSONResponse({"error": {"message": "wrong key"}}, status_code=401)
        body = await request.json()
        prompt = body["messages"][0]["content"]
        if prompt == REFUSED:
            return JSONResponse({"error": {"message": "this prompt is refused"}}, 400)
        if prompt == GARBLED:
            return Response('{"choices": [{"logprob": NaN}]}', media_type="application/json")
        if prompt == REDIRECT:
            return Response(status_code=307, headers={"Location": "/elsewhere"})
        if prompt == COOKIE:
            cookied = JSONResponse({"choices": []})
            cookied.set_cookie("session", "of-the-first-caller")
            return cookied
        if prompt == STALLED:
            self.stalled += 1
            while (await request.receive())["type"] != "http.disconnect":
                pass
            return Response(status_code=499)
        answer = {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "model": body["model"],
            "prompt_token_ids": [1, 2],
            "choices": [
                {"index": 0, "message": {"role": "assistant", "content": "Hi"}, "logprobs": None}
            ],
        }
        if not body.get("stream"):
            return JSONResponse(answer)

        async def events() -> AsyncIterator[str]:
            yield f"data: {json.dumps(answer)}\n\n"
            if prompt == HELD:
                await anyio.sleep_forever()  # cancelled when the caller leaves
            if prompt == BROKEN:
                # A moment later: what arrives with the broken connection itself may be lost
                # (aiohttp drops what it had not handed out when the connection breaks).
                await anyio.sleep(0.2)
                raise RuntimeError("the engine failed mid-stream")
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")


@pytest.fixture
def counting_engine() -> Iterator[tuple[CountingEngine, str]]:
    """A fresh one per test: what one test counts is its own."""
    engine = CountingEngine()
    with serve_in_thread(engine.app()) as url:
        yield engine, url


@pytest.fixture
def counting_worker(gateway_plane: ServedPlane, counting_engine: tuple[CountingEngine, str]) -> str:
    """A worker whose engine is ``counting_engine``: its id."""
    engine, url = counting_engine
    return add_worker(
        gateway_plane.sessions,
        base_model=BASE_MODEL,
        engine_endpoint=url,
        engine_secret=engine.secret,
        served_model_name=SERVED_NAME,
    )


def test_sequential_requests_share_one_connection_and_concurrent_ones_keep_to_their_number(
    tenant: Callable[[], Tenant],
    counting_engine: tuple[CountingEngine, str],
    counting_worker: str,
) -> None:
    engine, _ = counting_engine
    callers = [tenant() for _ in range(TENANTS)]
    names = [
        who.create_model(base_model=BASE_MODEL, worker_id=counting_worker)["inference_name"]
        for who in callers
    ]
    alice, name = callers[0], names[0]

    # Answers, streams and refusals alike give their connection back once they end.
    for index in range(SEQUENTIAL):
        if index % 3 == 0:
            with alice.http.stream(
                "POST",
                "/v1/chat/completions",
                json={
                    "model": name,
                    "messages": [{"role": "user", "content": "Hi"}],
                    "stream": True,
                },
            ) as stream:
                assert stream.status_code == 200
                assert any(line.startswith("data: {") for line in stream.iter_lines())
        elif index % 3 == 1:
            assert alice.chat(name).status_code == 200
        else:
            refused = alice.chat(name, messages=[{"role": "user", "content": REFUSED}])
            assert refused.status_code == 400, refused.text
    assert engine.requests == SEQUENTIAL
    # One connection, or two if the machine stalled past the pool's 2 s idle expiry once.
    assert len(engine.ports) <= 2, (
        f"{SEQUENTIAL} sequential requests opened {len(engine.ports)} connections"
    )
    sequential_ports = set(engine.ports)

    async def send(who: Tenant, model: str) -> None:
        headers = {"Authorization": f"Bearer {who.key}"}
        async with httpx.AsyncClient(base_url=who.url, headers=headers, timeout=120) as http:

            async def client() -> None:
                for _ in range(REQUESTS_PER_CLIENT):
                    response = await http.post(
                        "/v1/chat/completions",
                        json={"model": model, "messages": [{"role": "user", "content": "Hi"}]},
                    )
                    assert response.status_code == 200, response.text

            await asyncio.gather(*(client() for _ in range(TENANT_LIMIT)))

    async def flood() -> None:
        await asyncio.gather(*(send(who, model) for who, model in zip(callers, names, strict=True)))

    asyncio.run(flood())
    sent = CONCURRENCY * REQUESTS_PER_CLIENT
    assert engine.requests == SEQUENTIAL + sent
    # At most C in flight, each on a connection of its own, kept for the next request (one
    # more for a stall past the idle expiry).
    opened = len(set(engine.ports) - sequential_ports)
    assert opened <= CONCURRENCY + 1, (
        f"{sent} requests from {CONCURRENCY} clients at once opened {opened} connections"
    )


IDLE, ONE = 0, 1  # requests in flight to the engine


@dataclass
class Counted:
    """A model on the counting engine's worker, and the gateway's requests in flight to
    engines on loopback (where every test's engine is)."""

    caller: Tenant
    model: str
    app: FastAPI
    engine: CountingEngine

    def in_flight(self) -> int:
        return int(self.app.state.gateway.engines.http.in_flight)

    def body(self, prompt: str, *, stream: bool) -> dict[str, object]:
        return {
            "model": self.model,
            "messages": [{"role": "user", "content": prompt}],
            "stream": stream,
        }


@pytest.fixture
def counted(
    tenant: Callable[[], Tenant],
    gateway_plane: ServedPlane,
    counting_engine: tuple[CountingEngine, str],
    counting_worker: str,
) -> Counted:
    caller = tenant()
    model = caller.create_model(base_model=BASE_MODEL, worker_id=counting_worker)["inference_name"]
    counted = Counted(caller, model, gateway_plane.app, counting_engine[0])
    wait_until(lambda: counted.in_flight() == IDLE, what="the gateway's earlier requests ending")
    return counted


def test_a_stream_the_caller_leaves_midway_leaves_the_in_flight_count(counted: Counted) -> None:
    with counted.caller.http.stream(
        "POST", "/v1/chat/completions", json=counted.body(HELD, stream=True)
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping it would close the stream
        assert next(lines).startswith("data: {")
        assert counted.in_flight() == ONE

    wait_until(lambda: counted.in_flight() == IDLE, what="the abandoned stream counted out")


def test_a_request_the_caller_leaves_before_the_answer_leaves_the_in_flight_count(
    counted: Counted,
) -> None:
    engine = counted.engine
    stalled_before = engine.stalled

    async def leave_before_the_answer() -> None:
        headers = {"Authorization": f"Bearer {counted.caller.key}"}
        async with httpx.AsyncClient(
            base_url=counted.caller.url, headers=headers, timeout=120
        ) as http:
            request = asyncio.create_task(
                http.post("/v1/chat/completions", json=counted.body(STALLED, stream=False))
            )
            while engine.stalled == stalled_before:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.05)
            assert counted.in_flight() == ONE
            request.cancel()  # the caller gives up and closes its connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(leave_before_the_answer())

    wait_until(lambda: counted.in_flight() == IDLE, what="the abandoned request counted out")


def test_a_stream_the_engine_breaks_off_leaves_the_in_flight_count(counted: Counted) -> None:
    with counted.caller.http.stream(
        "POST", "/v1/chat/completions", json=counted.body(BROKEN, stream=True)
    ) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert len(events) == 2
    assert "the engine broke off the stream" in events[-1]

    wait_until(lambda: counted.in_flight() == IDLE, what="the broken stream counted out")


def test_an_answer_that_is_not_json_is_a_502_naming_it_and_leaves_the_in_flight_count(
    counted: Counted,
) -> None:
    answer = counted.caller.http.post(
        "/v1/chat/completions", json=counted.body(GARBLED, stream=False)
    )
    assert answer.status_code == 502
    assert "answered what is not JSON" in answer.json()["error"]["message"]

    wait_until(lambda: counted.in_flight() == IDLE, what="the garbled answer counted out")


def test_a_cookie_an_engine_sets_is_never_sent_with_a_later_request(counted: Counted) -> None:
    engine = counted.engine
    cookied = counted.caller.chat(counted.model, messages=[{"role": "user", "content": COOKIE}])
    assert cookied.status_code == 200, cookied.text
    assert counted.caller.chat(counted.model).status_code == 200  # on the same connection
    assert engine.cookies[-2:] == [None, None]


def test_an_engines_redirect_is_not_followed_but_refused(counted: Counted) -> None:
    engine = counted.engine
    answer = counted.caller.chat(counted.model, messages=[{"role": "user", "content": REDIRECT}])
    assert answer.status_code == 502, answer.text
    assert "redirect (307)" in answer.json()["error"]["message"]
    assert engine.elsewhere == 0  # neither the body nor the engine secret went there
    wait_until(lambda: counted.in_flight() == IDLE, what="the redirect counted out")


def test_answers_being_read_when_the_engines_client_closes_fail_instead_of_hanging(
    counting_engine: tuple[CountingEngine, str],
    gateway_settings: object,  # the module's parametrization; no gateway needed here
) -> None:
    """What ``forget_worker`` (a worker gone, or back with a new certificate) and the control
    plane's shutdown do to the requests still reading from that worker."""
    engine, url = counting_engine

    async def scenario() -> tuple[str, int]:
        client = EnginePool()
        body = {"model": SERVED_NAME, "messages": [{"role": "user", "content": HELD}]}
        headers = {"Authorization": f"Bearer {engine.secret}"}
        streamed = await client.post(
            f"{url}/v1/chat/completions",
            body=json.dumps({**body, "stream": True}).encode(),
            headers=headers,
        )
        lines = streamed.lines()
        first = await anext(lines)
        await client.aclose()

        async def rest() -> list[str]:
            return [line async for line in lines]

        with pytest.raises(aiohttp.ClientConnectionError):  # not a wait for ever
            await asyncio.wait_for(rest(), timeout=60)
        streamed.close()
        return first, client.in_flight

    first, in_flight = asyncio.run(scenario())
    assert first.startswith("data: {")
    assert in_flight == 0

"""A caller that goes away cancels the engine's work: the gateway closes the upstream request
and the engine stops generating for it. Streams reach the caller while the engine is still
generating (nothing is buffered on the way).

The engine here is the real CPU engine and its HTTP server, run in this process so that the
test can see what the engine is doing: ``WatchedEngine`` only counts the generations running
and the tokens each produced, ``DisconnectWatch`` notes the requests whose client (the
gateway) went away before the answer was complete.
"""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import AsyncIterator, Callable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from skytrain_backend.engine.hf.engine import HFEngine
from skytrain_backend.engine.hf.server import create_app as create_engine_app
from tests.fixtures.services import ServedPlane
from tests.gateway.conftest import (
    TENANT_LIMIT,
    Tenant,
    add_engine_worker,
    add_worker,
    open_stream,
    run_engine,
    serve_in_thread,
    wait_until,
)

MAX_TOKENS = 3000
BASE_MODEL = "tests/watched-engine"
# Events with 20 top logprobs fill the socket buffers long before MAX_TOKENS are sampled, so
# an unread stream holds the engine's response open until the caller reads or leaves.
LONG_STREAM = {
    "messages": [{"role": "user", "content": "Tell a long story."}],
    "max_tokens": MAX_TOKENS,
    "ignore_eos": True,
    "top_logprobs": 20,
    "stream": True,
}
# Long enough to still be generating when the caller gives up a moment after it started.
ABANDONED = {
    "messages": [{"role": "user", "content": "Tell a story."}],
    "max_tokens": 400,
    "ignore_eos": True,
}


class WatchedEngine(HFEngine):
    """The CPU engine, counting running generations and the tokens each one produced."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.running = 0
        self.produced: list[int] = []

    async def generate(self, *args: Any, **kwargs: Any) -> AsyncIterator[Any]:  # type: ignore[override]
        self.running += 1
        produced = 0
        try:
            async for update in super().generate(*args, **kwargs):
                produced += 1
                yield update
        finally:
            self.running -= 1
            self.produced.append(produced)


class DisconnectWatch:
    """ASGI wrapper counting requests whose client disconnected before the response ended."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app
        self.disconnected = 0

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        body: list[Message] = []
        while not body or body[-1].get("more_body", False):
            body.append(await receive())
        answered = False

        async def replay() -> Message:
            return body.pop(0) if body else await receive()

        async def note_end(message: Message) -> None:
            nonlocal answered
            answered = answered or (
                message["type"] == "http.response.body" and not message.get("more_body", False)
            )
            await send(message)

        async def listen() -> None:
            if (await receive())["type"] == "http.disconnect" and not answered:
                self.disconnected += 1

        listener = asyncio.create_task(listen())
        try:
            await self.app(scope, replay, note_end)
        finally:
            listener.cancel()


@dataclass
class Watched:
    engine: WatchedEngine
    http: DisconnectWatch
    url: str
    secret: str


@pytest.fixture(scope="module")
def watched(tiny_model_path: Path) -> Iterator[Watched]:
    engine = WatchedEngine(str(tiny_model_path), served_model_name="watched-base")
    secret = secrets.token_urlsafe(16)
    app = DisconnectWatch(create_engine_app(engine, api_key=secret))
    with serve_in_thread(app) as url:
        yield Watched(engine, app, url, secret)


@pytest.fixture
def watched_model(
    tenant: Callable[[], Tenant], gateway_plane: ServedPlane, watched: Watched
) -> tuple[Tenant, str]:
    worker = add_worker(
        gateway_plane.sessions,
        base_model=BASE_MODEL,
        engine_endpoint=watched.url,
        engine_secret=watched.secret,
        served_model_name="watched-base",
    )
    alice = tenant()
    name = alice.create_model(base_model=BASE_MODEL, worker_id=worker)["inference_name"]
    wait_until(lambda: watched.engine.running == 0, what="the engine finishing earlier requests")
    return alice, name


def test_stream_arrives_while_generating_and_disconnect_stops_the_engine(
    watched_model: tuple[Tenant, str], watched: Watched
) -> None:
    alice, name = watched_model
    engine = watched.engine
    finished_before = len(engine.produced)

    with alice.http.stream(
        "POST", "/v1/chat/completions", json={**LONG_STREAM, "model": name}
    ) as response:
        assert response.status_code == 200
        lines = response.iter_lines()  # held: dropping it would close the stream
        events: list[str] = []
        while len(events) < 3:
            line = next(lines)
            if line.startswith("data: "):
                events.append(line)
        # Three events are here and the engine is still generating: nothing was buffered.
        assert engine.running == 1
        assert len(engine.produced) == finished_before

    wait_until(lambda: engine.running == 0, what="the engine stopping the abandoned stream")
    assert len(engine.produced) == finished_before + 1
    assert engine.produced[-1] < MAX_TOKENS  # stopped early, not run to max_tokens


def test_abandoned_request_closes_the_engine_request_while_it_generates(
    watched_model: tuple[Tenant, str], watched: Watched
) -> None:
    alice, name = watched_model
    disconnected_before = watched.http.disconnected

    async def abandon() -> None:
        headers = {"Authorization": f"Bearer {alice.key}"}
        async with httpx.AsyncClient(base_url=alice.url, headers=headers, timeout=120) as http:
            request = asyncio.create_task(
                http.post("/v1/chat/completions", json={**ABANDONED, "model": name})
            )
            while watched.engine.running == 0:
                assert not request.done(), request.result().text
                await asyncio.sleep(0.05)
            request.cancel()  # the caller gives up and closes its connection
            with pytest.raises(asyncio.CancelledError):
                await request

    asyncio.run(abandon())

    # The gateway hung up on the engine before the answer was complete, and the engine
    # aborted the generation instead of running it to max_tokens.
    wait_until(
        lambda: watched.http.disconnected == disconnected_before + 1,
        what="the gateway closing its request to the engine",
    )
    wait_until(lambda: watched.engine.running == 0, what="the engine aborting the generation")
    assert watched.engine.produced[-1] < ABANDONED["max_tokens"]


@pytest.mark.slow
def test_engine_dying_mid_stream_ends_it_with_an_error_event(
    tenant: Callable[[], Tenant],
    gateway_plane: ServedPlane,
    engine_worker: str,
    tiny_model_path: Path,
    tmp_path: Path,
) -> None:
    alice = tenant()
    with run_engine(tiny_model_path, tmp_path / "engine.log") as doomed:
        worker = add_engine_worker(gateway_plane.sessions, doomed, base_model="tests/doomed-engine")
        name = alice.create_model(base_model="tests/doomed-engine", worker_id=worker)[
            "inference_name"
        ]
        stream = alice.openai.chat.completions.create(
            model=name,
            messages=[{"role": "user", "content": "Tell a long story."}],
            max_tokens=MAX_TOKENS,
            top_logprobs=20,
            stream=True,
            extra_body={"ignore_eos": True},
        )
        chunks = iter(stream)
        assert next(chunks).model == name
        doomed.process.kill()

        with pytest.raises(openai.APIError, match="the engine broke off the stream"):
            for _ in chunks:
                pass

    # The broken stream gave its slot back: the tenant can fill its limit again.
    healthy = alice.create_model(worker_id=engine_worker)["inference_name"]
    with ExitStack() as streams:
        for _ in range(TENANT_LIMIT):
            open_stream(streams, alice, healthy)

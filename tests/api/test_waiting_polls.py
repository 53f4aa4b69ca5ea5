"""A tenant's long-polls waiting at once are capped (``max_waiting_polls``): past the cap a
follow is answered at once, saying why; other tenants are not affected, and a wait whose client
hung up frees its place."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable

import httpx

from skytrain_backend.api.longpoll import WAIT_REFUSED_HEADER
from skytrain_backend.ranges import MAX_WAIT_S
from tests.api.support import group
from tests.fixtures.callers import Caller

LIMIT = 2
DEADLINE_S = 20  # for the server to notice a hang-up; the parked waits last longer (MAX_WAIT_S)
EMPTY = {"data": [], "has_more": False}


def _quiet_events(caller: Caller) -> str:
    """The events URL of a queued job: no worker here, so no event comes."""
    model_id = caller.create_model()["id"]
    response = caller.http.post(
        "/v1/training-jobs",
        json={"model_id": model_id, "trajectory_groups": [group(1.0, 0.0)]},
    )
    assert response.status_code == 201, response.text
    events = f"/v1/training-jobs/{response.json()['id']}/events"
    assert caller.http.get(events).json()["data"] == []
    return events


async def _follow(client: httpx.AsyncClient, events: str, *, wait_s: float) -> httpx.Response:
    return await client.get(events, params={"wait_s": wait_s})


async def _until_waited(client: httpx.AsyncClient, events: str) -> httpx.Response:
    """Follow with a short wait until the server lets the request wait (it counts a hang-up
    once it notices it)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = await _follow(client, events, wait_s=0.2)
        if WAIT_REFUSED_HEADER not in response.headers or time.monotonic() > deadline:
            return response


def test_past_its_waiting_polls_a_tenant_is_answered_at_once_and_a_hang_up_frees_a_place(
    caller: Caller, other: Caller, set_limits: Callable[..., None]
) -> None:
    set_limits(caller, max_waiting_polls=LIMIT)
    mine_events, their_events = _quiet_events(caller), _quiet_events(other)

    async def scenario() -> None:
        async with (
            caller.async_client(timeout=None) as mine,
            other.async_client(timeout=None) as theirs,
        ):
            # One more than the limit at once: exactly one is answered without waiting.
            follows = [
                asyncio.create_task(_follow(mine, mine_events, wait_s=MAX_WAIT_S))
                for _ in range(LIMIT + 1)
            ]
            done, parked = await asyncio.wait(
                follows, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert len(done) == 1 and len(parked) == LIMIT
            answered = done.pop().result()
            assert answered.status_code == 200, answered.text
            assert answered.json() == EMPTY
            reason = answered.headers[WAIT_REFUSED_HEADER]
            assert f"{LIMIT} long-polls" in reason and "max_waiting_polls" in reason
            assert WAIT_REFUSED_HEADER in (await _follow(mine, mine_events, wait_s=1)).headers

            # Another tenant still waits.
            theirs_answer = await _follow(theirs, their_events, wait_s=0.2)
            assert theirs_answer.status_code == 200
            assert WAIT_REFUSED_HEADER not in theirs_answer.headers

            # A client that hangs up gives its place back.
            waits = list(parked)
            waits[0].cancel()
            freed = await _until_waited(mine, mine_events)
            assert WAIT_REFUSED_HEADER not in freed.headers
            assert freed.json() == EMPTY
            assert not waits[1].done()
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    asyncio.run(scenario())

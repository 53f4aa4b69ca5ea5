"""A tenant's long-polls waiting at once are capped (``max_waiting_polls``): over the cap it gets
429, other tenants and answers without ``wait_s`` are not affected, and a wait whose client hung
up frees its place."""

from __future__ import annotations

import asyncio
import time

import httpx
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db import tenants
from skytrain_backend.ranges import MAX_WAIT_S
from tests.api.conftest import Caller
from tests.api.support import group
from tests.fixtures.services import ControlPlane

LIMIT = 2
DEADLINE_S = 20  # for the count to change; the parked waits last longer (MAX_WAIT_S)


def _quiet_events(caller: Caller) -> str:
    """A queued job's events URL after its last event: no worker here, so none comes."""
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


async def _until(
    client: httpx.AsyncClient, job_id: str, status: int, *, probe_wait_s: float = 0.2
) -> httpx.Response:
    """Follow with a short wait until the answer has ``status`` (the server counts a hang-up
    once it notices it)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = await _follow(client, job_id, wait_s=probe_wait_s)
        if response.status_code == status or time.monotonic() > deadline:
            return response


def test_a_tenant_over_its_waiting_polls_gets_429_and_a_hang_up_frees_a_place(
    control_plane: ControlPlane,
    caller: Caller,
    other: Caller,
    db_sessions: sessionmaker[Session],
) -> None:
    with db_sessions() as session:
        tenants.set_limits(
            session,
            tenant_name=caller.key.tenant_name,
            values={"max_waiting_polls": LIMIT},
            reset=[],
        )
    job_id, others_job_id = _quiet_events(caller), _quiet_events(other)

    async def scenario() -> None:
        async with (
            httpx.AsyncClient(
                base_url=control_plane.url, headers=caller.key.headers, timeout=None
            ) as mine,
            httpx.AsyncClient(
                base_url=control_plane.url, headers=other.key.headers, timeout=None
            ) as theirs,
        ):
            # One more than the limit at once: exactly one is refused, the rest wait.
            follows = [
                asyncio.create_task(_follow(mine, job_id, wait_s=MAX_WAIT_S))
                for _ in range(LIMIT + 1)
            ]
            done, parked = await asyncio.wait(
                follows, timeout=DEADLINE_S, return_when=asyncio.FIRST_COMPLETED
            )
            assert len(done) == 1 and len(parked) == LIMIT
            refused = done.pop().result()
            assert refused.status_code == 429, refused.text
            error = refused.json()["error"]
            assert error["type"] == "rate_limit_error"
            assert f"{LIMIT} long-polls" in error["message"]
            assert "max_waiting_polls" in error["message"]
            assert "retry-after" in refused.headers
            assert (await _follow(mine, job_id, wait_s=0.2)).status_code == 429

            # Without wait_s the same tenant is answered; another tenant may wait.
            assert (await _follow(mine, job_id, wait_s=0)).status_code == 200
            assert (await _follow(theirs, others_job_id, wait_s=0.2)).status_code == 200

            # A client that hangs up gives its place back.
            waits = list(parked)
            waits[0].cancel()
            freed = await _until(mine, job_id, 200)
            assert freed.status_code == 200, freed.text
            assert freed.json() == {"data": [], "has_more": False}
            for task in waits:
                task.cancel()
            await asyncio.gather(*waits, return_exceptions=True)

    asyncio.run(scenario())

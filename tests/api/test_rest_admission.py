"""A tenant's REST requests in flight are capped (``max_concurrent_rest_requests``): past the
cap a request waits for room, in order of arrival, then gets 429 with Retry-After naming the
limit; other tenants are not affected; a request whose client hung up gives its place back;
on PostgreSQL the cap holds across control planes, and a process counts its requests in one
transaction at a time, a tenant with nothing in flight ahead of the bursts waiting."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest
from sqlalchemy import Connection, create_engine, text
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission.tenant_load import REST_REQUEST, TenantLoads
from skytrain_backend.config import Settings
from skytrain_backend.db import tenants
from skytrain_backend.errors import RateLimited
from skytrain_backend.ranges import MAX_WAIT_S
from tests.api.support import queued_job_events
from tests.fixtures.callers import Caller
from tests.fixtures.service import start_service, stop_service
from tests.fixtures.services import MakeSettings

DEADLINE_S = 30


async def _until_refused(client: httpx.AsyncClient) -> httpx.Response:
    """List models until the answer is 429: once the request holding the tenant's one slot
    has been admitted (it was sent first, but may not have arrived yet)."""
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = await client.get("/v1/models")
        if response.status_code == 429 or time.monotonic() > deadline:
            return response


async def _until_served(client: httpx.AsyncClient) -> httpx.Response:
    deadline = time.monotonic() + DEADLINE_S
    while True:
        response = await client.get("/v1/models")
        if response.status_code != 429 or time.monotonic() > deadline:
            return response


def _assert_refused_naming_the_limit(response: httpx.Response, *, limit: int) -> None:
    assert response.status_code == 429, response.text
    assert int(response.headers["Retry-After"]) >= 1
    message = response.json()["error"]["message"]
    assert f"{limit} REST requests of yours are in flight" in message, message
    assert "max_concurrent_rest_requests" in message, message


def test_past_its_cap_a_tenant_is_refused_others_are_served_and_a_hang_up_frees_its_place(
    caller: Caller, other: Caller, set_limits: Callable[..., None]
) -> None:
    events = queued_job_events(caller.http)
    set_limits(caller, max_concurrent_rest_requests=1)

    async def scenario() -> None:
        async with (
            caller.async_client(timeout=None) as mine,
            other.async_client(timeout=60) as theirs,
        ):
            holding = asyncio.create_task(mine.get(events, params={"wait_s": MAX_WAIT_S}))
            _assert_refused_naming_the_limit(await _until_refused(mine), limit=1)

            # Another tenant is served meanwhile, its models and its job's events alike.
            assert (await theirs.get("/v1/models")).status_code == 200
            assert not holding.done()

            # The client holding the slot hangs up: its place is given back.
            holding.cancel()
            await asyncio.gather(holding, return_exceptions=True)
            assert (await _until_served(mine)).status_code == 200

    asyncio.run(scenario())


def test_requests_past_the_cap_wait_in_order_of_arrival_for_room(
    settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    limits = tenants.TenantLimits.defaults(settings)
    limits = tenants.TenantLimits(**{**vars(limits), "max_concurrent_rest_requests": 1})

    async def scenario() -> None:
        loads = TenantLoads(sessions=db_sessions, shared=False)
        release_first = await loads.admit("t", limits=limits, cost=REST_REQUEST)
        admitted: list[str] = []

        async def wait(name: str) -> Callable[[], None]:
            release = await loads.admit("t", limits=limits, cost=REST_REQUEST, wait_s=60)
            admitted.append(name)
            return release

        second = asyncio.create_task(wait("second"))
        await asyncio.sleep(0)
        third = asyncio.create_task(wait("third"))
        await asyncio.sleep(0.1)
        assert admitted == []
        with pytest.raises(RateLimited):  # no wait: refused at once
            await loads.admit("t", limits=limits, cost=REST_REQUEST)

        release_first()
        release_second = await second
        assert admitted == ["second"] and not third.done()
        release_second()
        (await third)()
        assert admitted == ["second", "third"]
        assert loads.held("t").rest_requests == 0
        await loads.aclose()

    asyncio.run(scenario())


def test_busy_tenants_share_the_process_places_and_a_quiet_one_is_let_in_at_once(
    settings: Settings, db_sessions: sessionmaker[Session]
) -> None:
    limits = tenants.TenantLimits.defaults(settings)  # 32 each: the places bind first

    async def scenario() -> None:
        loads = TenantLoads(sessions=db_sessions, shared=False, process_places=4)
        a = [await loads.admit("a", limits=limits, cost=REST_REQUEST) for _ in range(2)]
        b = [await loads.admit("b", limits=limits, cost=REST_REQUEST) for _ in range(2)]
        with pytest.raises(RateLimited) as refused:  # the places are full, a holds its share
            await loads.admit("a", limits=limits, cost=REST_REQUEST)
        assert refused.value.limit == "rest_admission_process_places"
        assert "its 4 places" in str(refused.value) and "yours hold 2" in str(refused.value)
        assert "SKYTRAIN_REST_ADMISSION_PROCESS_PLACES" in str(refused.value)

        # A tenant with nothing in flight is let in at once, past the places.
        c = await loads.admit("c", limits=limits, cost=REST_REQUEST)

        # a's next request waits: b's release leaves the places full and a over its share
        # (4 places over 3 tenants); once b and c are done, it is let in.
        waiting = asyncio.create_task(loads.admit("a", limits=limits, cost=REST_REQUEST, wait_s=60))
        await asyncio.sleep(0.05)
        b[0]()
        await asyncio.sleep(0.05)
        assert not waiting.done()
        b[1]()
        c()
        a.append(await asyncio.wait_for(waiting, 10))
        assert loads.held("a").rest_requests == 3

        # A long-poll that waits (parked) holds its tenant's own slot, not a place; its own
        # tenant's next request, waiting on its share, is let in at once.
        waiting = asyncio.create_task(loads.admit("a", limits=limits, cost=REST_REQUEST, wait_s=60))
        b = [await loads.admit("b", limits=limits, cost=REST_REQUEST) for _ in range(2)]
        await asyncio.sleep(0.05)
        assert not waiting.done()  # a holds 3 of 4 places, over its share of 2
        a[0].park(True)
        a[1].park(True)
        a.append(await asyncio.wait_for(waiting, 1))
        assert loads.held("a").rest_requests == 4
        a[0].park(False)  # woken with work to do: it counts again, unchecked
        for admitted in a + b:
            admitted()
            admitted()  # twice is once
        assert loads.held("a").rest_requests == loads.held("b").rest_requests == 0
        # Every place is free again: a fresh tenant gets exactly the 4, then its share.
        d = [await loads.admit("d", limits=limits, cost=REST_REQUEST) for _ in range(4)]
        e = await loads.admit("e", limits=limits, cost=REST_REQUEST)
        with pytest.raises(RateLimited):
            await loads.admit("d", limits=limits, cost=REST_REQUEST)
        for admitted in [*d, e]:
            admitted()
        await loads.aclose()

    asyncio.run(scenario())


@pytest.mark.postgres
@pytest.mark.slow
def test_a_tenant_at_its_cap_through_one_control_plane_is_refused_through_another(
    make_settings: MakeSettings, tmp_path: Path
) -> None:
    database_url = make_settings(database="postgres").storage.resolved_database_url
    env = {"SKYTRAIN_DATABASE_URL": database_url, "SKYTRAIN_PROVIDER": "none"}
    first = start_service(env, tmp_path / "first")
    second = start_service(env, tmp_path / "second")
    try:
        with first.http("alice") as http:
            events = queued_job_events(http)
        first.cli("tenants", "limits", "alice", "--max-concurrent-rest-requests", "1")
        headers = {"Authorization": f"Bearer {first.key('alice')}"}

        async def scenario() -> None:
            async with (
                httpx.AsyncClient(base_url=first.url, headers=headers, timeout=None) as one,
                httpx.AsyncClient(base_url=second.url, headers=headers, timeout=60) as two,
            ):
                holding = asyncio.create_task(one.get(events, params={"wait_s": MAX_WAIT_S}))
                _assert_refused_naming_the_limit(await _until_refused(two), limit=1)
                holding.cancel()
                await asyncio.gather(holding, return_exceptions=True)
                assert (await _until_served(two)).status_code == 200

        asyncio.run(scenario())
    finally:
        stop_service(second)
        stop_service(first)


# Every admission a control plane writes to ``tenant_loads`` (a row made, or its REST requests
# raised), in the order the database saw them.
_NOTE_ADMISSIONS = [
    "CREATE TABLE admissions_seen (n bigserial PRIMARY KEY, tenant_id text NOT NULL)",
    """CREATE FUNCTION note_admission() RETURNS trigger LANGUAGE plpgsql AS $$
    BEGIN
        IF NEW.rest_requests > 0 AND (TG_OP = 'INSERT' OR NEW.rest_requests > OLD.rest_requests)
        THEN
            INSERT INTO admissions_seen (tenant_id) VALUES (NEW.tenant_id);
        END IF;
        RETURN NEW;
    END $$""",
    "CREATE TRIGGER note_admission AFTER INSERT OR UPDATE ON tenant_loads FOR EACH ROW "
    "EXECUTE FUNCTION note_admission()",
]


def _admission_waits_on_a_lock(connection: Connection) -> bool:
    waiting = connection.execute(
        text(
            "SELECT count(*) FROM pg_stat_activity WHERE wait_event_type = 'Lock' "
            "AND query LIKE '%FOR NO KEY UPDATE%'"
        )
    ).scalar_one()
    connection.rollback()  # the activity is read once per transaction
    return bool(waiting)


def _admissions_seen(connection: Connection, *, after: int = 0) -> list[str]:
    seen = connection.execute(
        text("SELECT tenant_id FROM admissions_seen WHERE n > :after ORDER BY n"), {"after": after}
    )
    connection.rollback()
    return [tenant_id for (tenant_id,) in seen]


@pytest.mark.postgres
@pytest.mark.slow
def test_a_tenant_with_nothing_in_flight_is_counted_in_before_the_bursts_waiting(
    make_settings: MakeSettings, tmp_path: Path
) -> None:
    database_url = make_settings(database="postgres").storage.resolved_database_url
    service = start_service(
        {"SKYTRAIN_DATABASE_URL": database_url, "SKYTRAIN_PROVIDER": "none"}, tmp_path / "h"
    )
    engine = create_engine(database_url)
    bursts = [f"burst{index}" for index in range(4)]
    try:
        keys = {name: service.key(name) for name in ["held_up", "quiet", *bursts]}
        headers = {name: {"Authorization": f"Bearer {key}"} for name, key in keys.items()}
        events = {}
        for name in bursts:
            with httpx.Client(base_url=service.url, headers=headers[name], timeout=60) as http:
                events[name] = queued_job_events(http)
        with engine.begin() as connection:
            for statement in _NOTE_ADMISSIONS:
                connection.execute(text(statement))
            rows = connection.execute(text("SELECT name, id FROM tenants"))
            ids: dict[str, str] = {name: tenant_id for name, tenant_id in rows}

        async def scenario(locker: Connection, watcher: Connection) -> tuple[list[int], list[str]]:
            clients = {
                name: httpx.AsyncClient(base_url=service.url, headers=each, timeout=DEADLINE_S)
                for name, each in headers.items()
            }
            deadline = time.monotonic() + DEADLINE_S
            # Each bursting tenant has a request admitted and in flight (a long-poll).
            polls = [
                asyncio.create_task(clients[name].get(events[name], params={"wait_s": MAX_WAIT_S}))
                for name in bursts
            ]
            try:
                while len(admitted := _admissions_seen(watcher)) < len(bursts):
                    assert time.monotonic() < deadline, f"long-polls admitted: {admitted}"
                    await asyncio.sleep(0.05)
                # One tenant's admission is held up in the database (its tenant row locked
                # here), and with it the process's counting.
                locker.execute(
                    text("SELECT id FROM tenants WHERE id = :id FOR UPDATE"),
                    {"id": ids["held_up"]},
                )
                sent = [asyncio.create_task(clients["held_up"].get("/v1/models"))]
                while not _admission_waits_on_a_lock(watcher):
                    assert time.monotonic() < deadline, "the admission never reached the lock"
                    await asyncio.sleep(0.05)
                # The four tenants burst meanwhile, then a quiet tenant sends one request.
                for name in bursts:
                    sent += [asyncio.create_task(clients[name].get("/v1/models")) for _ in range(4)]
                await asyncio.sleep(1)
                sent.append(asyncio.create_task(clients["quiet"].get("/v1/models")))
                await asyncio.sleep(0.5)
                locker.rollback()
                responses = await asyncio.gather(*sent)
                return (
                    [response.status_code for response in responses],
                    _admissions_seen(watcher)[len(bursts) :],
                )
            finally:
                for poll in polls:
                    poll.cancel()
                await asyncio.gather(*polls, return_exceptions=True)
                for client in clients.values():
                    await client.aclose()

        with engine.connect() as locker, engine.connect() as watcher:
            statuses, order = asyncio.run(scenario(locker, watcher))
        assert statuses == [200] * len(statuses)
        names = {tenant_id: name for name, tenant_id in ids.items()}
        # The held-up admission first (none passed it while it held the turn), then the quiet
        # tenant's, ahead of every burst sent before it.
        assert [names[tenant_id] for tenant_id in order[:2]] == ["held_up", "quiet"], order
        assert sorted(names[tenant_id] for tenant_id in order[2:]) == sorted(bursts * 4)
    finally:
        engine.dispose()
        stop_service(service)

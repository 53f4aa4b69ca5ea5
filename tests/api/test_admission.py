"""Every route family passes one admission: the Tinker routes (``/api/v1``, keys as the
official ``tinker`` SDK sends them: ``X-API-Key: tml-...``) are counted against the tenant's
``max_concurrent_rest_requests`` as ``/v1`` is, a request weighted by the body it declares;
failed authentications, of API keys and of worker tokens alike, are rate-limited per client
address (429 with Retry-After) while a tenant or worker from another address is served.

Bursts come from addresses of their own on the loopback network (127.0.0.3, 127.0.0.4: Linux
answers all of 127/8), so that the failures they spend are not the rest of the suite's, which
calls from 127.0.0.1.
"""

from __future__ import annotations

import asyncio
import secrets
import selectors
import socket
from collections import Counter
from collections.abc import Callable
from typing import cast

import aiohttp
import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.api.admission import rest_admission
from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.db import tenants
from skytrain_backend.db import workers as worker_rows
from skytrain_backend.ranges import MAX_WAIT_S
from tests.api.support import queued_job_events
from tests.fixtures.services import ApiKey, ControlPlane

BURST = 1024


def _tinker_headers(key: ApiKey) -> dict[str, str]:
    """What the tinker SDK sends: its key, TINKER_API_KEY, as X-API-Key."""
    return {"X-API-Key": f"tml-{key.key}"}


def _limit_rest_requests(db_sessions: sessionmaker[Session], key: ApiKey, value: int) -> None:
    with db_sessions() as session:
        tenants.set_limits(
            session,
            tenant_name=key.tenant_name,
            values={"max_concurrent_rest_requests": value},
            reset=[],
        )


def _from(address: str, url: str, headers: dict[str, str]) -> httpx.Client:
    """A client whose connections come from ``address``."""
    transport = httpx.HTTPTransport(local_address=address)
    return httpx.Client(base_url=url, headers=headers, transport=transport, timeout=60)


async def _burst(
    url: str, path: str, headers: Callable[[], dict[str, str]], *, source: str, method: str = "GET"
) -> Counter[int]:
    """``BURST`` requests at once from ``source``; the statuses they got."""
    connector = aiohttp.TCPConnector(limit=0, local_addr=(source, 0))
    timeout = aiohttp.ClientTimeout(total=120)
    async with aiohttp.ClientSession(url, connector=connector, timeout=timeout) as http:

        async def send() -> int:
            async with http.request(method, path, headers=headers()) as response:
                await response.read()
                return response.status

        return Counter(await asyncio.gather(*(send() for _ in range(BURST))))


def _random_keys_burst(
    url: str, path: str, *, prefix: str, source: str, method: str = "GET"
) -> Counter[int]:
    """``BURST`` requests at once from ``source``, each with a new random bearer key starting
    with ``prefix``; the statuses they got."""
    return asyncio.run(
        _burst(
            url,
            path,
            lambda: {"Authorization": f"Bearer {prefix}{secrets.token_urlsafe(24)}"},
            source=source,
            method=method,
        )
    )


@pytest.mark.slow
def test_a_tinker_burst_from_one_tenant_gets_429s_while_another_tenant_is_served(
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
    db_sessions: sessionmaker[Session],
) -> None:
    """The bursting tenant's two places are held by long-polls, so every request of its burst
    waits its turn (SKYTRAIN_REST_ADMISSION_WAIT_S) and is refused, however fast the machine
    would have served them one after the other; the other tenant is served throughout."""
    bursting, other = api_key(), api_key()
    _limit_rest_requests(db_sessions, bursting, 2)
    bearer = {"Authorization": f"Bearer {bursting.key}"}
    with httpx.Client(base_url=control_plane.url, headers=bearer, timeout=60) as http:
        events = queued_job_events(http)

    async def scenario() -> tuple[Counter[int], list[int]]:
        async with httpx.AsyncClient(
            base_url=control_plane.url, headers=bearer, timeout=None
        ) as holder:
            holding = [
                asyncio.create_task(holder.get(events, params={"wait_s": MAX_WAIT_S}))
                for _ in range(2)
            ]
            await _until_both_places_are_held(control_plane.url, bursting)
            burst = asyncio.create_task(
                _burst(
                    control_plane.url,
                    "/api/v1/training_runs",
                    lambda: _tinker_headers(bursting),
                    source="127.0.0.3",
                )
            )
            statuses = []
            async with httpx.AsyncClient(
                base_url=control_plane.url, headers=_tinker_headers(other), timeout=60
            ) as theirs:
                while not burst.done():
                    statuses.append((await theirs.get("/api/v1/training_runs")).status_code)
            for task in holding:
                task.cancel()
            await asyncio.gather(*holding, return_exceptions=True)
            return await burst, statuses

    burst, others = asyncio.run(scenario())
    assert set(burst) == {429}, burst
    assert others and set(others) == {200}, Counter(others)


async def _until_both_places_are_held(url: str, key: ApiKey) -> None:
    """Until a request of ``key``'s tenant is refused: its two long-polls hold its places."""
    async with httpx.AsyncClient(base_url=url, headers=_tinker_headers(key), timeout=60) as http:
        for _ in range(600):  # a bound for a stuck server, not a timing
            if (await http.get("/api/v1/training_runs")).status_code == 429:
                return
        raise AssertionError("the long-polls never held both places")


def test_a_big_body_burst_is_refused_by_its_cost_before_the_bodies_are_read(
    control_plane: ControlPlane,
    api_key: Callable[..., ApiKey],
    db_sessions: sessionmaker[Session],
) -> None:
    # Bodies of the largest size allowed (1 MiB here) count as two requests, as many as this
    # tenant may have in flight: one is let in, the seven others get 429 naming the limit.
    # None of the bodies is ever sent: a refusal comes before the body is read.
    key = api_key()
    _limit_rest_requests(db_sessions, key, 2)
    size = control_plane.settings.server.max_request_bytes
    host, port = control_plane.url.removeprefix("http://").split(":")
    head = (
        f"POST /api/v1/create_session HTTP/1.1\r\nHost: {host}\r\nX-API-Key: tml-{key.key}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {size}\r\n\r\n"
    ).encode()
    connections = [socket.create_connection((host, int(port)), timeout=60) for _ in range(8)]
    try:
        for connection in connections:
            connection.sendall(head)
        answers = _first_answers(connections, count=7)
        assert len(answers) == 7, answers
        for answer in answers.values():
            assert answer.startswith("HTTP/1.1 429"), answer
            assert "retry-after:" in answer.lower(), answer
            assert "this one 2 (one, plus one per started" in answer, answer
            assert "max_concurrent_rest_requests" in answer, answer
        # The one let in is still waiting for its body.
        (waiting,) = set(connections) - set(answers)
        waiting.setblocking(False)
        with pytest.raises(BlockingIOError):
            waiting.recv(1)
    finally:
        for connection in connections:
            connection.close()


def _first_answers(connections: list[socket.socket], *, count: int) -> dict[socket.socket, str]:
    """The first ``count`` answers the server sends on ``connections``, each as it came."""
    answers: dict[socket.socket, str] = {}
    with selectors.DefaultSelector() as selector:
        for connection in connections:
            selector.register(connection, selectors.EVENT_READ)
        while len(answers) < count:
            ready = selector.select(timeout=60)
            if not ready:
                break
            for item, _ in ready:
                connection = cast(socket.socket, item.fileobj)
                answers[connection] = connection.recv(65536).decode()
                selector.unregister(connection)
    return answers


def test_random_keys_from_one_address_get_429_while_a_tenant_elsewhere_is_served(
    control_plane: ControlPlane, api_key: Callable[..., ApiKey]
) -> None:
    tenant = api_key()  # a key no request has used: its first lookup is not cached

    burst = _random_keys_burst(control_plane.url, "/v1/models", prefix="sk-st-", source="127.0.0.3")
    assert burst[429] > 0 and set(burst) <= {401, 429}, burst
    with _from("127.0.0.2", control_plane.url, tenant.headers) as http:
        assert http.get("/v1/models").status_code == 200
    with httpx.Client(base_url=control_plane.url, timeout=60) as http:
        refused = http.get("/v1/models", headers={"Authorization": "Bearer sk-st-nope"})
    assert refused.status_code == 401, refused.text


def test_bad_worker_tokens_from_one_address_get_429_while_a_worker_elsewhere_is_served(
    control_plane: ControlPlane, db_sessions: sessionmaker[Session]
) -> None:
    with db_sessions() as session:
        _, token = worker_rows.create_worker(
            session, provider="none", base_model="tiny/llama", max_models=1
        )
        session.commit()

    burst = _random_keys_burst(
        control_plane.url, "/v1/worker/heartbeat", prefix="swt-", source="127.0.0.4", method="POST"
    )
    assert burst[429] > 0 and set(burst) <= {401, 429}, burst
    headers = {"Authorization": f"Bearer {token}"}
    with _from("127.0.0.2", control_plane.url, headers) as http:
        answer = http.get("/v1/worker/check", params={"base_model": "tiny/llama"})
    assert answer.status_code == 204, answer.text


def test_a_freed_route_thread_goes_to_the_waiting_tenant_that_holds_the_fewest() -> None:
    # The routes' turns: tenant A holds every place and queued three more calls before B came;
    # the next place to free is B's, then A's in their order.
    async def scenario() -> list[str]:
        turns = FairLimiter(total=2, per_key=2)
        order: list[str] = []
        release: dict[str, asyncio.Event] = {}

        async def call(key: str, name: str) -> None:
            async with turns.turn(key):
                order.append(name)
                release[name] = asyncio.Event()
                await release[name].wait()

        running = [asyncio.create_task(call("a", f"a{index}")) for index in range(5)]
        await asyncio.sleep(0.01)
        running.append(asyncio.create_task(call("b", "b0")))
        await asyncio.sleep(0.01)
        assert order == ["a0", "a1"]
        release["a0"].set()
        await asyncio.sleep(0.01)
        for name in ["a1", "b0", "a2", "a3", "a4"]:
            release[name].set()
            await asyncio.sleep(0.01)
        await asyncio.gather(*running)
        return order

    assert asyncio.run(scenario()) == ["a0", "a1", "b0", "a2", "a3", "a4"]


def test_random_keys_on_the_inference_routes_get_429_from_one_address(
    control_plane: ControlPlane,
) -> None:
    burst = _random_keys_burst(
        control_plane.url,
        "/v1/chat/completions",
        prefix="sk-st-",
        source="127.0.0.5",
        method="POST",
    )
    assert burst[429] > 0 and set(burst) <= {401, 429}, burst


def test_many_tenants_behind_one_address_are_not_refused_for_lookups_in_flight(
    control_plane: ControlPlane, api_key: Callable[..., ApiKey]
) -> None:
    # A NAT or a proxy: more tenants than the address's failure budget (60 a minute), each
    # sending its first request at once, none of their keys cached. None fails, so none is
    # refused for failures.
    keys = [api_key() for _ in range(2 * control_plane.settings.admission.auth_failures_per_minute)]

    async def scenario() -> Counter[int]:
        connector = aiohttp.TCPConnector(limit=0, local_addr=("127.0.0.6", 0))
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(
            control_plane.url, connector=connector, timeout=timeout
        ) as http:

            async def send(key: ApiKey) -> int:
                async with http.get("/v1/models", headers=key.headers) as response:
                    await response.read()
                    return response.status

            return Counter(await asyncio.gather(*(send(key) for key in keys)))

    assert asyncio.run(scenario()) == Counter({200: len(keys)})


def test_ipv6_clients_share_their_failures_by_64_bit_prefix() -> None:
    def group(address: str) -> str | None:
        return rest_admission.client_address({"client": (address, 4321)})

    assert group("2001:db8:1:2::1") == group("2001:db8:1:2:ffff:ffff:ffff:ffff")
    assert group("2001:db8:1:2::1") != group("2001:db8:1:3::1")
    assert group("::ffff:192.0.2.7") == group("192.0.2.7") == "192.0.2.7"
    assert group("192.0.2.7") != group("192.0.2.8")

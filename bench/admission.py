"""Tenant B's latency while others burst, through every door admission guards.

Starts `skytrain serve` (provider none) on a fresh PostgreSQL schema (or SQLite), then, for
--seconds each, measures tenant B listing its models one request at a time (`GET /v1/models`,
then a pause of 20 ms):

1. alone;
2. while one tenant's --loops loops send `GET /api/v1/training_runs` back to back with the
   tinker SDK's header (`X-API-Key: tml-...`; 429s not backed off);
3. while eight tenants burst at once, --loops / 8 loops each, the same Tinker requests;
4. while --loops loops send random API keys from another client address (127.0.0.3).

Printed: B's p50 and max in each phase, how many of its requests were answered (one at a time:
a stall shows as few requests and a large max), what the bursts got (statuses, answers/s; with
several tenants, the fewest and most answers 200 one tenant got: none starved), and
the server's own figures over the phase from its metrics listener: the CPU seconds it used and
the cyclic garbage collector's collections of each generation (young, middle, full).
The bursts run in a process of their own, so B's requests do not queue behind their answers in
its event loop; the server, the database and both clients share the machine's cores. Run it with
another checkout's venv (`/path/to/other/.venv/bin/python bench/admission.py`) to measure that
checkout's server with the same clients.

Usage:
    .venv/bin/python bench/admission.py [--loops 1024] [--seconds 10] [--database postgres]
        [--postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import sys
import tempfile
import time
from collections.abc import Callable
from multiprocessing.queues import Queue
from pathlib import Path

import aiohttp
import httpx
import load
import machine
from prometheus_client.parser import text_string_to_metric_families

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.burst import Outcomes  # noqa: E402
from tests.fixtures.service import Service, start_service, stop_service  # noqa: E402

Headers = Callable[[], dict[str, str]]


async def _send(http: aiohttp.ClientSession, path: str, headers: Headers, into: Outcomes) -> None:
    started = time.monotonic()
    try:
        async with http.get(path, headers=headers()) as response:
            await response.read()
            into.statuses[response.status] += 1
    except (aiohttp.ClientError, TimeoutError) as exc:
        into.failures[type(exc).__name__] += 1
        return
    into.latencies_s.append(time.monotonic() - started)


async def _bursts(
    url: str, bursts: list[tuple[int, Headers, str]], seconds: float
) -> list[Outcomes]:
    """The bursts' loops until ``seconds`` have passed: each burst is (loops, headers,
    source address); what each burst got."""
    outcomes = [Outcomes() for _ in bursts]
    stop = time.monotonic() + seconds
    timeout = aiohttp.ClientTimeout(total=60)

    async def loop(http: aiohttp.ClientSession, headers: Headers, into: Outcomes) -> None:
        while time.monotonic() < stop:
            await _send(http, "/api/v1/training_runs", headers, into)

    sessions = [
        aiohttp.ClientSession(
            url, timeout=timeout, connector=aiohttp.TCPConnector(limit=0, local_addr=(source, 0))
        )
        for _, _, source in bursts
    ]
    try:
        await asyncio.gather(
            *(
                loop(http, headers, into)
                for http, (loops, headers, _), into in zip(sessions, bursts, outcomes, strict=True)
                for _ in range(loops)
            )
        )
    finally:
        for http in sessions:
            await http.close()
    return outcomes


def _burst_process(
    url: str,
    bursts: list[tuple[int, Headers, str]],
    seconds: float,
    results: Queue[list[Outcomes]],
) -> None:
    results.put(asyncio.run(_bursts(url, bursts, seconds)))


async def _probe(url: str, b_key: str, seconds: float) -> Outcomes:
    """B's requests, one at a time, from 0.5 s in (the bursts under way) to ``seconds``."""
    b = Outcomes()
    stop = time.monotonic() + seconds
    await asyncio.sleep(0.5)
    timeout = aiohttp.ClientTimeout(total=60)
    async with aiohttp.ClientSession(url, timeout=timeout) as http:
        while time.monotonic() < stop:
            await _send(http, "/v1/models", lambda: {"Authorization": f"Bearer {b_key}"}, b)
            await asyncio.sleep(0.02)
    return b


def _phase(
    url: str, b_key: str, bursts: list[tuple[int, Headers, str]], seconds: float
) -> tuple[Outcomes, list[Outcomes]]:
    """B's outcomes, and each burst's. The bursts run in a process of their own, so that B's
    requests do not wait behind their answers in this one's event loop."""
    if not bursts:
        return asyncio.run(_probe(url, b_key, seconds)), []
    context = multiprocessing.get_context("fork")
    results: Queue[list[Outcomes]] = context.Queue()
    process = context.Process(target=_burst_process, args=(url, bursts, seconds, results))
    process.start()
    b = asyncio.run(_probe(url, b_key, seconds))
    burst = results.get(timeout=120)
    process.join()
    return b, burst


def _server_figures(metrics_url: str) -> dict[str, float]:
    """The server process's CPU seconds and its collector's collections per generation."""
    figures: dict[str, float] = {}
    text = httpx.get(metrics_url, timeout=30).text
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == "process_cpu_seconds_total":
                figures["cpu"] = sample.value
            elif sample.name == "python_gc_collections_total":
                figures[f"gc{sample.labels['generation']}"] = sample.value
    return figures


def _server_line(before: dict[str, float], after: dict[str, float]) -> str:
    spent = {key: after[key] - before.get(key, 0.0) for key in after}
    return (
        f"server CPU {spent['cpu']:5.1f} s, collections {spent['gc0']:.0f} / {spent['gc1']:.0f}"
        f" / {spent['gc2']:.0f}"
    )


def _line(label: str, b: Outcomes, bursts: list[Outcomes], seconds: float, server: str) -> None:
    burst = Outcomes()
    for each in bursts:
        burst.statuses.update(each.statuses)
        burst.failures.update(each.failures)
    served = sorted(each.statuses[200] for each in bursts)
    answers = (
        f"burst {burst.answered / seconds:5.0f} answers/s, statuses {dict(burst.statuses)}"
        f"{', failures ' + str(dict(burst.failures)) if burst.failures else ''}"
        f"{f', 200s per tenant {served[0]}-{served[-1]}' if len(served) > 1 else ''}"
        if burst.answered or burst.failures
        else ""
    )
    print(
        f"  {label:<34} B p50 {b.percentile_ms(0.5):7.1f} ms  max {1000 * max(b.latencies_s):7.1f}"
        f" ms  ({b.answered} requests, statuses {dict(b.statuses)})  {answers}\n"
        f"  {'':<34} {server}"
    )


def _tinker(key: str) -> Headers:
    headers = {"X-API-Key": f"tml-{key}"}
    return lambda: headers


def _run(label: str, env: dict[str, str], *, loops: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        metrics_port = machine.free_port()
        service: Service = start_service(
            {"SKYTRAIN_PROVIDER": "none", "SKYTRAIN_METRICS_PORT": str(metrics_port), **env},
            Path(scratch) / "h",
        )
        metrics_url = f"http://127.0.0.1:{metrics_port}/metrics"
        try:
            b_key = service.key("b")
            keys = [service.key(f"burst{index}") for index in range(8)]
            print(f"\n{label}")
            phases: list[tuple[str, list[tuple[int, Headers, str]]]] = [
                ("alone", []),
                ("one tenant's Tinker burst", [(loops, _tinker(keys[0]), "127.0.0.1")]),
                (
                    "eight tenants' Tinker bursts",
                    [(loops // 8, _tinker(key), "127.0.0.1") for key in keys],
                ),
                (
                    "random keys from 127.0.0.3",
                    [
                        (
                            loops,
                            lambda: {"X-API-Key": f"tml-sk-st-{secrets.token_urlsafe(24)}"},
                            "127.0.0.3",
                        )
                    ],
                ),
            ]
            for name, bursts in phases:
                before = _server_figures(metrics_url)
                b, burst = _phase(service.url, b_key, bursts, seconds)
                server = _server_line(before, _server_figures(metrics_url))
                _line(name, b, burst, seconds, server)
        finally:
            stop_service(service)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=1024)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--database", choices=["postgres", "sqlite"], default="postgres")
    load.add_postgres_url(parser)
    args = parser.parse_args()
    load.print_hardware()
    print(f"{args.loops} loops, {args.seconds:g} s a phase; 1-min load average before: ", end="")
    print(f"{os.getloadavg()[0]:.1f}")
    if args.database == "sqlite":
        _run("SQLite", {}, loops=args.loops, seconds=args.seconds)
        return
    with load.fresh_schema(args.postgres_url, "bench_admission") as url:
        _run("PostgreSQL", load.service_env(url), loops=args.loops, seconds=args.seconds)
    print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

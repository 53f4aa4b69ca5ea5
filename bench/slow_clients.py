"""Slow, keyless connections against `skytrain serve`, and another client's latency meanwhile.

Starts `skytrain serve` (provider none) on a fresh PostgreSQL schema with --open-files open
files, as `tests/lifecycle/test_slow_clients.py` does, and runs `tests/fixtures/slow_clients.py`:
first the other client alone (an authenticated `GET /v1/models`, each on a new connection from
127.0.0.1, every 0.5 s) for --seconds, then the same while --connections connections from
127.0.0.2 send the start of their headers and one byte every 5 s, never finishing. Printed: the
most connections the attack held at once, when the server closed them (from each one's
connect: p50, p99, max), what it answered them, and the other client's p50/max and failures,
alone and during the attack. The server, the database and both clients share the machine.

Usage:
    .venv/bin/python bench/slow_clients.py [--connections 8000] [--open-files 4096]
        [--seconds 10] [--postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import load

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.fixtures.service import start_service, stop_service  # noqa: E402
from tests.fixtures.slow_clients import (  # noqa: E402
    OtherClient,
    beside,
    open_files_limit,
    slow_clients,
)


def _other(other: OtherClient) -> str:
    if not other.latencies_s:
        return f"no answers, failures {dict(other.failures)}"
    return (
        f"p50 {other.percentile_ms(0.5):6.1f} ms   max {1000 * max(other.latencies_s):7.1f} ms"
        f"   ({len(other.latencies_s)} requests, statuses {dict(other.statuses)}, "
        f"failures {dict(other.failures) or 'none'})"
    )


def _run(env: dict[str, str], args: argparse.Namespace) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        with open_files_limit(args.open_files):
            service = start_service({"SKYTRAIN_PROVIDER": "none", **env}, Path(scratch) / "home")
        try:
            key = service.key("other")
            alone = OtherClient(service.url, key)
            with beside(alone):
                time.sleep(args.seconds)
            during = OtherClient(service.url, key)
            parts = urlsplit(service.url)
            assert parts.hostname is not None and parts.port is not None
            began = time.monotonic()
            with open_files_limit(args.connections + 1_000), beside(during):
                attack = slow_clients(
                    parts.hostname,
                    parts.port,
                    count=args.connections,
                    source="127.0.0.2",
                    give_up_s=args.give_up_s,
                )
            took = time.monotonic() - began
        finally:
            stop_service(service)
    closed = sorted(attack.closed_after_s)

    def at(fraction: float) -> float:
        return closed[min(len(closed) - 1, int(fraction * len(closed)))] if closed else 0.0

    print(f"\nattack: {args.connections} connections from 127.0.0.2 over {took:.1f} s")
    print(f"  held open at once (client side): at most {attack.most_open}")
    print(
        f"  closed by the server: {len(closed)}, after p50 {at(0.5):.1f} s, p99 {at(0.99):.1f} s,"
        f" max {at(1.0):.1f} s; answers {dict(attack.statuses)} (0: none, reset)"
    )
    print(f"  still open at {args.give_up_s:g} s: {attack.still_open}")
    print(f"  never connected: {attack.never_connected}")
    print(f"other client alone       : {_other(alone)}")
    print(f"other client during it   : {_other(during)}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--connections", type=int, default=8_000)
    parser.add_argument("--open-files", type=int, default=4_096)
    parser.add_argument("--seconds", type=float, default=10.0)
    parser.add_argument("--give-up-s", type=float, default=90.0)
    load.add_postgres_url(parser)
    args = parser.parse_args()
    load.print_hardware()
    print(
        f"server: skytrain serve on PostgreSQL, {args.open_files} open files; 1-min load "
        f"average before: {os.getloadavg()[0]:.1f}"
    )
    with load.fresh_schema(args.postgres_url, "bench_slow") as url:
        _run(load.service_env(url), args)
    print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

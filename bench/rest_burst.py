"""Another tenant's REST latency while one tenant bursts: the suite's burst, with figures.

Starts `skytrain serve` (provider none) on SQLite, then on a fresh PostgreSQL schema, as
`tests/hostile/test_burst.py` does, and runs `tests/fixtures/burst.py`: first the other tenant
alone (its models, then /health, one request at a time) for --seconds, then the same while
the bursting tenant's --loops loops send requests back to back (one in eight a long-poll on a
queued job's events, the rest listing models; 429s are not backed off). Printed per database:
the other tenant's p50/p99 alone and during the burst, /health's, and what the burst got
(statuses, requests/s, failures). The server, the database and these clients share the
machine's cores.

Usage:
    .venv/bin/python bench/rest_burst.py [--loops 256] [--seconds 10]
        [--postgres-url postgresql+psycopg://postgres@127.0.0.1:5432/test]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import sys
import tempfile
from pathlib import Path

import httpx
import load

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from tests.api.support import group  # noqa: E402
from tests.fixtures.burst import Burst, Outcomes, run_burst  # noqa: E402
from tests.fixtures.service import start_service, stop_service  # noqa: E402


def _latencies(outcomes: Outcomes) -> str:
    if not outcomes.latencies_s:
        return "no answers"
    return (
        f"p50 {outcomes.percentile_ms(0.5):7.1f} ms   p99 {outcomes.percentile_ms(0.99):7.1f} ms"
        f"   ({outcomes.answered} requests, statuses {dict(outcomes.statuses)}"
        f"{', failures ' + str(dict(outcomes.failures)) if outcomes.failures else ''})"
    )


def _report(label: str, alone: Burst, during: Burst, seconds: float) -> None:
    burst = during.burst
    print(f"\n{label}")
    print(f"  other tenant alone       : {_latencies(alone.other)}")
    print(f"  other tenant during burst: {_latencies(during.other)}")
    print(f"  /health alone            : {_latencies(alone.health)}")
    print(f"  /health during burst     : {_latencies(during.health)}")
    print(
        f"  burst: {burst.answered / seconds:.0f} answers/s, statuses {dict(burst.statuses)}, "
        f"failures {dict(burst.failures) or 'none'}"
    )


def _run(label: str, env: dict[str, str], *, loops: int, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as scratch:
        service = start_service({"SKYTRAIN_PROVIDER": "none", **env}, Path(scratch) / "home")
        try:
            burst_key, other_key = service.key("burst"), service.key("other")
            headers = {"Authorization": f"Bearer {burst_key}"}
            with httpx.Client(base_url=service.url, headers=headers, timeout=60) as http:
                model = http.post(
                    "/v1/models",
                    json={"project": "bench", "name": "agent", "base_model": "tiny/llama"},
                ).json()
                job = http.post(
                    "/v1/training-jobs",
                    json={"model_id": model["id"], "trajectory_groups": [group(1.0, 0.0)]},
                ).json()
            events = f"/v1/training-jobs/{job['id']}/events"

            def measure(burst_loops: int) -> Burst:
                return asyncio.run(
                    run_burst(
                        service.url,
                        burst_key=burst_key,
                        other_key=other_key,
                        events_path=events,
                        loops=burst_loops,
                        duration_s=seconds,
                    )
                )

            alone = measure(0)
            during = measure(loops)
        finally:
            stop_service(service)
    _report(label, alone, during, seconds)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--loops", type=int, default=256)
    parser.add_argument("--seconds", type=float, default=10.0)
    load.add_postgres_url(parser)
    args = parser.parse_args()
    load.print_hardware()
    print(f"burst: {args.loops} loops for {args.seconds:g} s; 1-min load average before: ", end="")
    print(f"{os.getloadavg()[0]:.1f}")

    _run("SQLite", {}, loops=args.loops, seconds=args.seconds)

    with load.fresh_schema(args.postgres_url, "bench_burst") as url:
        _run("PostgreSQL", load.service_env(url), loops=args.loops, seconds=args.seconds)
    print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

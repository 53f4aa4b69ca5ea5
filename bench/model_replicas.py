"""Rollout throughput of one model served by 1, 2 and 4 replicas, and its p99 latency while a
job trains, with 1 replica against 2.

THE ENGINES ARE STAND-INS OF FIXED LATENCY: each answers a chat completion after
``--latency-s`` (2 s), at most ``--slots`` (4) at once (a GPU engine's batch, scaled down),
so what is measured is the scheduler's placement and the gateway's balancing, not a model (the
machine has two cores; a real engine per replica would share them). Each stand-in is its own
process speaking the engine's HTTP surface (``/health``, ``/v1/chat/completions``).

``skytrain serve`` (SQLite, provider none, its own scheduler) runs as a process; four ready
worker rows point at four stand-ins (what the worker agents leave once registered); one model
per replica count is created with ``min_replicas = max_replicas = N`` and the scheduler places
its replicas. Then ``--clients`` (32) clients send requests back to back for ``--seconds``; answers
that end after it are not counted.

Training: a model with 1 replica, then one with 2, gets requests from 16 clients for 12 s; from
4 s to 8 s its home worker's row says ``sleeping`` (what the agent reports while a job trains:
its engine sleeps). A 503 is retried after 0.25 s (a client honouring ``Retry-After`` would
wait 30 s); latency counts from the first try to the 200.

Usage:
    .venv/bin/python bench/model_replicas.py [--latency-s 2] [--slots 4] [--seconds 20]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import secrets
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

import httpx
import load
import machine
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from skytrain_backend.config import Settings
from skytrain_backend.db.models import Model, Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory

SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
BASE = "bench/fixed-latency"


def _engine_main(port: int, secret: str, latency_s: float, slots: int) -> None:
    """A stand-in engine: every completion takes ``latency_s``, ``slots`` at once."""
    import uvicorn

    app = FastAPI()
    gate = asyncio.Semaphore(slots)

    @app.get("/health")
    async def health() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        if request.headers.get("authorization") != f"Bearer {secret}":
            return JSONResponse({"error": {"message": "no"}}, status_code=401)
        body = await request.json()
        async with gate:
            await asyncio.sleep(latency_s)
        return JSONResponse(
            {
                "id": "x",
                "object": "chat.completion",
                "created": int(time.time()),
                "model": body["model"],
                "choices": [
                    {
                        "index": 0,
                        "message": {"role": "assistant", "content": "ok"},
                        "finish_reason": "stop",
                    }
                ],
                "usage": {"prompt_tokens": 4, "completion_tokens": 1, "total_tokens": 5},
            }
        )

    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


async def _load(
    url: str, key: str, model: str, *, clients: int, seconds: float, retry: bool = False
) -> tuple[int, list[float], int]:
    """Requests answered 200, their latencies, and the 503s met on the way."""
    latencies: list[float] = []
    refused = 0
    end = time.monotonic() + seconds
    body = {"model": model, "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1}
    limits = httpx.Limits(max_connections=clients, max_keepalive_connections=clients)
    async with httpx.AsyncClient(
        base_url=url, headers={"Authorization": f"Bearer {key}"}, timeout=120, limits=limits
    ) as http:

        async def client() -> None:
            nonlocal refused
            while time.monotonic() < end:
                start = time.monotonic()
                while True:
                    response = await http.post("/v1/chat/completions", json=body)
                    if response.status_code == 200:
                        if time.monotonic() <= end:  # answers after the end are not counted
                            latencies.append(time.monotonic() - start)
                        break
                    if response.status_code == 503 and retry:
                        refused += 1
                        await asyncio.sleep(0.25)
                        continue
                    raise SystemExit(f"{response.status_code}: {response.text}")

        await asyncio.gather(*(client() for _ in range(clients)))
    return len(latencies), latencies, refused


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> None:
    parser = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    parser.add_argument("--engine", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--secret", help=argparse.SUPPRESS)
    parser.add_argument("--latency-s", type=float, default=2.0)
    parser.add_argument("--slots", type=int, default=4)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--seconds", type=float, default=20.0)
    args = parser.parse_args()
    if args.engine is not None:
        _engine_main(args.engine, args.secret, args.latency_s, args.slots)
        return

    secret = secrets.token_urlsafe(16)
    with tempfile.TemporaryDirectory() as scratch, ExitStack() as stack:
        home = Path(scratch)
        env = {
            **os.environ,
            "SKYTRAIN_HOME": str(home),
            "SKYTRAIN_PROVIDER": "none",
            "SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS": "1000",
            "SKYTRAIN_TENANT_MAX_WORKERS": "4",
            "SKYTRAIN_TENANT_MAX_PLACED_MODELS": "32",
            # Replicas fixed per model here (min = max): no scaling during a measure.
            "SKYTRAIN_GATEWAY_ROUTE_CACHE_TTL_S": "1",
        }
        engine_urls = []
        for i in range(4):
            port = machine.free_port()
            argv = [sys.executable, __file__, "--engine", str(port), "--secret", secret]
            argv += ["--latency-s", str(args.latency_s), "--slots", str(args.slots)]
            url = f"http://127.0.0.1:{port}"
            log = home / f"engine{i}.log"
            stack.enter_context(load.served(argv, env, f"{url}/health", log, timeout_s=120))
            engine_urls.append(url)
        plane_port = machine.free_port()
        plane = f"http://127.0.0.1:{plane_port}"
        stack.enter_context(
            load.served(
                [SKYTRAIN, "serve", "--port", str(plane_port)],
                env,
                f"{plane}/health",
                home / "control-plane.log",
                timeout_s=120,
            )
        )
        key = subprocess.run(
            [SKYTRAIN, "keys", "create", "--tenant", "bench"],
            env=env,
            check=True,
            capture_output=True,
            text=True,
        ).stdout.strip()
        db = session_factory(
            create_db_engine(Settings(storage={"home": home}).storage.resolved_database_url)
        )
        with db() as session:
            for url in engine_urls:
                session.add(
                    Worker(
                        provider="manual",
                        base_model=BASE,
                        status="ready",
                        engine_endpoint=url,
                        token_hash=secrets.token_hex(32),
                        engine_secret=secret,
                        capacity={"max_models": 100},
                        hardware={},
                        served_model_name="base",
                        served=[],
                        last_active_at=utcnow(),
                    )
                )
            session.commit()
        http = httpx.Client(base_url=plane, headers={"Authorization": f"Bearer {key}"})

        def model(name: str, replicas: int) -> dict[str, str]:
            created = http.post(
                "/v1/models",
                json={
                    "project": "bench",
                    "name": name,
                    "base_model": BASE,
                    "config": {"min_replicas": replicas, "max_replicas": replicas},
                },
            )
            created.raise_for_status()
            made = created.json()
            deadline = time.monotonic() + 30
            while True:
                placed = http.get(f"/v1/models/{made['id']}").json()["replicas"] or []
                if len(placed) == replicas:
                    return dict(made)
                if time.monotonic() > deadline:
                    raise SystemExit(f"{name}: {replicas} replicas not placed: {placed}")
                time.sleep(0.2)

        print(f"hardware: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU")
        print(f"1-min load average before: {os.getloadavg()[0]:.1f}")
        print(
            f"engines: FIXED-LATENCY STAND-INS, {args.latency_s} s per completion, "
            f"{args.slots} at once each; {args.clients} clients for {args.seconds:.0f} s"
        )
        base_rate = 0.0
        for replicas in (1, 2, 4):
            made = model(f"throughput-{replicas}", replicas)
            done, latencies, _ = asyncio.run(
                _load(
                    plane, key, made["inference_name"], clients=args.clients, seconds=args.seconds
                )
            )
            rate = done / args.seconds
            base_rate = base_rate or rate
            ideal = replicas * args.slots / args.latency_s
            print(
                f"replicas {replicas}: {rate:6.1f} req/s ({rate / base_rate:.2f}x one replica; "
                f"ideal {ideal:.0f}), p50 {_p(latencies, 0.5) * 1000:.0f} ms, "
                f"p99 {_p(latencies, 0.99) * 1000:.0f} ms"
            )

        for replicas in (1, 2):
            made = model(f"training-{replicas}", replicas)
            with db() as session:
                home_id = session.get_one(Model, made["id"]).worker_id

            async def training_window(home: str | None = home_id) -> None:
                await asyncio.sleep(4)
                _set_status(db, home, "sleeping")
                await asyncio.sleep(4)
                _set_status(db, home, "ready")

            async def run(name: str = made["inference_name"]) -> tuple[int, list[float], int]:
                window = asyncio.create_task(training_window())
                result = await _load(plane, key, name, clients=16, seconds=12, retry=True)
                await window
                return result

            done, latencies, refused = asyncio.run(run())
            print(
                f"during a job, {replicas} replica(s): {done} answered, {refused} x 503, "
                f"p50 {_p(latencies, 0.5) * 1000:.0f} ms, p99 {_p(latencies, 0.99) * 1000:.0f} ms"
            )
        print(f"1-min load average after: {os.getloadavg()[0]:.1f}")
        print(json.dumps({"done": True}))


def _set_status(db: object, worker_id: str | None, status: str) -> None:
    with db() as session:  # type: ignore[operator]
        worker = session.get(Worker, worker_id)
        worker.status = status
        session.commit()


if __name__ == "__main__":
    main()

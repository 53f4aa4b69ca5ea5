"""What the inference gateway costs: the same requests sent to the engine directly and through
the control plane, at concurrency 1 and 64.

Starts the CPU engine as `skytrain engine serve` does, counting the connections it accepts
(bench/counting_engine.py; tiny random model with SmolLM2's tokenizer), and `skytrain serve`
(SQLite, provider none) as separate processes, creates a key and a model, and records a ready
worker row pointing at the engine (what the worker agent leaves after it registers). Then, for
each concurrency C, rounds alternate between the two paths so both see the same machine load:
C clients send chat completions back to back, every one generating exactly --max-tokens tokens
(ignore_eos, fixed seeds), with the gateway's always-on logprobs and token ids asked of the
engine on the direct path too. Reported per path: latency p50/p99, requests/s, CPU time per
request of the engine and of the control plane process, the TCP connections the engine
accepted (from the bench's clients on the direct path, a new client per round; from the
control plane on the gateway path: 0 at concurrency 1 when the connection it kept from the
round before outlived the direct round between, shorter than its 2 s keep-alive), and the
gateway / direct ratios. Every process shares the machine's cores, so on a small machine the
control plane's CPU time is taken from the engine's.

Usage:
    .venv/bin/python bench/gateway_overhead.py [--max-tokens 8] [--requests 384] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import secrets
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import load
import machine

from skytrain_backend import hub
from skytrain_backend.config import Settings
from skytrain_backend.db.models import Model, Worker, utcnow
from skytrain_backend.db.session import create_db_engine, session_factory

REPO = Path(__file__).resolve().parents[1]
SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
CONCURRENCY = (1, 64)
MESSAGES = [{"role": "user", "content": "Name a fruit."}]
# Requests per path whose connection the server dropped, sent again.
DROPPED: dict[str, int] = {}


def _hardware() -> str:
    return (
        f"{machine.cpu_name()}, {os.cpu_count()} cores, no GPU "
        "(cores shared by the engine, the control plane and the clients)"
    )


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time the process has used so far (Linux)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _engine_connections(connections_file: Path) -> int:
    """The TCP connections the engine has accepted so far (``counting_engine.py`` appends a byte
    to the file for each)."""
    return connections_file.stat().st_size


@dataclass(frozen=True)
class Target:
    """One way to the engine: base URL, key, the model name to ask for, extra body fields."""

    label: str
    url: str
    key: str
    model: str
    extra: dict[str, Any]


async def _round(path: Target, *, concurrency: int, requests: int, max_tokens: int) -> list[float]:
    """Latency of each of ``requests`` requests sent by ``concurrency`` clients."""
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    headers = {"Authorization": f"Bearer {path.key}"}
    async with httpx.AsyncClient(
        base_url=path.url, headers=headers, timeout=600, limits=limits
    ) as http:
        counter = iter(range(requests))

        async def client() -> None:
            for index in counter:
                body = {
                    "model": path.model,
                    "messages": MESSAGES,
                    "max_tokens": max_tokens,
                    "temperature": 1.0,
                    "seed": index,
                    "ignore_eos": True,
                    **path.extra,
                }
                start = time.perf_counter()
                try:
                    response = await http.post("/v1/chat/completions", json=body)
                except httpx.TransportError as exc:
                    # On a busy machine a server sometimes drops a connection under 64 at
                    # once: counted and sent again (the latency includes the retry).
                    DROPPED[path.label] = DROPPED.get(path.label, 0) + 1
                    if DROPPED[path.label] > requests // 10:
                        raise SystemExit(
                            f"{path.label}: too many dropped connections: {exc!r}"
                        ) from exc
                    response = await http.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    raise SystemExit(f"{path.label}: {response.status_code} {response.text}")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(
    paths: list[Target],
    args: argparse.Namespace,
    *,
    engine_pid: int,
    plane_pid: int,
    connections_file: Path,
) -> None:
    for path in paths:  # warm-up: connections, the engine's first batches, the database
        await _round(path, concurrency=4, requests=16, max_tokens=args.max_tokens)
    for concurrency in CONCURRENCY:
        requests = args.requests if concurrency > 1 else max(args.requests // 8, 20)
        latencies: dict[str, list[float]] = {path.label: [] for path in paths}
        elapsed: dict[str, float] = {path.label: 0.0 for path in paths}
        # CPU seconds used by (engine, control plane) during each path's rounds.
        cpu: dict[str, list[float]] = {path.label: [0.0, 0.0] for path in paths}
        opened: dict[str, int] = {path.label: 0 for path in paths}
        for _ in range(args.rounds):
            for path in paths:
                connections_before = _engine_connections(connections_file)
                cpu_before = _cpu_seconds(engine_pid), _cpu_seconds(plane_pid)
                start = time.perf_counter()
                latencies[path.label] += await _round(
                    path, concurrency=concurrency, requests=requests, max_tokens=args.max_tokens
                )
                elapsed[path.label] += time.perf_counter() - start
                cpu[path.label][0] += _cpu_seconds(engine_pid) - cpu_before[0]
                cpu[path.label][1] += _cpu_seconds(plane_pid) - cpu_before[1]
                opened[path.label] += _engine_connections(connections_file) - connections_before
        print(f"\nconcurrency {concurrency}: {args.rounds} x {requests} requests per path")
        figures = {}
        for path in paths:
            values = latencies[path.label]
            figures[path.label] = (
                statistics.median(values),
                _percentile(values, 0.99),
                len(values) / elapsed[path.label],
            )
            p50, p99, rate = figures[path.label]
            engine_cpu, plane_cpu = (1000 * s / len(values) for s in cpu[path.label])
            print(
                f"  {path.label:<8} p50 {p50 * 1000:7.1f} ms   p99 {p99 * 1000:7.1f} ms   "
                f"{rate:7.1f} requests/s   ({rate * args.max_tokens:7.0f} tokens/s)   "
                f"CPU per request: engine {engine_cpu:.1f} ms, control plane {plane_cpu:.1f} ms   "
                f"engine connections opened: {opened[path.label]}"
            )
        if DROPPED:
            print(f"  connections dropped and requests sent again so far: {DROPPED}")
        (d50, d99, drate), (g50, g99, grate) = figures["direct"], figures["gateway"]
        print(
            f"  gateway / direct: p50 x{g50 / d50:.2f} (+{(g50 - d50) * 1000:.1f} ms), "
            f"p99 x{g99 / d99:.2f}, throughput x{grate / drate:.2f}"
        )


def _prepare(settings: Settings, *, key_tenant: str, engine_url: str, secret: str) -> None:
    """Place the bench model on a ready worker row pointing at the engine."""
    engine = create_db_engine(settings.storage.resolved_database_url)
    with session_factory(engine)() as session:
        worker = Worker(
            provider="manual",
            base_model="bench/tiny",
            status="ready",
            engine_endpoint=engine_url,
            token_hash=secrets.token_hex(32),
            engine_secret=secret,
            capacity={"max_models": 1},
            hardware={},
            served_model_name="bench-base",
            served=[],
            last_active_at=utcnow(),
        )
        session.add(worker)
        session.flush()
        model = session.query(Model).filter_by(entity=key_tenant, name="bench").one()
        model.worker_id = worker.id
        session.commit()
    engine.dispose()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=384, help="per round at concurrency 64")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()

    model_path = hub.build_tiny_model(REPO / ".cache" / "models" / "tiny-smollm2")
    secret = secrets.token_urlsafe(16)
    engine_port, plane_port = machine.free_port(), machine.free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    plane_url = f"http://127.0.0.1:{plane_port}"
    with tempfile.TemporaryDirectory() as scratch:
        home = Path(scratch)
        env = {
            **os.environ,
            "SKYTRAIN_HOME": str(home),
            "SKYTRAIN_PROVIDER": "none",
            "SKYTRAIN_TENANT_MAX_CONCURRENT_REQUESTS": "1000",
        }
        connections_file = home / "engine-connections"
        engine_argv = [sys.executable, str(REPO / "bench" / "counting_engine.py")]
        engine_argv += ["--connections-file", str(connections_file), "--model", str(model_path)]
        engine_argv += ["--served-model-name", "bench-base", "--port", str(engine_port)]
        engine_argv += ["--api-key", secret, "--max-num-seqs", "64"]
        plane_argv = [SKYTRAIN, "serve", "--port", str(plane_port)]
        with (
            load.served(engine_argv, env, f"{engine_url}/health", home / "engine.log") as engine,
            load.served(
                plane_argv, env, f"{plane_url}/health", home / "control-plane.log"
            ) as plane,
        ):
            key = subprocess.run(
                [SKYTRAIN, "keys", "create", "--tenant", "bench"],
                env=env,
                check=True,
                capture_output=True,
                text=True,
            ).stdout.strip()
            created = httpx.post(
                f"{plane_url}/v1/models",
                json={"project": "bench", "name": "bench", "base_model": "bench/tiny"},
                headers={"Authorization": f"Bearer {key}"},
            )
            created.raise_for_status()
            _prepare(
                Settings(storage={"home": home}),
                key_tenant="bench",
                engine_url=engine_url,
                secret=secret,
            )

            print(f"hardware: {_hardware()}")
            print(f"1-min load average before: {os.getloadavg()[0]:.1f}")
            print(
                f"model: tiny random Llama (2 layers, hidden 64) with SmolLM2's tokenizer; "
                f"{args.max_tokens} completion tokens per request"
            )
            paths = [
                Target(
                    "direct",
                    engine_url,
                    secret,
                    "bench-base",
                    {"logprobs": True, "return_tokens_as_token_ids": True},
                ),
                Target("gateway", plane_url, key, created.json()["inference_name"], {}),
            ]
            asyncio.run(
                _measure(
                    paths,
                    args,
                    engine_pid=engine.pid,
                    plane_pid=plane.pid,
                    connections_file=connections_file,
                )
            )
            print(f"\n1-min load average after: {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()

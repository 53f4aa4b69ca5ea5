"""What a worker's front door costs: the same requests sent to the CPU engine directly (plain
HTTP on loopback) and through the front door (HTTPS pinned to its certificate, the secret
checked, the answer relayed), at concurrency 1 and 16.

Starts `skytrain engine serve` (the CPU engine, tiny random model with SmolLM2's tokenizer) and
the front door (``worker.frontdoor``, under uvicorn with a certificate made as a worker makes
it) as separate processes. Rounds alternate between the two paths so both see the same
machine load; every request generates exactly --max-tokens tokens (ignore_eos, fixed seeds).
Reported per path: latency p50/p99 and requests/s, and the front door / direct ratios.

Usage:
    .venv/bin/python bench/front_door_overhead.py [--max-tokens 8] [--requests 160] [--rounds 3]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import os
import secrets
import ssl
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx
import machine
import uvicorn

from skytrain_backend import hub, tls
from skytrain_backend.worker.frontdoor import FrontDoor

REPO = Path(__file__).resolve().parents[1]
SKYTRAIN = str(Path(sys.executable).with_name("skytrain"))
CONCURRENCY = (1, 16)
MESSAGES = [{"role": "user", "content": "Name a fruit."}]


def _serve_front_door(
    port: int, engine_url: str, engine_key: str, secret: str, cert: str, key: str
) -> None:
    app = FrontDoor(
        engine_url=engine_url, engine_api_key=engine_key, secret=secret, max_body_bytes=1 << 20
    )
    uvicorn.run(
        app, host="127.0.0.1", port=port, ssl_certfile=cert, ssl_keyfile=key, log_level="warning"
    )


def _wait(url: str, *, headers: dict[str, str], verify: ssl.SSLContext | bool = True) -> None:
    deadline = time.monotonic() + 300
    while time.monotonic() < deadline:
        try:
            if httpx.get(url, headers=headers, verify=verify, timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"{url} did not answer")


async def _round(
    url: str,
    key: str,
    verify: ssl.SSLContext | bool,
    *,
    concurrency: int,
    requests: int,
    max_tokens: int,
) -> list[float]:
    latencies: list[float] = []
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(
        base_url=url,
        headers={"Authorization": f"Bearer {key}"},
        verify=verify,
        timeout=600,
        limits=limits,
    ) as http:
        counter = iter(range(requests))

        async def client() -> None:
            for index in counter:
                body = {
                    "model": "bench-base",
                    "messages": MESSAGES,
                    "max_tokens": max_tokens,
                    "seed": index,
                    "ignore_eos": True,
                    "logprobs": True,
                    "return_tokens_as_token_ids": True,
                }
                start = time.perf_counter()
                response = await http.post("/v1/chat/completions", json=body)
                latencies.append(time.perf_counter() - start)
                if response.status_code != 200:
                    raise SystemExit(f"{url}: {response.status_code} {response.text}")

        await asyncio.gather(*(client() for _ in range(concurrency)))
    return latencies


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(q * (len(ordered) - 1)))]


async def _measure(
    paths: dict[str, tuple[str, str, ssl.SSLContext | bool]], args: argparse.Namespace
) -> None:
    for url, key, verify in paths.values():  # warm-up: connections, the engine's first batches
        await _round(url, key, verify, concurrency=4, requests=16, max_tokens=args.max_tokens)
    for concurrency in CONCURRENCY:
        requests = args.requests if concurrency > 1 else max(args.requests // 4, 20)
        latencies: dict[str, list[float]] = {label: [] for label in paths}
        elapsed = dict.fromkeys(paths, 0.0)
        for _ in range(args.rounds):
            for label, (url, key, verify) in paths.items():
                start = time.perf_counter()
                latencies[label] += await _round(
                    url,
                    key,
                    verify,
                    concurrency=concurrency,
                    requests=requests,
                    max_tokens=args.max_tokens,
                )
                elapsed[label] += time.perf_counter() - start
        print(f"\nconcurrency {concurrency}: {args.rounds} x {requests} requests per path")
        figures = {}
        for label, values in latencies.items():
            figures[label] = (
                statistics.median(values),
                _percentile(values, 0.99),
                len(values) / elapsed[label],
            )
            p50, p99, rate = figures[label]
            print(
                f"  {label:<11} p50 {p50 * 1000:7.1f} ms   p99 {p99 * 1000:7.1f} ms   "
                f"{rate:7.1f} requests/s"
            )
        (d50, d99, drate), (f50, f99, frate) = figures["direct"], figures["front door"]
        print(
            f"  front door / direct: p50 x{f50 / d50:.2f} (+{(f50 - d50) * 1000:.1f} ms), "
            f"p99 x{f99 / d99:.2f}, throughput x{frate / drate:.2f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--requests", type=int, default=160, help="per round at concurrency 16")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    print(f"machine: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU (shared by all)")

    model_path = hub.build_tiny_model(REPO / ".cache" / "models" / "tiny-smollm2")
    engine_key, secret = secrets.token_urlsafe(16), secrets.token_urlsafe(16)
    engine_port, door_port = machine.free_port(), machine.free_port()
    engine_url = f"http://127.0.0.1:{engine_port}"
    door_url = f"https://127.0.0.1:{door_port}"
    certificate, key = tls.self_signed_certificate(["127.0.0.1"])
    pinned = tls.pinned_context(certificate)
    with tempfile.TemporaryDirectory() as scratch:
        cert_path, key_path = Path(scratch) / "cert.pem", Path(scratch) / "key.pem"
        cert_path.write_text(certificate)
        key_path.write_text(key)
        argv = [SKYTRAIN, "engine", "serve", "--engine", "hf", "--model", str(model_path)]
        argv += ["--served-model-name", "bench-base", "--port", str(engine_port)]
        argv += ["--api-key", engine_key, "--max-num-seqs", "64", "--log-level", "warning"]
        with open(Path(scratch) / "engine.log", "wb") as log:
            engine = subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT)
        door = multiprocessing.get_context("spawn").Process(
            target=_serve_front_door,
            args=(door_port, engine_url, engine_key, secret, str(cert_path), str(key_path)),
            daemon=True,
        )
        door.start()
        try:
            _wait(f"{engine_url}/health", headers={})
            _wait(
                f"{door_url}/health", headers={"Authorization": f"Bearer {secret}"}, verify=pinned
            )
            paths: dict[str, tuple[str, str, ssl.SSLContext | bool]] = {
                "direct": (engine_url, engine_key, True),
                "front door": (door_url, secret, pinned),
            }
            asyncio.run(_measure(paths, args))
        finally:
            door.terminate()
            engine.terminate()
            engine.wait(30)


if __name__ == "__main__":
    main()

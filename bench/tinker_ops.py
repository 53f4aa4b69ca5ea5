"""Latency of the Tinker protocol's operations, through the official SDK, on a local worker.

Starts `skytrain serve` (SQLite, local provider, CPU engine) in a temporary home, makes a key
with `skytrain keys create --tinker`, then with `tinker.ServiceClient`:

- the time to a training client (a worker started and the adapter built);
- forward_backward + optim_step on --batch sequences of --tokens tokens, submitted together
  and waited on, --steps times (median, and the first);
- save_weights_and_get_sampling_client (a checkpoint committed and loaded into the engine);
- sample: --samples completions of --max-tokens tokens;
- save_state.

Usage:
    .venv/bin/python bench/tinker_ops.py [--model PATH_OR_ID] [--steps 8] [--batch 8]
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import httpx
import machine

import tinker
from skytrain_backend import hub
from tinker import types

T = TypeVar("T")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _timed(call: Callable[[], T]) -> tuple[T, float]:
    start = time.monotonic()
    value = call()
    return value, time.monotonic() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the tiny test model")
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=16)
    args = parser.parse_args()
    cache = Path(os.environ.get("SKYTRAIN_TEST_MODEL_CACHE", ".cache/models"))
    model = args.model or str(hub.build_tiny_model(cache / "tiny-smollm2"))

    home = Path(tempfile.mkdtemp(prefix="skytrain-bench-"))
    port = _free_port()
    env = {
        **os.environ,
        "SKYTRAIN_HOME": str(home),
        "SKYTRAIN_PORT": str(port),
        "SKYTRAIN_PROVIDER": "local",
        "SKYTRAIN_ENGINE": "hf",
        "SKYTRAIN_MODEL_CACHE_DIR": str(cache),
    }
    command = [sys.executable, "-m", "skytrain_backend"]
    with open(home / "serve.log", "wb") as log:
        server = subprocess.Popen(
            [*command, "serve"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(f"{url}/health", timeout=2).status_code == 200:
                    break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.2)
        key = subprocess.run(
            [*command, "keys", "create", "--tenant", "bench", "--tinker"],
            env=env,
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
        service = tinker.ServiceClient(base_url=url, api_key=key)
        training, created_s = _timed(
            lambda: service.create_lora_training_client(base_model=model, rank=16).result()
        )
        batch = [
            types.Datum(
                model_input=types.ModelInput.from_ints(
                    [(i * 7 + t) % 1000 + 1 for t in range(args.tokens)]
                ),
                loss_fn_inputs={
                    "target_tokens": types.TensorData(
                        data=[(i * 7 + t) % 1000 + 2 for t in range(args.tokens)], dtype="int64"
                    ),
                    "weights": types.TensorData(data=[1.0] * args.tokens, dtype="float32"),
                },
            )
            for i in range(args.batch)
        ]

        def step() -> None:
            fwd_bwd = training.forward_backward(batch, "cross_entropy")
            optim = training.optim_step(types.AdamParams(learning_rate=1e-4))
            fwd_bwd.result()
            optim.result()

        steps = [_timed(step)[1] for _ in range(args.steps)]
        sampler, sampler_s = _timed(
            lambda: training.save_weights_and_get_sampling_client().result()
        )
        prompt = types.ModelInput.from_ints(list(range(1, 33)))
        params = types.SamplingParams(max_tokens=args.max_tokens, stop=[])
        samples = [
            _timed(lambda: sampler.sample(prompt, args.samples, params).result())[1]
            for _ in range(3)
        ]
        _, state_s = _timed(lambda: training.save_state("bench").result())
        service.close("success").result()

        print(f"machine: {machine.cpu_name()}, {os.cpu_count()} cores, no GPU; model: {model}")
        print(f"create_lora_training_client (worker start + adapter): {created_s:.1f} s")
        print(
            f"forward_backward + optim_step, {args.batch} x {args.tokens} tokens: median "
            f"{statistics.median(steps):.2f} s (first {steps[0]:.2f} s, {args.steps} steps)"
        )
        print(f"save_weights_and_get_sampling_client: {sampler_s:.2f} s")
        print(
            f"sample {args.samples} x {args.max_tokens} tokens: median "
            f"{statistics.median(samples):.2f} s"
        )
        print(f"save_state: {state_s:.2f} s")
    finally:
        server.send_signal(signal.SIGINT)
        try:
            server.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(server.pid, signal.SIGKILL)


if __name__ == "__main__":
    main()

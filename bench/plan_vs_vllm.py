"""The memory plan's serving figures beside what vLLM really does on this GPU.

Plans the model for the GPU CUDA reports (``planning.gpu_from_device``), starts ``vllm serve``
with the plan's numbers through skytrain's own command line (``engine.vllm.vllm_command``: the
worker's flags), and prints, per figure, the plan's value, the measured one and their ratio:

- KV-cache tokens: vLLM's log ("GPU KV cache size: N tokens");
- KV-cache memory: vLLM's log ("Available KV cache memory: X GiB");
- vLLM's memory: what the GPU's free memory dropped by once it was up (``mem_get_info``);
- memory outside vLLM: the GPU's total less vLLM's, against the plan's (1 - utilization);
- this process's CUDA context, made before vLLM starts, against what the plan sets aside
  for the worker's (``RESERVED_GIB``).

Without CUDA or without vLLM it says so and exits 0: nothing to measure (run by
``scripts/gpu-check.sh`` on a GPU day).

    python bench/plan_vs_vllm.py [--model DIR_OR_ID] [--lora-rank 8] [--out DIR]
"""

from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import httpx
from machine import cpu_name, free_port, memory_gib

GIB = 1024**3
KV_TOKENS = re.compile(r"GPU KV cache size: ([\d,]+) tokens")
KV_MEMORY = re.compile(r"Available KV cache memory: ([\d.]+) GiB")


def _ratio(plan: float, measured: float | None) -> str:
    return f"{measured / plan:.3f}" if measured and plan else "-"


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=None, help="model directory or Hub id in the cache")
    parser.add_argument("--lora-rank", type=int, default=8)
    parser.add_argument("--out", type=Path, default=Path("/tmp/gpu-check"))
    parser.add_argument("--timeout", type=float, default=600.0)
    args = parser.parse_args()

    import torch

    if not torch.cuda.is_available():
        print("no CUDA GPU here: nothing to measure")
        return 0
    if importlib.util.find_spec("vllm") is None:
        print(f"no vLLM in {sys.executable}: nothing to measure")
        return 0
    from skytrain_backend import hub
    from skytrain_backend.engine.options import EngineOptions
    from skytrain_backend.engine.vllm import vllm_command
    from skytrain_backend.planning import (
        ModelShape,
        find_model_config,
        gpu_from_device,
        plan_worker,
    )
    from skytrain_backend.planning.plan import RESERVED_GIB

    cache = Path(os.environ.get("SKYTRAIN_TEST_MODEL_CACHE", ".cache/models"))
    model = args.model or hub.resolve_model(hub.SMOLLM2_ID, cache_dir=cache)
    config = find_model_config(model, cache_dir=cache)
    if config is None:
        print(f"no config.json for {model}")
        return 1
    properties = torch.cuda.get_device_properties(0)
    gpu = gpu_from_device(properties.name, properties.total_memory)
    plan = plan_worker(
        ModelShape.from_config(config), gpu, model=model, lora_rank=args.lora_rank, tinker_runs=0
    )
    host_memory = memory_gib()
    print(
        f"machine: {cpu_name()}, {os.cpu_count()} cores, "
        f"{f'{host_memory:.0f} GiB' if host_memory else 'memory unknown'}, "
        f"load {os.getloadavg()[0]:.1f}; GPU {properties.name}"
    )
    print(f"{model} on {gpu.name} ({properties.total_memory / GIB:.2f} GiB): {plan.reason}")
    if not plan.fits:
        return 1

    free_before, total = torch.cuda.mem_get_info(0)
    options = EngineOptions(
        model=model,
        port=free_port(),
        max_model_len=plan.max_model_len,
        max_lora_rank=args.lora_rank,
        gpu_memory_utilization=plan.gpu_memory_utilization,
        tensor_parallel_size=1,
        vllm_python=sys.executable,
    )
    command = vllm_command(options)
    args.out.mkdir(parents=True, exist_ok=True)
    log_path = args.out / "vllm-plan.log"
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            command.argv, env={**os.environ, **command.env}, stdout=log, stderr=subprocess.STDOUT
        )
    try:
        deadline = time.monotonic() + args.timeout
        while True:
            if process.poll() is not None:
                print(f"vLLM exited with {process.returncode}: see {log_path}")
                return 1
            try:
                if httpx.get(f"{options.base_url}/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                print(f"vLLM not up after {args.timeout:.0f} s: see {log_path}")
                return 1
            time.sleep(2)
        free_after, _ = torch.cuda.mem_get_info(0)
    finally:
        process.terminate()
        process.wait(timeout=60)

    text = log_path.read_text()
    tokens = KV_TOKENS.search(text)
    kv_memory = KV_MEMORY.search(text)
    vllm_bytes = free_before - free_after
    planned_kv = next(row for row in plan.rows if row.item == "KV cache").value
    rows = [
        (
            "KV-cache tokens",
            plan.kv_cache_tokens,
            int(tokens.group(1).replace(",", "")) if tokens else None,
        ),
        (
            "KV-cache memory (GiB)",
            float(planned_kv.split()[0]),
            float(kv_memory.group(1)) if kv_memory else None,
        ),
        ("vLLM's memory (GiB)", plan.gpu_memory_utilization * total / GIB, vllm_bytes / GIB),
        (
            "memory outside vLLM (GiB)",
            (1 - plan.gpu_memory_utilization) * total / GIB,
            (total - vllm_bytes) / GIB,
        ),
        ("this process's CUDA context (GiB)", RESERVED_GIB, (total - free_before) / GIB),
    ]
    print(f"{'figure':<36}{'plan':>14}{'measured':>14}{'ratio':>8}")
    for name, planned, measured in rows:
        shown = f"{measured:.2f}" if isinstance(measured, float) else str(measured)
        print(f"{name:<36}{planned:>14.2f}{shown:>14}{_ratio(planned, measured):>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

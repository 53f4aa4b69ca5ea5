"""Throughput of skytrain's CPU engine at concurrency 1, 4 and 16, the engine next to plain
transformers ``generate`` on the same batch, and adapter load latency.

Starts `skytrain engine serve` (the CPU engine) as a subprocess, then:

- throughput: at each concurrency C, C clients each send chat completions back to back (every
  request generates exactly --max-tokens tokens: ignore_eos) until --requests-per-client each
  are done; completion tokens / wall time. The ratio 16 vs 1 is what batching buys.
- the same batch as ``generate``: one request for --batch completions of --max-tokens tokens
  (ignore_eos) to the engine, and ``model.generate`` of the same model (fp32, as the engine
  loads it on CPU) in this process on the same prompt repeated --batch times (sampling at
  temperature 1, no top-k, min_new_tokens = max_new_tokens), with as many torch threads as the
  engine; they alternate for --generate-rounds rounds, and the medians' ratio is printed
  (below 1: the engine is faster).
- adapter load latency: a LoRA adapter (rank --lora-rank on every linear layer, made with
  peft) loaded at run time through /v1/load_lora_adapter, several times; and the latency of
  the first request served by it.

Usage:
    .venv/bin/python bench/engine_throughput.py [--model PATH_OR_ID] [--threads 1]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import machine
import openai

from skytrain_backend import hub
from skytrain_backend.engine.client import EngineClient
from skytrain_backend.engine.launcher import EngineProcess
from skytrain_backend.engine.options import EngineCommand

REPO = Path(__file__).resolve().parents[1]
CONCURRENCY = (1, 4, 16)
MESSAGES = [{"role": "user", "content": "Tell me a long story about a lighthouse keeper."}]


def _hardware(threads: int) -> str:
    gib = machine.memory_gib()
    memory = f", {gib:.0f} GiB RAM" if gib is not None else ""
    return (
        f"{machine.cpu_name()}, {os.cpu_count()} cores{memory}, no GPU; engine threads: {threads}"
    )


async def _throughput(
    client: openai.AsyncOpenAI, concurrency: int, requests_per_client: int, max_tokens: int
) -> tuple[float, int, float]:
    async def one_client() -> int:
        tokens = 0
        for _ in range(requests_per_client):
            response = await client.chat.completions.create(
                model="bench",
                messages=MESSAGES,  # type: ignore[arg-type]
                max_tokens=max_tokens,
                temperature=1.0,
                extra_body={"ignore_eos": True},
            )
            assert response.usage is not None
            tokens += response.usage.completion_tokens
        return tokens

    start = time.perf_counter()
    tokens = sum(await asyncio.gather(*(one_client() for _ in range(concurrency))))
    elapsed = time.perf_counter() - start
    return tokens / elapsed, tokens, elapsed


async def _engine_batch(client: openai.AsyncOpenAI, batch: int, max_tokens: int) -> float:
    start = time.perf_counter()
    response = await client.chat.completions.create(
        model="bench",
        messages=MESSAGES,  # type: ignore[arg-type]
        n=batch,
        max_tokens=max_tokens,
        temperature=1.0,
        extra_body={"ignore_eos": True},
    )
    elapsed = time.perf_counter() - start
    assert response.usage is not None and response.usage.completion_tokens == batch * max_tokens
    return elapsed


def _generate_batch(model_path: str, threads: int) -> Callable[[int, int], float]:
    """Plain ``generate`` of the same model in this process: a function timing one batch."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.set_num_threads(threads)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32).eval()
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer(prompt, return_tensors="pt", add_special_tokens=False)["input_ids"]

    def run(batch: int, max_tokens: int) -> float:
        input_ids = prompt_ids.repeat(batch, 1)
        start = time.perf_counter()
        with torch.inference_mode():
            output = model.generate(
                input_ids,
                attention_mask=torch.ones_like(input_ids),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                max_new_tokens=max_tokens,
                min_new_tokens=max_tokens,
                pad_token_id=tokenizer.pad_token_id,
            )
        elapsed = time.perf_counter() - start
        assert output.shape == (batch, input_ids.shape[1] + max_tokens)
        return elapsed

    return run


def _make_adapter(model_path: str, directory: Path, rank: int) -> Path:
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32)
    modules = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    config = LoraConfig(
        r=rank, lora_alpha=2 * rank, target_modules=modules, init_lora_weights=False
    )
    get_peft_model(model, config).save_pretrained(directory)
    return directory


async def _adapter_latency(
    base_url: str, adapter: Path, rounds: int
) -> tuple[list[float], list[float]]:
    loads, first_requests = [], []
    client = openai.AsyncOpenAI(base_url=f"{base_url}/v1", api_key="unused", max_retries=0)
    async with EngineClient(base_url) as engine:
        for i in range(rounds):
            name = f"adapter-{i}"
            start = time.perf_counter()
            await engine.load_lora(name, str(adapter))
            loads.append(time.perf_counter() - start)
            start = time.perf_counter()
            await client.chat.completions.create(model=name, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
            first_requests.append(time.perf_counter() - start)
            await engine.unload_lora(name)
    return loads, first_requests


async def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default=hub.SMOLLM2_ID, help="model id or directory")
    parser.add_argument("--threads", type=int, default=1, help="engine torch threads")
    parser.add_argument("--max-tokens", type=int, default=32)
    parser.add_argument("--requests-per-client", type=int, default=2)
    parser.add_argument("--lora-rank", type=int, default=16)
    parser.add_argument("--adapter-rounds", type=int, default=5)
    parser.add_argument("--batch", type=int, default=8, help="completions in the generate batch")
    parser.add_argument("--generate-rounds", type=int, default=5)
    args = parser.parse_args()

    model = hub.resolve_model(args.model, cache_dir=REPO / ".cache" / "models")
    port = machine.free_port()
    base_url = f"http://127.0.0.1:{port}"
    with tempfile.TemporaryDirectory() as scratch:
        argv = [
            str(Path(sys.executable).with_name("skytrain")),
            "engine",
            "serve",
            "--engine",
            "hf",
        ]
        argv += ["--model", model, "--served-model-name", "bench", "--port", str(port)]
        argv += ["--threads", str(args.threads), "--max-num-seqs", "32", "--log-level", "warning"]
        process = EngineProcess(
            EngineCommand(argv=argv), base_url=base_url, log_path=Path(scratch) / "engine.log"
        )
        await process.launch()
        try:
            print(f"model: {args.model}")
            print(f"hardware: {_hardware(args.threads)}")
            print(
                f"each request: {args.max_tokens} completion tokens; "
                f"{args.requests_per_client} requests per client"
            )
            client = openai.AsyncOpenAI(
                base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600
            )
            await _throughput(client, 1, 1, 4)  # warm-up
            rates = {}
            for concurrency in CONCURRENCY:
                rate, tokens, elapsed = await _throughput(
                    client, concurrency, args.requests_per_client, args.max_tokens
                )
                rates[concurrency] = rate
                print(
                    f"concurrency {concurrency:>2}: {rate:8.1f} completion tokens/s "
                    f"({tokens} tokens in {elapsed:.1f} s)"
                )
            print(f"batching: concurrency 16 vs 1 = {rates[16] / rates[1]:.1f}x tokens/s")

            generate = _generate_batch(model, args.threads)
            generate(args.batch, 4)  # warm-up
            engine_times, generate_times = [], []
            for _ in range(args.generate_rounds):
                engine_times.append(await _engine_batch(client, args.batch, args.max_tokens))
                generate_times.append(generate(args.batch, args.max_tokens))
            engine_s = statistics.median(engine_times)
            generate_s = statistics.median(generate_times)
            print(
                f"same batch ({args.batch} completions x {args.max_tokens} tokens, one prompt; "
                f"median of {args.generate_rounds}, alternating): engine {engine_s:.2f} s, "
                f"transformers generate {generate_s:.2f} s; engine / generate = "
                f"{engine_s / generate_s:.2f}"
            )

            adapter = _make_adapter(model, Path(scratch) / "adapter", args.lora_rank)
            loads, firsts = await _adapter_latency(base_url, adapter, args.adapter_rounds)
            print(
                f"adapter load at run time (rank {args.lora_rank}, all linear layers): "
                f"median {statistics.median(loads) * 1000:.0f} ms, max {max(loads) * 1000:.0f} ms "
                f"over {len(loads)} loads"
            )
            print(
                f"first 1-token request to a just-loaded adapter: "
                f"median {statistics.median(firsts) * 1000:.0f} ms"
            )
        finally:
            process.stop()


if __name__ == "__main__":
    asyncio.run(main())

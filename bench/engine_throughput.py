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

With --baseline DIR (another checkout, e.g. ``git worktree add DIR main``), an A/B under the
same load instead: two engines, this checkout's and DIR's (its ``backend`` and ``client``
first on PYTHONPATH), and --rounds rounds; each round measures both engines at concurrency
1, 4 and 16 and on the generate batch, in turn (which goes first alternates), and
``generate`` once. It prints each round with the 1-minute load average, then the medians and
the ratios of this checkout to the baseline.

Usage:
    .venv/bin/python bench/engine_throughput.py [--model PATH_OR_ID] [--threads 1]
    .venv/bin/python bench/engine_throughput.py --baseline ../main [--rounds 3]
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
from dataclasses import dataclass
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


def _engine_process(
    tree: Path, model: str, threads: int, log_path: Path
) -> tuple[EngineProcess, openai.AsyncOpenAI]:
    """`skytrain engine serve` of the checkout at ``tree`` (its packages first on the path),
    not started yet, and a client of it."""
    port = machine.free_port()
    base_url = f"http://127.0.0.1:{port}"
    argv = [str(Path(sys.executable).with_name("skytrain")), "engine", "serve", "--engine", "hf"]
    argv += ["--model", model, "--served-model-name", "bench", "--port", str(port)]
    argv += ["--threads", str(threads), "--max-num-seqs", "32", "--log-level", "warning"]
    path = os.pathsep.join(
        [str(tree / "backend"), str(tree / "client"), *filter(None, [os.environ.get("PYTHONPATH")])]
    )
    process = EngineProcess(
        EngineCommand(argv=argv, env={"PYTHONPATH": path}), base_url=base_url, log_path=log_path
    )
    client = openai.AsyncOpenAI(
        base_url=f"{base_url}/v1", api_key="unused", max_retries=0, timeout=3600
    )
    return process, client


@dataclass
class RoundFigures:
    """One engine's figures in one round of an A/B."""

    rates: dict[int, float]  # concurrency -> completion tokens/s
    batch_s: float  # the generate batch through the engine
    generate_s: float = 0.0  # the same batch through ``generate`` in the same round


async def _round(client: openai.AsyncOpenAI, args: argparse.Namespace) -> RoundFigures:
    rates = {}
    for concurrency in CONCURRENCY:
        rate, _, _ = await _throughput(
            client, concurrency, args.requests_per_client, args.max_tokens
        )
        rates[concurrency] = rate
    return RoundFigures(rates, await _engine_batch(client, args.batch, args.max_tokens))


async def compare(args: argparse.Namespace, model: str, scratch: Path) -> None:
    """This checkout's engine against the one at ``args.baseline``, rounds alternating."""
    trees = {"this": REPO, "baseline": args.baseline}
    engines = {
        name: _engine_process(tree, model, args.threads, scratch / f"engine-{name}.log")
        for name, tree in trees.items()
    }
    for process, _ in engines.values():
        await process.launch()
    try:
        print(f"model: {args.model}")
        print(f"hardware: {_hardware(args.threads)}")
        print(f"this checkout: {REPO}; baseline: {trees['baseline']}")
        print(
            f"each request: {args.max_tokens} completion tokens; "
            f"{args.requests_per_client} requests per client; generate batch: {args.batch} "
            f"completions x {args.max_tokens} tokens, one prompt"
        )
        for _, client in engines.values():
            await _throughput(client, 1, 1, 4)  # warm-up
            await _engine_batch(client, args.batch, 4)
        generate = _generate_batch(model, args.threads)
        generate(args.batch, 4)  # warm-up
        figures: dict[str, list[RoundFigures]] = {name: [] for name in engines}
        generate_times = []
        for i in range(args.rounds):
            order = list(engines) if i % 2 == 0 else list(reversed(engines))
            loads = [os.getloadavg()[0]]
            for name in order:
                figures[name].append(await _round(engines[name][1], args))
                loads.append(os.getloadavg()[0])
            generate_times.append(generate(args.batch, args.max_tokens))
            loads.append(os.getloadavg()[0])
            for name in engines:
                figures[name][-1].generate_s = generate_times[-1]
            parts = [
                f"{name} {'/'.join(f'{figures[name][-1].rates[c]:.1f}' for c in CONCURRENCY)} "
                f"tokens/s, batch {figures[name][-1].batch_s:.2f} s"
                for name in order
            ]
            print(
                f"round {i + 1}/{args.rounds} (1-min load {min(loads):.2f}-{max(loads):.2f}): "
                f"{'; '.join(parts)}; generate {generate_times[-1]:.2f} s"
            )
        generate_s = statistics.median(generate_times)

        def median(name: str, figure: Callable[[RoundFigures], float]) -> float:
            return statistics.median(figure(f) for f in figures[name])

        print(f"median of {args.rounds} rounds: this / baseline (higher tokens/s is better)")
        rows: list[tuple[str, Callable[[RoundFigures], float]]] = [
            *((f"concurrency {c:>2} tokens/s", lambda f, c=c: f.rates[c]) for c in CONCURRENCY),
            ("batching 16 vs 1", lambda f: f.rates[16] / f.rates[1]),
            ("same batch engine s", lambda f: f.batch_s),
            ("engine / generate", lambda f: f.batch_s / f.generate_s),
        ]
        for label, figure in rows:
            this, baseline = median("this", figure), median("baseline", figure)
            print(f"  {label:<26} {this:8.2f}  {baseline:8.2f}  ratio {this / baseline:.2f}")
        print(f"  transformers generate s    {generate_s:8.2f}")
    finally:
        for process, _ in engines.values():
            process.stop()


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
    parser.add_argument(
        "--baseline",
        type=lambda path: Path(path).resolve(),
        help="another checkout: compare its engine with this one's",
    )
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the --baseline A/B")
    args = parser.parse_args()

    model = hub.resolve_model(args.model, cache_dir=REPO / ".cache" / "models")
    if args.baseline is not None:
        with tempfile.TemporaryDirectory() as scratch:
            await compare(args, model, Path(scratch))
        return
    with tempfile.TemporaryDirectory() as scratch:
        process, client = _engine_process(REPO, model, args.threads, Path(scratch) / "engine.log")
        await process.launch()
        try:
            print(f"model: {args.model}")
            print(f"hardware: {_hardware(args.threads)}")
            print(
                f"each request: {args.max_tokens} completion tokens; "
                f"{args.requests_per_client} requests per client"
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
            loads, firsts = await _adapter_latency(process.base_url, adapter, args.adapter_rounds)
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

"""A request the CPU engine cannot run fails alone: the engine thread survives it and keeps
serving everyone else.

A seed of 2^64 or more used to kill the generation thread (``manual_seed`` overflows), after
which every request to that worker hung while the worker still showed ready.
"""

from __future__ import annotations

import asyncio
from pathlib import Path

import httpx
import pytest

from skytrain_backend.engine.hf.engine import HFEngine, SequenceUpdate
from skytrain_backend.engine.hf.sampling import SamplingParams
from skytrain_backend.errors import SkytrainError
from tests.engine.conftest import RunningEngine

MESSAGES = [{"role": "user", "content": "Say something."}]
# Longer than any healthy request here takes: a hung engine fails the test instead of hanging it.
HANG_S = 120


def test_a_seed_past_64_bits_is_a_400_and_the_engine_keeps_serving(
    tiny_engine: RunningEngine,
) -> None:
    for seed in (2**64, 2**63, -(2**63) - 1):
        response = httpx.post(
            f"{tiny_engine.base_url}/v1/chat/completions",
            json={"model": "tiny", "messages": MESSAGES, "seed": seed, "max_tokens": 2},
            timeout=HANG_S,
        )
        assert response.status_code == 400, response.text
        assert response.json()["error"]["message"].startswith("seed: Input should be")
    served = httpx.post(
        f"{tiny_engine.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "seed": 2**63 - 1, "max_tokens": 2},
        timeout=HANG_S,
    )
    assert served.status_code == 200, served.text
    assert served.json()["usage"]["completion_tokens"] == 2


def test_a_prompt_longer_than_the_context_could_hold_is_refused_before_it_is_tokenized(
    tiny_engine: RunningEngine,
) -> None:
    """Megabytes of prompt are refused by their length, not after tokenizing them (which
    held the engine's server up for every other request: 30 s for 20 MB)."""
    huge = "word " * 400_000  # 2 MB; the tiny engine's context is 512 tokens
    for path, body in (
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": huge}]}),
        ("/v1/completions", {"prompt": huge}),
    ):
        response = httpx.post(
            f"{tiny_engine.base_url}{path}", json={"model": "tiny", **body}, timeout=HANG_S
        )
        assert response.status_code == 400, response.text
        message = response.json()["error"]["message"]
        assert "characters" in message and "shorten the prompt" in message
    served = httpx.post(
        f"{tiny_engine.base_url}/v1/chat/completions",
        json={"model": "tiny", "messages": MESSAGES, "max_tokens": 2},
        timeout=HANG_S,
    )
    assert served.status_code == 200, served.text


async def _run(
    engine: HFEngine, request_id: str, prompt: list[int], params: SamplingParams
) -> list[SequenceUpdate]:
    async def collect() -> list[SequenceUpdate]:
        return [u async for u in engine.generate(request_id, prompt, adapter=None, params=params)]

    return await asyncio.wait_for(collect(), HANG_S)


@pytest.fixture(scope="module")
def engine(tiny_model_path: Path) -> HFEngine:
    running = HFEngine(str(tiny_model_path), served_model_name="tiny", max_model_len=256)
    yield running
    running.close()


async def test_requests_that_fail_on_the_engine_thread_fail_alone(engine: HFEngine) -> None:
    prompt = engine.tokenizer("Hello there", add_special_tokens=False).input_ids
    greedy = SamplingParams(max_tokens=4, temperature=0.0)
    # Past the checks of the HTTP layer, straight to the engine: what its thread must survive.
    overflowing_seed = SamplingParams(max_tokens=4, temperature=1.0, seed=2**70)
    outside_vocabulary = [len(engine.tokenizer) + 10**6]
    results = await asyncio.gather(
        _run(engine, "bad-seed", prompt, overflowing_seed),
        _run(engine, "good", prompt, greedy),
        _run(engine, "bad-token", outside_vocabulary, greedy),
        return_exceptions=True,
    )
    assert isinstance(results[0], SkytrainError), results[0]
    assert isinstance(results[2], SkytrainError), results[2]
    good = results[1]
    assert isinstance(good, list) and len(good) == 4
    # The engine goes on serving: the same request again gets the same tokens.
    again = await _run(engine, "later", prompt, greedy)
    assert [u.token.token_id for u in again] == [u.token.token_id for u in good]

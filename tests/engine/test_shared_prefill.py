"""Sequences admitted together with the same prompt and adapter share its prefill, and get
what prefilling each in a row of its own gives.

Two engines in this process on the same model: one shares prefills (the default), the other
runs every sequence's prompt in a row of its own (``share_prefill=False``, what the engine did
before). Each engine's thread is held at a gate while the requests are queued, so both admit
the same sequences in one step and decode the same batch: the sharing is the only difference.
Every token, text and top-logprob token must be equal, and every logprob equal up to
``LOGPROB_TOLERANCE``: a prompt prefilled in one row and in six goes through matrix products
of different shapes, which some CPUs' kernels round differently even on one thread (by about
1e-5 for SmolLM2 on an Intel Xeon; bitwise equal on AMD EPYC cores and for the tiny model).
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

from skytrain_backend.engine.hf.engine import HFEngine, SequenceUpdate
from skytrain_backend.engine.hf.sampling import SamplingParams

HANG_S = 300
LOGPROB_TOLERANCE = 1e-4
MODELS = [pytest.param("tiny"), pytest.param("smollm2", marks=pytest.mark.slow)]


@dataclass(frozen=True)
class Ask:
    request_id: str
    prompt: str
    params: SamplingParams
    n: int = 1
    adapter: str | None = None


@dataclass
class Engines:
    model_path: Path
    shared: HFEngine
    alone: HFEngine


@pytest.fixture(scope="module", params=MODELS)
def engines(request: pytest.FixtureRequest) -> Iterator[Engines]:
    # One torch thread, as the engine tests' servers run: MKL on several threads rounds a
    # row of a matrix product differently with the number of rows below 12 or so, and then
    # only floating-point noise separates the two (see ``ModelRunner.forward``).
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    path: Path = request.getfixturevalue(
        "tiny_model_path" if request.param == "tiny" else "smollm2_path"
    )
    shared = HFEngine(str(path), served_model_name="m", max_model_len=512)
    alone = HFEngine(str(path), served_model_name="m", max_model_len=512, share_prefill=False)
    yield Engines(path, shared, alone)
    shared.close()
    alone.close()
    torch.set_num_threads(threads)


async def _admitted_together(
    engine: HFEngine, asks: list[Ask]
) -> tuple[dict[str, list[SequenceUpdate]], int, int]:
    """Every update of each request, all admitted in one step; and the sequences prefilled
    and prompt rows the model ran for them."""
    sequences, rows = engine.stats.prefilled_sequences, engine.stats.prefill_rows
    gate = threading.Event()
    # A command holds the engine thread; requests queued meanwhile are admitted together.
    held = asyncio.ensure_future(engine._call(gate.wait))
    await asyncio.sleep(0)

    async def collect(ask: Ask) -> list[SequenceUpdate]:
        prompt = engine.tokenizer(ask.prompt, add_special_tokens=False).input_ids
        stream = engine.generate(
            ask.request_id, prompt, adapter=ask.adapter, params=ask.params, n=ask.n
        )
        return [update async for update in stream]

    running = [asyncio.ensure_future(collect(ask)) for ask in asks]
    await asyncio.sleep(0)
    gate.set()
    await held
    results = await asyncio.wait_for(asyncio.gather(*running), HANG_S)
    updates = {ask.request_id: result for ask, result in zip(asks, results, strict=True)}
    return (
        updates,
        engine.stats.prefilled_sequences - sequences,
        engine.stats.prefill_rows - rows,
    )


def _assert_same(
    shared: dict[str, list[SequenceUpdate]], alone: dict[str, list[SequenceUpdate]]
) -> None:
    """The same updates: tokens, texts and ends equal, logprobs up to ``LOGPROB_TOLERANCE``."""
    assert shared.keys() == alone.keys()
    for request_id, updates in shared.items():
        others = alone[request_id]
        assert len(updates) == len(others), request_id
        for ours, theirs in zip(updates, others, strict=True):
            assert (ours.index, ours.token.token_id, ours.text) == (
                theirs.index,
                theirs.token.token_id,
                theirs.text,
            ), request_id
            assert (ours.finish_reason, ours.stop_reason) == (
                theirs.finish_reason,
                theirs.stop_reason,
            )
            assert [i for i, _ in ours.token.top] == [i for i, _ in theirs.token.top]
            pairs = [(ours.token.logprob, theirs.token.logprob)]
            pairs += [
                (a, b) for (_, a), (_, b) in zip(ours.token.top, theirs.token.top, strict=True)
            ]
            assert all(abs(a - b) <= LOGPROB_TOLERANCE for a, b in pairs), (request_id, pairs)


def _choices(updates: list[SequenceUpdate]) -> dict[int, list[int]]:
    tokens: dict[int, list[int]] = {}
    for update in updates:
        tokens.setdefault(update.index, []).append(update.token.token_id)
    return tokens


def sampled(seed: int, *, top_k: int = -1, top_p: float = 1.0) -> SamplingParams:
    return SamplingParams(
        max_tokens=8,
        temperature=1.0,
        top_k=top_k,
        top_p=top_p,
        seed=seed,
        ignore_eos=True,
        num_logprobs=3,
    )


async def test_the_n_choices_of_a_request_share_one_prefill_and_get_the_unshared_tokens(
    engines: Engines,
) -> None:
    asks = [Ask("story", "Tell me a story about a lighthouse keeper.", sampled(seed=3), n=6)]
    shared, sequences, rows = await _admitted_together(engines.shared, asks)
    alone, alone_sequences, alone_rows = await _admitted_together(engines.alone, asks)
    assert (sequences, rows) == (6, 1)
    assert (alone_sequences, alone_rows) == (6, 6)
    _assert_same(shared, alone)
    # The comparison is not between six copies of one answer.
    assert len({tuple(tokens) for tokens in _choices(shared["story"]).values()}) > 1


async def test_requests_admitted_together_share_one_prefill_per_prompt_and_adapter(
    engines: Engines, make_adapter: Callable[..., Path]
) -> None:
    adapter = str(make_adapter(engines.model_path, seed=5))
    question, greeting = "What is the capital of France?", "Hi"
    asks = [
        Ask("question", question, sampled(seed=1), n=2),
        Ask("question-greedy", question, SamplingParams(max_tokens=8, temperature=0.0)),
        Ask("question-top-k", question, sampled(seed=4, top_k=5, top_p=0.9)),
        Ask("greeting", greeting, sampled(seed=7), n=2),
        Ask("question-adapter", question, sampled(seed=1), n=2, adapter="mine"),
    ]
    for engine in (engines.shared, engines.alone):
        await engine.load_adapter("mine", adapter)
    try:
        shared, sequences, rows = await _admitted_together(engines.shared, asks)
        alone, alone_sequences, alone_rows = await _admitted_together(engines.alone, asks)
    finally:
        for engine in (engines.shared, engines.alone):
            await engine.unload_adapter("mine")
    # One row each for the question to the base model, the greeting, the question to the
    # adapter (whose cache differs: its layers change the keys and values).
    assert (sequences, rows) == (8, 3)
    assert (alone_sequences, alone_rows) == (8, 8)
    _assert_same(shared, alone)
    # Same prompt and seeds, other weights: other logprobs.
    logprobs = {name: [u.token.logprob for u in shared[name]] for name in shared}
    assert logprobs["question-adapter"] != logprobs["question"]

"""Per-row sampling and incremental detokenization, on real tensors and SmolLM2's tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoTokenizer

from skytrain_backend.engine.hf.detokenizer import IncrementalDetokenizer
from skytrain_backend.engine.hf.sampling import (
    SamplingParams,
    filter_top_k_top_p,
    gather_logprobs,
    sample_next_tokens,
)


def test_top_k_and_top_p_keep_the_most_likely_tokens_of_each_row() -> None:
    probs = torch.tensor([[0.5, 0.3, 0.15, 0.05], [0.5, 0.3, 0.15, 0.05], [0.1, 0.2, 0.3, 0.4]])
    logits = probs.log()
    kept = filter_top_k_top_p(logits, torch.tensor([2, 0, 0]), torch.tensor([1.0, 0.7, 0.65]))
    finite = kept.isfinite()
    assert finite.tolist() == [
        [True, True, False, False],  # top-2
        [True, True, False, False],  # 0.5 < 0.7, then 0.8 >= 0.7
        [False, False, True, True],  # 0.4 < 0.65, then 0.7
    ]
    assert torch.equal(kept[finite], logits[finite])


def test_greedy_rows_take_the_argmax_and_seeded_rows_repeat() -> None:
    logits = torch.randn(3, 50, generator=torch.Generator().manual_seed(0))
    params = [
        SamplingParams(max_tokens=1, temperature=0.0),
        SamplingParams(max_tokens=1, temperature=1.0),
        SamplingParams(max_tokens=1, temperature=1.0, top_k=1),
    ]

    def draw(seed: int) -> list[int]:
        generators = [torch.Generator().manual_seed(seed + i) for i in range(3)]
        return sample_next_tokens(logits.clone(), params, generators).tolist()

    first = draw(5)
    assert first[0] == int(logits[0].argmax())
    assert first[2] == int(logits[2].argmax())  # top_k=1 leaves one candidate
    assert draw(5) == first
    draws = {draw(seed)[1] for seed in range(20)}
    assert len(draws) > 1  # temperature 1 over 50 tokens: seeds change the draw


def test_logprobs_are_those_of_the_chosen_tokens_and_top_k_is_sorted() -> None:
    logprobs = torch.randn(2, 10).log_softmax(dim=-1)
    tokens = torch.tensor([3, 7])
    chosen, top = gather_logprobs(logprobs, tokens, 3)
    assert chosen == pytest.approx([float(logprobs[0, 3]), float(logprobs[1, 7])])
    for row, candidates in enumerate(top):
        assert [i for i, _ in candidates] == logprobs[row].topk(3).indices.tolist()
        values = [v for _, v in candidates]
        assert values == sorted(values, reverse=True)
    assert gather_logprobs(logprobs, tokens, 0)[1] == [[], []]


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> object:
    return AutoTokenizer.from_pretrained(smollm2_path)


def _feed(
    tokenizer: object, text: str, params: SamplingParams
) -> tuple[str, str | None, list[str]]:
    detokenizer = IncrementalDetokenizer(tokenizer, params)
    released, stop = [], None
    for token_id in tokenizer(text, add_special_tokens=False).input_ids:  # type: ignore[operator]
        stop = detokenizer.add(token_id)
        if stop is not None:
            break
        released.append(detokenizer.release(final=False))
    released.append(detokenizer.release(final=True))
    return "".join(released), stop, released


def test_detokenizer_rebuilds_multibyte_text_exactly(tokenizer: object) -> None:
    text = "Grüße, 世界! 🙂 done"
    full, stop, pieces = _feed(tokenizer, text, SamplingParams(max_tokens=100))
    assert (full, stop) == (text, None)
    assert all("\ufffd" not in piece for piece in pieces)


def test_detokenizer_stops_at_the_earliest_stop_string_and_never_releases_it(
    tokenizer: object,
) -> None:
    params = SamplingParams(max_tokens=100, stop=("END", "Stop here"))
    full, stop, pieces = _feed(tokenizer, "Some words. Stop here END more", params)
    assert (full, stop) == ("Some words. ", "Stop here")
    assert "Stop" not in "".join(pieces)

    included = SamplingParams(max_tokens=100, stop=("END",), include_stop_str_in_output=True)
    assert _feed(tokenizer, "abc END def", included)[:2] == ("abc END", "END")

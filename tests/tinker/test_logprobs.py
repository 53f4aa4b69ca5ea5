"""What the tinker SDK's evaluators and reference models ask of a sampler, each checked against
a direct forward pass of the same model: ``compute_logprobs``, prompt logprobs with their top
tokens (``include_prompt_logprobs``, ``topk_prompt_logprobs``, ``prompt_logprobs_last_n``), and
the sampled tokens' top logprobs (``topk_sample_logprobs``); and datums with different optional
inputs trained on together."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM
from transformers.utils import logging as transformers_logging

import tinker
from tests.tinker.test_sdk import TIMEOUT_S, ClientFactory, new_training_client, train_step
from tinker import types

pytestmark = [pytest.mark.e2e]

PROMPT = [1, 17, 230, 5, 99, 4, 12, 40]
ATOL = 1e-3  # the engine's batched fp32 kernels against a plain forward pass


@pytest.fixture(scope="module")
def direct(tiny_model_path: Path) -> Iterator[torch.nn.Module]:
    """The base model in torch, outside skytrain."""
    transformers_logging.disable_progress_bar()
    model = AutoModelForCausalLM.from_pretrained(tiny_model_path, dtype=torch.float32)
    yield model.eval()


def _logprobs(model: torch.nn.Module, tokens: list[int]) -> torch.Tensor:
    """Row ``i``: the distribution of the token after position ``i``."""
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0].float().log_softmax(dim=-1)


def _top(row: torch.Tensor, k: int) -> list[tuple[int, float]]:
    values, ids = row.topk(k)
    return list(zip(ids.tolist(), values.tolist(), strict=True))


def _assert_pairs(got: list[tuple[int, float]] | None, want: list[tuple[int, float]]) -> None:
    assert got is not None
    assert [token for token, _ in got] == [token for token, _ in want]
    assert [value for _, value in got] == pytest.approx([value for _, value in want], abs=ATOL)


@pytest.mark.slow
def test_prompt_and_top_logprobs_are_those_of_a_direct_forward_pass(
    tinker_client: ClientFactory, base_model: str, direct: torch.nn.Module
) -> None:
    sampler = (
        tinker_client("alice").create_sampling_client(base_model=base_model).result(timeout=60)
    )
    expected = _logprobs(direct, PROMPT)
    own = [float(expected[i - 1, PROMPT[i]]) for i in range(1, len(PROMPT))]

    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(
        timeout=TIMEOUT_S
    )
    assert logprobs[0] is None
    assert logprobs[1:] == pytest.approx(own, abs=ATOL)

    result = sampler.sample(
        prompt=types.ModelInput.from_ints(PROMPT),
        num_samples=2,
        sampling_params=types.SamplingParams(max_tokens=4, temperature=1.0, seed=3, stop=[]),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=2,
        topk_sample_logprobs=2,
        prompt_logprobs_last_n=3,
    ).result(timeout=TIMEOUT_S)
    # Only the last 3 prompt positions are scored.
    assert result.prompt_logprobs is not None and result.topk_prompt_logprobs is not None
    assert result.prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    assert result.prompt_logprobs[-3:] == pytest.approx(own[-3:], abs=ATOL)
    assert result.topk_prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    for position in range(len(PROMPT) - 3, len(PROMPT)):
        _assert_pairs(result.topk_prompt_logprobs[position], _top(expected[position - 1], 2))
    # Each sampled token's top 2, from a forward pass over the prompt and what was sampled.
    for sequence in result.sequences:
        assert len(sequence.tokens) == 4 and sequence.topk_logprobs is not None
        rows = _logprobs(direct, PROMPT + sequence.tokens)
        for i, token in enumerate(sequence.tokens):
            row = rows[len(PROMPT) - 1 + i]
            _assert_pairs(sequence.topk_logprobs[i], _top(row, 2))
            assert sequence.logprobs is not None
            assert sequence.logprobs[i] == pytest.approx(float(row[token]), abs=ATOL)

    # Requests that cannot be answered are refused, naming the field.
    with pytest.raises(tinker.BadRequestError, match="prompt_logprobs_last_n"):
        sampler.compute_logprobs(
            types.ModelInput.from_ints(PROMPT), prompt_logprobs_last_n=len(PROMPT)
        ).result(timeout=TIMEOUT_S)


@pytest.mark.slow
def test_a_trained_samplers_prompt_logprobs_are_the_trainers(
    tinker_client: ClientFactory, base_model: str
) -> None:
    training = new_training_client(tinker_client("alice"), base_model)
    train_step(training)
    sampler = training.save_weights_and_get_sampling_client().result(timeout=TIMEOUT_S)
    logprobs = sampler.compute_logprobs(types.ModelInput.from_ints(PROMPT)).result(
        timeout=TIMEOUT_S
    )
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:-1]),
        loss_fn_inputs={"target_tokens": types.TensorData(data=PROMPT[1:], dtype="int64")},
    )
    forward = training.forward([datum], "cross_entropy").result(timeout=TIMEOUT_S)
    trained = forward.loss_fn_outputs[0]["logprobs"].tolist()
    assert logprobs[1:] == pytest.approx(trained, abs=ATOL)

    # Datums with and without weights, in one request, in either order: each weighed as
    # if alone (its own weights; none means ones).
    plain = datum
    weighted = types.Datum(
        model_input=types.ModelInput.from_ints(PROMPT[:4]),
        loss_fn_inputs={
            "target_tokens": types.TensorData(data=PROMPT[1:5], dtype="int64"),
            "weights": types.TensorData(data=[0.0, 2.0, 0.5, 1.0], dtype="float32"),
        },
    )
    alone = [
        training.forward([d], "cross_entropy").result(timeout=TIMEOUT_S).metrics["loss:sum"]
        for d in (plain, weighted)
    ]
    for order in ([plain, weighted], [weighted, plain]):
        together = training.forward(order, "cross_entropy").result(timeout=TIMEOUT_S)
        assert together.metrics["loss:sum"] == pytest.approx(sum(alone), rel=1e-4)

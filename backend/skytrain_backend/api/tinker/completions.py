"""A Tinker sample as the engines take it: the ``/v1/completions`` body for a prompt's token
ids (``sampling_body``), and the sampled tokens, their logprobs and the prompt's read back
from the answer (``parse_completion``, ``parse_prompt_logprobs``), in the SDK's shapes."""

from __future__ import annotations

from typing import Any

from skytrain_backend.errors import EngineError
from skytrain_backend.protocol import TOKEN_ID_PREFIX, tinker_protobuf
from skytrain_backend.protocol.tinker_api import TinkerSamplingParams


def sampling_body(
    *,
    prompt: list[int],
    num_samples: int,
    params: TinkerSamplingParams,
    topk_sample_logprobs: int = 0,
    prompt_logprobs: int | None = None,
) -> dict[str, Any]:
    """A ``/v1/completions`` request for the engine (vLLM's sampling parameters): the sampled
    tokens' logprobs with their top ``topk_sample_logprobs``, and with ``prompt_logprobs``
    (a number of top tokens) each prompt token's logprob too."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n": num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": topk_sample_logprobs,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
    if prompt_logprobs is not None:
        body["prompt_logprobs"] = prompt_logprobs
    if params.top_k > 0:
        body["top_k"] = params.top_k
    if params.seed is not None:
        body["seed"] = params.seed
    stop = params.stop
    if stop == []:
        body["ignore_eos"] = True  # Tinker: an empty list disables every stop, EOS included
    elif isinstance(stop, str):
        body["stop"] = [stop]
    elif stop and all(isinstance(item, int) for item in stop):
        body["stop_token_ids"] = list(stop)
    elif stop:
        body["stop"] = list(stop)
    return body


def _top(row: dict[str, float], k: int) -> list[tuple[int, float]]:
    """The ``k`` most likely of an engine's top-logprob entries (keyed ``token_id:<id>``; the
    sampled token is among them even outside the top k)."""
    pairs = [(int(key.removeprefix(TOKEN_ID_PREFIX)), float(value)) for key, value in row.items()]
    return sorted(pairs, key=lambda pair: -pair[1])[:k]


def parse_completion(
    answer: Any, *, num_samples: int, k: int = 0
) -> list[tinker_protobuf.SampledSequence]:
    """The sampled token ids and logprobs of each choice of an engine's completion, with
    each position's ``k`` most likely tokens when asked for."""
    try:
        choices = sorted(answer["choices"], key=lambda choice: choice["index"])
        sequences = []
        for choice in choices:
            logprobs = choice["logprobs"]
            tokens = [int(token.removeprefix(TOKEN_ID_PREFIX)) for token in logprobs["tokens"]]
            values = [float(value) for value in logprobs["token_logprobs"]]
            if len(tokens) != len(values):
                raise ValueError("tokens and logprobs differ in length")
            stop = "length" if choice.get("finish_reason") == "length" else "stop"
            topk = None
            if k:
                topk = [_top(row, k) for row in logprobs["top_logprobs"]]
                if len(topk) != len(tokens):
                    raise ValueError("top logprobs and tokens differ in length")
            sequences.append(tinker_protobuf.SampledSequence(tokens, values, stop, topk))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"the engine's completion has no token ids with logprobs ({exc})"
        ) from None
    if len(sequences) != num_samples:
        raise EngineError(f"the engine returned {len(sequences)} samples, not {num_samples}")
    return sequences


def parse_prompt_logprobs(
    answer: Any, body: dict[str, Any], *, last_n: int | None
) -> tinker_protobuf.PromptScores | None:
    """The prompt tokens' logprobs (and top ones) from an engine's completion, in vLLM's
    ``prompt_logprobs`` format; only the last ``last_n`` positions kept when given."""
    k = body.get("prompt_logprobs")
    if k is None:
        return None
    prompt: list[int] = body["prompt"]
    try:
        rows = answer["choices"][0]["prompt_logprobs"]
        if len(rows) != len(prompt):
            raise ValueError(f"{len(rows)} prompt logprobs for {len(prompt)} prompt tokens")
        logprobs: list[float | None] = [None]
        topk: list[tinker_protobuf.TopLogprobs] = [None]
        for token, row in zip(prompt[1:], rows[1:], strict=True):
            logprobs.append(float(row[str(token)]["logprob"]))
            entries = {TOKEN_ID_PREFIX + key: entry["logprob"] for key, entry in row.items()}
            topk.append(_top(entries, k) if k else None)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise EngineError(f"the engine's completion has no prompt logprobs ({exc})") from None
    if last_n is not None:
        hidden = len(prompt) - last_n
        for position in range(hidden):
            logprobs[position] = topk[position] = None
    return tinker_protobuf.PromptScores(logprobs, topk if k else None)

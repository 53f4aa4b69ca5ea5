"""The prompt and top logprobs the Tinker protocol asks engines for, on both engines (the
contract's ``engine`` fixture: the CPU engine, and vLLM under ``scripts/test-vllm.sh``): the
engine's answer in vLLM's format is read by the control plane's own parsers, and a prompt
token's logprob is the one the engine gave it when it sampled that token."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from skytrain_backend.api.tinker.completions import (
    parse_completion,
    parse_prompt_logprobs,
    sampling_body,
)
from skytrain_backend.protocol.tinker_api import TinkerSamplingParams
from tests.engine.conftest import RunningEngine
from tests.engine.test_engine_contract import LOGPROB_NOISE, engine  # noqa: F401 (fixture)

PROMPT = [1, 17, 230, 5, 99, 4, 12]


def _complete(engine: RunningEngine, body: dict[str, Any]) -> Any:  # noqa: F811 (the fixture)
    headers = {"Authorization": f"Bearer {engine.api_key}"} if engine.api_key else {}
    response = httpx.post(
        f"{engine.base_url}/v1/completions",
        json={**body, "model": engine.name},
        headers=headers,
        timeout=300,
    )
    assert response.status_code == 200, response.text
    return response.json()


def test_prompt_logprobs_agree_with_the_sampled_tokens_logprobs(
    engine: RunningEngine,  # noqa: F811
) -> None:
    noise = LOGPROB_NOISE[engine.kind]
    greedy = TinkerSamplingParams(max_tokens=1, temperature=0.0, stop=[])
    sampled_body = sampling_body(
        prompt=PROMPT, num_samples=1, params=greedy, topk_sample_logprobs=2
    )
    (sampled,) = parse_completion(_complete(engine, sampled_body), num_samples=1, k=2)
    assert sampled.topk is not None and len(sampled.topk[0] or []) == 2
    token = sampled.tokens[0]

    scored_body = sampling_body(
        prompt=[*PROMPT, token], num_samples=1, params=greedy, prompt_logprobs=2
    )
    scored = parse_prompt_logprobs(_complete(engine, scored_body), scored_body, last_n=None)
    assert scored is not None and scored.topk is not None
    assert len(scored.logprobs) == len(PROMPT) + 1 and scored.logprobs[0] is None
    assert all(value is not None and value <= 0 for value in scored.logprobs[1:])
    last = scored.logprobs[-1]
    assert last == pytest.approx(sampled.logprobs[0], abs=noise)
    # The greedy token is the most likely one, in both answers' top two.
    assert scored.topk[-1] is not None and sampled.topk[0] is not None
    assert scored.topk[-1][0][0] == sampled.topk[0][0][0] == token
    assert [value for _, value in scored.topk[-1]] == pytest.approx(
        [value for _, value in sampled.topk[0]], abs=noise
    )

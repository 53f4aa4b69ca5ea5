"""What a gateway request asks for, checked before it goes anywhere, and what it costs.

The body is the caller's OpenAI request: JSON, with a ``model``, its options within the
ranges of ``api/schemas.py``. Each tenant's requests in flight (streams count until they
end; across every control plane on a PostgreSQL database, ``api/admission/tenant_load.py``) are
counted three ways, each against the tenant's limit (``db.tenants``): requests, sequences (``n``
times the number of prompts) and tokens (the body's bytes, an upper bound of the prompt's tokens,
plus ``n`` x ``max_tokens``, which the gateway defaults to ``SKYTRAIN_GATEWAY_DEFAULT_MAX_TOKENS``
when the request sets none). The request that would pass one gets 429 with ``Retry-After``; one that
could never fit (more sequences or tokens than the limit itself) gets 400.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from skytrain_backend.api.schemas import ChatCompletionCreate, CompletionCreate
from skytrain_backend.db.tenant_loads import Load
from skytrain_backend.db.tenants import TenantLimits
from skytrain_backend.errors import InvalidRequest
from skytrain_backend.protocol import format_validation_error


@dataclass(frozen=True)
class Endpoint:
    path: str
    ask_for_logprobs: Callable[[dict[str, Any]], None]
    # The options checked before the request goes to a worker.
    schema: type[ChatCompletionCreate | CompletionCreate]


def _chat_logprobs(body: dict[str, Any]) -> None:
    body["logprobs"] = True
    body["return_tokens_as_token_ids"] = True
    body["return_token_ids"] = True


def _completion_logprobs(body: dict[str, Any]) -> None:
    # Completions take the number of top logprobs; 0 still returns the sampled token's.
    if body.get("logprobs") is None or isinstance(body["logprobs"], bool):
        body["logprobs"] = 0
    body["return_tokens_as_token_ids"] = True
    body["return_token_ids"] = True


CHAT = Endpoint("/v1/chat/completions", _chat_logprobs, ChatCompletionCreate)
COMPLETIONS = Endpoint("/v1/completions", _completion_logprobs, CompletionCreate)


def parse_body(raw: bytes, endpoint: Endpoint) -> dict[str, Any]:
    """The caller's JSON, its options checked against their ranges (``endpoint.schema``)."""
    constants: list[str] = []

    def constant(name: str) -> float:
        constants.append(name)
        return float(name)

    try:
        body = json.loads(raw, parse_constant=constant)
    except ValueError as exc:
        raise InvalidRequest(f"the body is not valid JSON ({exc})") from None
    if not isinstance(body, dict):
        raise InvalidRequest("the body must be a JSON object (an OpenAI request)")
    if not isinstance(body.get("model"), str) or not body["model"]:
        raise InvalidRequest(
            "model is required: pass '<entity>/<project>/<name>' or "
            "'<entity>/<project>/<name>:step<N>' (GET /v1/models lists yours)"
        )
    if "stream" in body and not isinstance(body["stream"], bool | None):
        raise InvalidRequest(f"stream must be true or false, not {body['stream']!r}")
    try:
        endpoint.schema.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(format_validation_error(exc)) from None
    if constants:
        raise InvalidRequest(
            f"the body holds {constants[0]}, which is not a JSON number: send finite numbers"
        )
    return body


def with_default_max_tokens(body: dict[str, Any], *, default_max_tokens: int) -> None:
    """Give a request that sets no ``max_tokens`` (nor ``max_completion_tokens``) the
    default: an engine would otherwise generate until the context is full (for ``n=128``,
    minutes of a worker's time), and the request is counted for that much already."""
    if body.get("max_tokens") is None and body.get("max_completion_tokens") is None:
        body["max_tokens"] = default_max_tokens


def cost(body: dict[str, Any], *, size: int, default_max_tokens: int) -> Load:
    """What the request holds while in flight. Values the engine will refuse (a negative
    ``n``, a string ``max_tokens``) count as their defaults: the engine's 400 follows."""
    n = _positive_int(body.get("n")) or 1
    prompt = body.get("prompt")
    prompts = (
        len(prompt) if isinstance(prompt, list) and prompt and not _is_token_ids(prompt) else 1
    )
    max_tokens = (
        _positive_int(body.get("max_completion_tokens"))
        or _positive_int(body.get("max_tokens"))
        or default_max_tokens
    )
    sequences = n * prompts
    return Load(requests=1, sequences=sequences, tokens=size + sequences * max_tokens)


def _positive_int(value: object) -> int | None:
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else None


def _is_token_ids(prompt: list[Any]) -> bool:
    """A completion prompt given as one list of token ids (not a list of prompts)."""
    return all(isinstance(item, int) for item in prompt)


def check_fits(limits: TenantLimits, cost: Load) -> None:
    """A request larger than its tenant's whole allowance can never be admitted: 400."""
    if cost.sequences > limits.max_sequences_in_flight:
        raise InvalidRequest(
            f"this request asks for {cost.sequences} sequences (n times the number of "
            f"prompts), more than the {limits.max_sequences_in_flight} your tenant may have "
            "in flight (max_sequences_in_flight): lower n, or split the request"
        )
    if cost.tokens > limits.max_tokens_in_flight:
        raise InvalidRequest(
            f"this request counts {cost.tokens} tokens (its body's bytes plus n x max_tokens), "
            "more than the "
            f"{limits.max_tokens_in_flight} your tenant may have in flight "
            "(max_tokens_in_flight): send a shorter prompt, or lower n or max_tokens"
        )

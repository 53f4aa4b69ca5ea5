"""The HTTP surface the engines speak: the subset of ``vllm serve`` skytrain relies on.

Requests are validated strictly where skytrain gives a field meaning and leniently elsewhere:
unknown fields are ignored (as vLLM does), but a known OpenAI option the CPU engine cannot
honour (``presence_penalty`` != 0, ``echo``...) is refused with a 400 naming it, so a caller is
never silently given something other than what it asked for. Responses mirror OpenAI's (and
vLLM's) JSON so the official ``openai`` SDK parses them; ``stop_reason`` is vLLM's extra field.

No torch here: the engine client and the tests import this module.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Mapping
from typing import Any, ClassVar, Literal, NotRequired

from pydantic import BaseModel, ConfigDict, Field, model_validator
from typing_extensions import TypedDict

from skytrain_backend.chat_template import ToolSpec
from skytrain_backend.json_types import JSONObject
from skytrain_backend.protocol import Message, TokenLogprob, ToolCall
from skytrain_backend.ranges import INT32_MAX, Seed

FinishReason = Literal["stop", "length", "tool_calls"]

MAX_TOP_LOGPROBS = 20


def random_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


class _Request(BaseModel):
    """Ignores unknown fields; refuses known options the engine does not implement."""

    model_config = ConfigDict(extra="ignore")

    # Options OpenAI defines that skytrain's engines do not implement, with their no-op value.
    UNSUPPORTED: ClassVar[Mapping[str, object]] = {
        "presence_penalty": 0.0,
        "frequency_penalty": 0.0,
        "repetition_penalty": 1.0,
        "logit_bias": None,
        "best_of": 1,
        "echo": False,
        "suffix": None,
        "response_format": None,
        "guided_json": None,
        "guided_regex": None,
        "guided_choice": None,
        "structured_outputs": None,
    }

    @model_validator(mode="before")
    @classmethod
    def _refuse_unsupported(cls, data: Any) -> Any:
        if isinstance(data, dict):
            for key, neutral in cls.UNSUPPORTED.items():
                value = data.get(key)
                if value is not None and value != neutral:
                    raise ValueError(
                        f"{key}={value!r} is not supported by skytrain's engine; "
                        f"leave it out or use {neutral!r}"
                    )
        return data


class StreamOptions(BaseModel):
    include_usage: bool = False


class _SamplingFields(_Request):
    model: str = Field(min_length=1)
    n: int = Field(default=1, ge=1, le=128)
    temperature: float | None = Field(default=None, ge=0.0, allow_inf_nan=False)
    top_p: float | None = Field(default=None, gt=0.0, le=1.0)
    top_k: int | None = Field(default=None, ge=-1, le=INT32_MAX)
    max_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    # A signed 64-bit integer, as vLLM takes: the generator of each choice is seeded with it.
    seed: Seed | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    # vLLM's extra sampling parameters.
    return_tokens_as_token_ids: bool = False
    # The prompt's token ids and the sampled ids in the response (vLLM's fields).
    return_token_ids: bool = False
    ignore_eos: bool = False
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        return [s for s in stops if s]

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(_SamplingFields):
    messages: list[Message] = Field(min_length=1)
    tools: list[ToolSpec] | None = None
    tool_choice: Literal["none", "auto"] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1, le=INT32_MAX)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    add_generation_prompt: bool = True
    chat_template_kwargs: JSONObject | None = None

    @model_validator(mode="before")
    @classmethod
    def _explain_tool_choice(cls, data: Any) -> Any:
        if isinstance(data, dict):
            choice = data.get("tool_choice")
            if choice is not None and choice not in ("none", "auto"):
                raise ValueError(
                    f"tool_choice={choice!r} is not supported by skytrain's engine (it would need "
                    "constrained decoding); use 'auto' and check the returned tool_calls"
                )
        return data

    @model_validator(mode="after")
    def _check_logprobs(self) -> ChatCompletionRequest:
        if self.top_logprobs and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """None: no logprobs; k >= 0: the sampled token's logprob and the top k."""
        return (self.top_logprobs or 0) if self.logprobs else None

    @property
    def parses_tool_calls(self) -> bool:
        return bool(self.tools) and self.tool_choice != "none"


Prompt = str | list[str] | list[int] | list[list[int]]


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(default=16, ge=1, le=INT32_MAX)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)
    # vLLM's: each prompt token's logprob (and this many most likely tokens at its position).
    prompt_logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_LOGPROBS)

    @model_validator(mode="after")
    def _check_prompt(self) -> CompletionRequest:
        if self.prompt == [] or self.prompt == "" or self.prompt == [[]]:
            raise ValueError("prompt is empty: send a string or a list of token ids")
        if self.prompt_logprobs is not None and self.stream:
            raise ValueError("prompt_logprobs is served on completions that are not streamed")
        return self

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class ControlCall(TypedDict):
    """A control call the CPU engine carried out (its ``/control_log``): the call, when
    (Unix time), and what it named."""

    call: str
    at: float
    lora_name: NotRequired[str]
    aborted_requests: NotRequired[int]


class LoadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)
    lora_path: str = Field(min_length=1)
    # Replace an adapter already loaded under this name (vLLM's flag of the same name).
    load_inplace: bool = False


class UnloadLoRAAdapterRequest(BaseModel):
    lora_name: str = Field(min_length=1)


# --- responses ----------------------------------------------------------------------------------


class _Response(BaseModel):
    def to_json(self) -> dict[str, Any]:
        return self.model_dump(mode="json")


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(_Response):
    """vLLM's (and OpenAI's) error body; ``code`` is the HTTP status, as vLLM sends it."""

    error: ErrorInfo


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "skytrain"
    root: str | None = None
    parent: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


# Token logprobs and tool calls are the very types a trajectory stores (``protocol.py``).
class ChatLogprobs(BaseModel):
    content: list[TokenLogprob] | None = None


class ChatMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: ChatMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletion(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    prompt_token_ids: list[int] | None = None


class DeltaFunctionCall(BaseModel):
    name: str
    arguments: str


class DeltaToolCall(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: DeltaFunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChatLogprobs | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    token_ids: list[int] | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    # Only in a stream's first chunk, as vLLM sends it.
    prompt_token_ids: list[int] | None = None


class CompletionLogprobs(BaseModel):
    """The legacy completions logprobs format."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float]] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """One token's entry in a choice's ``prompt_logprobs`` (vLLM's format, keyed by token id)."""

    logprob: float
    rank: int
    decoded_token: str


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    # One entry per prompt token (None for the first): the token's and the top ones' logprobs.
    prompt_logprobs: list[dict[str, PromptLogprob] | None] | None = None
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None
    prompt_token_ids: list[int] | None = None
    token_ids: list[int] | None = None


class Completion(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None

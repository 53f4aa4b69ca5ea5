"""OpenAI chat completions and completions on top of the CPU engine.

Turns a validated request into prompt token ids (the model's chat template, with ``tools``),
checks it against the context length, runs it, and shapes the engine's per-token updates into
OpenAI responses or server-sent-event chunks exactly as vLLM does where skytrain depends on it:

- every sampled token appears in ``logprobs.content``, including the end-of-sequence token that
  stopped generation (its text is not in the message), so the ids there are exactly the
  sampled ids the trainer will splice;
- with ``return_tokens_as_token_ids`` each token reads ``"token_id:<id>"``;
- ``usage.completion_tokens`` counts those same tokens, over all choices.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from skytrain_backend.chat_template import template_message, template_tools
from skytrain_backend.engine.hf.engine import HFEngine
from skytrain_backend.engine.hf.requests import SampledToken, SequenceUpdate
from skytrain_backend.engine.hf.sampling import SamplingParams
from skytrain_backend.engine.hf.toolcalls import parse_tool_calls, streamable_prefix
from skytrain_backend.engine.wire import (
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatLogprobs,
    ChatMessage,
    Completion,
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    DeltaFunctionCall,
    DeltaToolCall,
    ErrorInfo,
    ErrorResponse,
    FinishReason,
    ModelCard,
    ModelList,
    PromptLogprob,
    Usage,
    random_id,
)
from skytrain_backend.errors import InvalidRequest, SkytrainError, Unavailable
from skytrain_backend.protocol import (
    TOKEN_ID_PREFIX,
    Message,
    TokenLogprob,
    ToolCall,
    TopLogprob,
)

SSE_DONE = "data: [DONE]\n\n"

_T = TypeVar("_T")
_R = TypeVar("_R")


def sse(payload: Mapping[str, object]) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def error_response(error: SkytrainError) -> ErrorResponse:
    return ErrorResponse(
        error=ErrorInfo(message=error.message, type=error.type, code=error.status_code)
    )


@dataclass
class _Choice:
    """What one choice has produced so far."""

    tokens: list[SampledToken] = field(default_factory=list)
    text: str = ""
    streamed: int = 0  # characters of ``text`` already sent as content
    sent_tokens: int = 0  # tokens already sent in a chunk
    finish_reason: FinishReason | None = None
    stop_reason: int | str | None = None


class OpenAIServing:
    def __init__(self, engine: HFEngine) -> None:
        self.engine = engine
        self.tokenizer = engine.tokenizer
        self._token_text: dict[int, str] = {}
        # No token covers more characters than the longest in the vocabulary: a text longer
        # than the context times that cannot fit, and is refused before it is tokenized
        # (tokenizing megabytes would hold up every other request on the server's loop).
        longest_token = max(len(token) for token in self.tokenizer.get_vocab())
        self.max_prompt_chars = engine.max_model_len * longest_token
        # The tokenizer is not safe to call from several threads at once.
        self._tokenizer_lock = threading.Lock()

    def models(self) -> ModelList:
        base = self.engine.served_model_name
        cards = [
            ModelCard(
                id=base, root=self.engine.runner.model_path, max_model_len=self.engine.max_model_len
            )
        ]
        cards += [
            ModelCard(id=a.name, root=a.path, parent=base, max_model_len=self.engine.max_model_len)
            for a in list(self.engine.adapters.values())
        ]
        return ModelList(data=cards)

    # --- chat completions -------------------------------------------------------------------

    async def chat(
        self, request: ChatCompletionRequest, *, tenant: str | None = None
    ) -> ChatCompletion | AsyncIterator[str]:
        """The answer to ``request``; ``tenant`` (who asked) is whose turn it takes."""
        adapter = self._check_servable(request.model)
        prompt_ids = await self._tokenize(self._chat_prompt, request)
        params = self._sampling_params(request, len(prompt_ids))
        updates = self.engine.generate(
            random_id("req"), prompt_ids, adapter=adapter, params=params, n=request.n, tenant=tenant
        )
        response_id, created = random_id("chatcmpl"), int(time.time())
        if request.stream:
            return self._stream_chat(request, updates, response_id, created, prompt_ids)
        choices = [_Choice() for _ in range(request.n)]
        async for update in updates:
            _record(choices[update.index], update)
        return ChatCompletion(
            id=response_id,
            created=created,
            model=request.model,
            choices=[self._chat_choice(request, i, c) for i, c in enumerate(choices)],
            usage=_usage(len(prompt_ids), choices),
            prompt_token_ids=prompt_ids if request.return_token_ids else None,
        )

    def _chat_prompt(self, request: ChatCompletionRequest) -> list[int]:
        for position, message in enumerate(request.messages):
            _check_text_only(position, message)
        messages = [template_message(message) for message in request.messages]
        try:
            text = self.tokenizer.apply_chat_template(
                messages,
                tools=template_tools(request.tools),
                add_generation_prompt=request.add_generation_prompt,
                tokenize=False,
                **(request.chat_template_kwargs or {}),
            )
        except Exception as exc:  # jinja2 raises many kinds; all mean "these messages don't fit"
            raise InvalidRequest(
                f"the model's chat template cannot render these messages: {exc}"
            ) from exc
        self._check_prompt_length(str(text))
        return list(self.tokenizer(text, add_special_tokens=False).input_ids)

    def _check_prompt_length(self, text: str) -> None:
        if len(text) > self.max_prompt_chars:
            raise InvalidRequest(
                f"This model's maximum context length is {self.engine.max_model_len} tokens, "
                f"which no prompt of more than {self.max_prompt_chars} characters fits, and the "
                f"prompt has {len(text)}: shorten the prompt"
            )

    def _chat_choice(
        self, request: ChatCompletionRequest, index: int, choice: _Choice
    ) -> ChatChoice:
        content: str | None = choice.text
        tool_calls: list[ToolCall] = []
        finish_reason: FinishReason | None = choice.finish_reason
        if request.parses_tool_calls:
            content, tool_calls = parse_tool_calls(choice.text)
            if tool_calls:
                finish_reason = "tool_calls"
        return ChatChoice(
            index=index,
            message=ChatMessage(content=content, tool_calls=tool_calls),
            logprobs=self._chat_logprobs(request, choice.tokens) if request.logprobs else None,
            finish_reason=finish_reason,
            stop_reason=choice.stop_reason,
            token_ids=_token_ids(choice.tokens) if request.return_token_ids else None,
        )

    async def _stream_chat(
        self,
        request: ChatCompletionRequest,
        updates: AsyncIterator[SequenceUpdate],
        response_id: str,
        created: int,
        prompt_ids: list[int],
    ) -> AsyncIterator[str]:
        def chunk(
            choices: list[ChatChunkChoice],
            usage: Usage | None = None,
            prompt_token_ids: list[int] | None = None,
        ) -> str:
            return sse(
                ChatCompletionChunk(
                    id=response_id,
                    created=created,
                    model=request.model,
                    choices=choices,
                    usage=usage,
                    prompt_token_ids=prompt_token_ids,
                ).to_json()
            )

        choices = [_Choice() for _ in range(request.n)]
        for index in range(request.n):
            yield chunk(
                [ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=""))],
                prompt_token_ids=prompt_ids if request.return_token_ids and index == 0 else None,
            )
        try:
            async for update in updates:
                choice = choices[update.index]
                _record(choice, update)
                logprobs = (
                    self._chat_logprobs(request, [update.token]) if request.logprobs else None
                )
                delta = self._chat_delta(request, choice)
                finish_reason = choice.finish_reason
                if finish_reason is not None and delta.tool_calls:
                    finish_reason = "tool_calls"
                if delta.content or delta.tool_calls or logprobs or finish_reason:
                    yield chunk(
                        [
                            ChatChunkChoice(
                                index=update.index,
                                delta=delta,
                                logprobs=logprobs,
                                finish_reason=finish_reason,
                                stop_reason=choice.stop_reason,
                                token_ids=_token_ids(choice.tokens[choice.sent_tokens :])
                                if request.return_token_ids
                                else None,
                            )
                        ]
                    )
                    choice.sent_tokens = len(choice.tokens)
        except SkytrainError as exc:
            yield sse(error_response(exc).to_json())
        else:
            if request.include_usage:
                yield chunk([], usage=_usage(len(prompt_ids), choices))
        yield SSE_DONE

    def _chat_delta(self, request: ChatCompletionRequest, choice: _Choice) -> ChatDelta:
        """New content of a choice; with tools, a possible call is held back until the end."""
        if not request.parses_tool_calls:
            delta = choice.text[choice.streamed :]
            choice.streamed = len(choice.text)
            return ChatDelta(content=delta)
        if choice.finish_reason is None:
            end = max(streamable_prefix(choice.text), choice.streamed)
            delta = choice.text[choice.streamed : end]
            choice.streamed = end
            return ChatDelta(content=delta)
        content, calls = parse_tool_calls(choice.text)
        rest = choice.text[choice.streamed :] if not calls else (content or "")[choice.streamed :]
        choice.streamed = len(choice.text)
        tool_calls = [
            DeltaToolCall(
                index=i,
                id=call.id,
                function=DeltaFunctionCall(
                    name=call.function.name, arguments=call.function.arguments
                ),
            )
            for i, call in enumerate(calls)
        ]
        return ChatDelta(content=rest or None, tool_calls=tool_calls or None)

    def _chat_logprobs(
        self, request: ChatCompletionRequest, tokens: list[SampledToken]
    ) -> ChatLogprobs:
        as_ids = request.return_tokens_as_token_ids
        content = []
        for token in tokens:
            # As vLLM: ``bytes`` are the token's own text even when ``token`` is its id.
            content.append(
                TokenLogprob(
                    token=self._text(token.token_id, as_ids),
                    logprob=token.logprob,
                    bytes=_bytes(self._text(token.token_id, False)),
                    top_logprobs=[
                        TopLogprob(
                            token=self._text(top_id, as_ids),
                            logprob=top_logprob,
                            bytes=_bytes(self._text(top_id, False)),
                        )
                        for top_id, top_logprob in token.top
                    ],
                )
            )
        return ChatLogprobs(content=content)

    # --- completions --------------------------------------------------------------------------

    async def completion(
        self, request: CompletionRequest, *, tenant: str | None = None
    ) -> Completion | AsyncIterator[str]:
        """The answer to ``request``; ``tenant`` (who asked) is whose turn it takes."""
        adapter = self._check_servable(request.model)
        prompts = await self._tokenize(self._completion_prompts, request.prompt)
        runs = []
        for prompt_ids in prompts:
            params = self._sampling_params(request, len(prompt_ids))
            runs.append(
                self.engine.generate(
                    random_id("req"),
                    prompt_ids,
                    adapter=adapter,
                    params=params,
                    n=request.n,
                    tenant=tenant,
                )
            )
        prompt_tokens = sum(len(p) for p in prompts)
        response_id, created = random_id("cmpl"), int(time.time())
        updates = _merge(runs, request.n)
        if request.stream:
            return self._stream_completion(request, updates, response_id, created, prompts)
        scored = [
            await self._prompt_logprobs(request, prompt_ids, adapter) for prompt_ids in prompts
        ]
        choices = [_Choice() for _ in range(request.n * len(prompts))]
        async for index, update in updates:
            _record(choices[index], update)
        return Completion(
            id=response_id,
            created=created,
            model=request.model,
            choices=[
                CompletionChoice(
                    index=i,
                    text=c.text,
                    logprobs=self._completion_logprobs(request, c.tokens, 0),
                    prompt_logprobs=scored[i // request.n],
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                    prompt_token_ids=prompts[i // request.n] if request.return_token_ids else None,
                    token_ids=_token_ids(c.tokens) if request.return_token_ids else None,
                )
                for i, c in enumerate(choices)
            ],
            usage=_usage(prompt_tokens, choices),
        )

    def _completion_prompts(
        self, prompt: str | list[str] | list[int] | list[list[int]]
    ) -> list[list[int]]:
        items: list[str | int | list[int]] = [prompt] if isinstance(prompt, str) else list(prompt)
        if all(isinstance(item, int) for item in items):
            items = [[item for item in items if isinstance(item, int)]]
        for item in items:
            if isinstance(item, str):
                self._check_prompt_length(item)
        prompts: list[list[int]] = [
            list(self.tokenizer(item).input_ids) if isinstance(item, str) else item
            for item in items
            if not isinstance(item, int)
        ]
        vocab = len(self.tokenizer)
        for i, ids in enumerate(prompts):
            if not ids:
                raise InvalidRequest(f"prompt {i} is empty")
            bad = [t for t in ids if not 0 <= t < vocab]
            if bad:
                raise InvalidRequest(
                    f"prompt {i} has token ids outside the vocabulary (0..{vocab - 1}): {bad[:5]}"
                )
        return prompts

    async def _stream_completion(
        self,
        request: CompletionRequest,
        updates: AsyncIterator[tuple[int, SequenceUpdate]],
        response_id: str,
        created: int,
        prompts: list[list[int]],
    ) -> AsyncIterator[str]:
        choices: dict[int, _Choice] = {}
        try:
            async for index, update in updates:
                first = index not in choices
                choice = choices.setdefault(index, _Choice())
                offset = len(choice.text)
                _record(choice, update)
                token_ids = request.return_token_ids
                body = Completion(
                    id=response_id,
                    created=created,
                    model=request.model,
                    choices=[
                        CompletionChoice(
                            index=index,
                            text=update.text,
                            logprobs=self._completion_logprobs(request, [update.token], offset),
                            finish_reason=update.finish_reason,
                            stop_reason=update.stop_reason,
                            prompt_token_ids=prompts[index // request.n]
                            if token_ids and first
                            else None,
                            token_ids=[update.token.token_id] if token_ids else None,
                        )
                    ],
                )
                yield sse(body.to_json())
        except SkytrainError as exc:
            yield sse(error_response(exc).to_json())
        else:
            if request.include_usage:
                usage = _usage(sum(len(p) for p in prompts), list(choices.values()))
                body = Completion(
                    id=response_id, created=created, model=request.model, choices=[], usage=usage
                )
                yield sse(body.to_json())
        yield SSE_DONE

    async def _prompt_logprobs(
        self, request: CompletionRequest, prompt_ids: list[int], adapter: str | None
    ) -> list[dict[str, PromptLogprob] | None] | None:
        """vLLM's ``prompt_logprobs``: per prompt token, a dict keyed by token id of its own
        and the top tokens' logprobs (None for the first token)."""
        if request.prompt_logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        k = request.prompt_logprobs
        result: list[dict[str, PromptLogprob] | None] = []
        for token in await self.engine.score_prompt(prompt_ids, adapter=adapter, k=k):
            if token is None:
                result.append(None)
                continue
            entry = {
                str(token_id): PromptLogprob(
                    logprob=logprob, rank=rank + 1, decoded_token=self._text(token_id, as_ids)
                )
                for rank, (token_id, logprob) in enumerate(token.top)
            }
            entry[str(token.token_id)] = PromptLogprob(
                logprob=token.logprob,
                rank=token.rank,
                decoded_token=self._text(token.token_id, as_ids),
            )
            result.append(entry)
        return result

    def _completion_logprobs(
        self, request: CompletionRequest, tokens: list[SampledToken], offset: int
    ) -> CompletionLogprobs | None:
        if request.logprobs is None:
            return None
        as_ids = request.return_tokens_as_token_ids
        result = CompletionLogprobs()
        for token in tokens:
            text = self._text(token.token_id, as_ids)
            result.tokens.append(text)
            result.token_logprobs.append(token.logprob)
            result.text_offset.append(offset)
            offset += len(self._text(token.token_id, False))
            top = {self._text(i, as_ids): lp for i, lp in token.top}
            top.setdefault(text, token.logprob)
            result.top_logprobs.append(top)
        return result

    # --- shared -------------------------------------------------------------------------------

    async def _tokenize(self, render: Callable[[_T], _R], item: _T) -> _R:
        """``render(item)`` (templating and tokenizing) off the event loop, one at a time: a
        long prompt delays the next prompt's tokenizing, never the streams being sent."""
        return await asyncio.to_thread(self._tokenizing_one_at_a_time, render, item)

    def _tokenizing_one_at_a_time(self, render: Callable[[_T], _R], item: _T) -> _R:
        with self._tokenizer_lock:
            return render(item)

    def _check_servable(self, model: str) -> str | None:
        adapter = self.engine.resolve_model(model)
        if self.engine.is_sleeping:
            raise Unavailable("the engine is sleeping: POST /wake_up before sending requests")
        return adapter

    def _sampling_params(
        self, request: ChatCompletionRequest | CompletionRequest, prompt_tokens: int
    ) -> SamplingParams:
        limit = self.engine.max_model_len
        room = limit - prompt_tokens
        if room <= 0:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens, and the prompt has "
                f"{prompt_tokens} tokens: shorten the prompt"
            )
        requested = request.requested_max_tokens
        if requested is not None and requested > room:
            raise InvalidRequest(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{prompt_tokens + requested} tokens ({prompt_tokens} in the prompt, {requested} "
                f"for the completion): lower max_tokens to at most {room}"
            )
        return SamplingParams(
            max_tokens=requested if requested is not None else room,
            temperature=1.0 if request.temperature is None else request.temperature,
            top_p=1.0 if request.top_p is None else request.top_p,
            top_k=-1 if request.top_k is None else request.top_k,
            seed=request.seed,
            stop=tuple(request.stop_strings()),
            stop_token_ids=tuple(request.stop_token_ids or ()),
            ignore_eos=request.ignore_eos,
            num_logprobs=request.num_logprobs,
            skip_special_tokens=request.skip_special_tokens,
            include_stop_str_in_output=request.include_stop_str_in_output,
        )

    def _text(self, token_id: int, as_id: bool) -> str:
        if as_id:
            return f"{TOKEN_ID_PREFIX}{token_id}"
        text = self._token_text.get(token_id)
        if text is None:
            text = self._token_text[token_id] = str(self.tokenizer.decode([token_id]))
        return text


def _record(choice: _Choice, update: SequenceUpdate) -> None:
    choice.tokens.append(update.token)
    choice.text += update.text
    if update.finish_reason is not None:
        choice.finish_reason = update.finish_reason
        choice.stop_reason = update.stop_reason


def _usage(prompt_tokens: int, choices: Sequence[_Choice]) -> Usage:
    completion_tokens = sum(len(c.tokens) for c in choices)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def _bytes(text: str) -> list[int]:
    return list(text.encode("utf-8", errors="replace"))


def _check_text_only(position: int, message: Message) -> None:
    if isinstance(message.content, list):
        kinds = {part.get("type") for part in message.content} - {"text"}
        if kinds:
            raise InvalidRequest(
                f"messages[{position}] has content parts of type {sorted(map(str, kinds))}: this "
                "engine serves text-only models, send text parts only"
            )


def _token_ids(tokens: Sequence[SampledToken]) -> list[int]:
    return [token.token_id for token in tokens]


async def _merge(
    runs: list[AsyncIterator[SequenceUpdate]], n: int
) -> AsyncIterator[tuple[int, SequenceUpdate]]:
    """Interleave the runs of several prompts; choice ``index`` = prompt * n + sequence."""
    if len(runs) == 1:
        async for update in runs[0]:
            yield update.index, update
        return
    queue: asyncio.Queue[tuple[int, SequenceUpdate] | BaseException | None] = asyncio.Queue()

    async def drain(prompt: int, run: AsyncIterator[SequenceUpdate]) -> None:
        try:
            async for update in run:
                await queue.put((prompt * n + update.index, update))
        except BaseException as exc:
            await queue.put(exc)
            raise
        await queue.put(None)

    tasks = [asyncio.create_task(drain(i, run)) for i, run in enumerate(runs)]
    try:
        remaining = len(tasks)
        while remaining:
            item = await queue.get()
            if item is None:
                remaining -= 1
            elif isinstance(item, BaseException):
                raise item
            else:
                yield item
    finally:
        for task in tasks:
            task.cancel()
        with contextlib.suppress(asyncio.CancelledError, SkytrainError):
            await asyncio.gather(*tasks, return_exceptions=True)

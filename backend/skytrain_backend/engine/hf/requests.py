"""What the CPU engine's thread works on: requests, their fair queue, sequences, the batch.

A request's sequences wait in ``FairQueue`` (one queue per key, the keys taking turns; see
``engine.py``), are admitted as ``SequenceState`` objects that sample with their own
generator and detokenize as they go, and decode together in one ``Batch`` whose KV cache
(``kvcache``) grows as sequences join and shrinks as they finish. What a step produced for a sequence goes
back to its request's asyncio queue as a ``SequenceUpdate`` (or ``RequestFailed``).
"""

from __future__ import annotations

import asyncio
import contextlib
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Literal

import torch
from transformers import DynamicCache

from skytrain_backend.engine.hf import kvcache
from skytrain_backend.engine.hf.detokenizer import IncrementalDetokenizer
from skytrain_backend.engine.hf.sampling import SamplingParams
from skytrain_backend.errors import SkytrainError

EngineFinishReason = Literal["stop", "length"]


@dataclass(frozen=True)
class SampledToken:
    token_id: int
    logprob: float
    # The most likely (token id, logprob) pairs at this step, when top logprobs were asked for.
    top: list[tuple[int, float]] = field(default_factory=list)


@dataclass(frozen=True)
class SequenceUpdate:
    """What one step produced for one sequence (choice ``index`` of its request)."""

    index: int
    token: SampledToken
    text: str
    finish_reason: EngineFinishReason | None = None
    stop_reason: int | str | None = None


@dataclass(frozen=True)
class RequestFailed:
    error: SkytrainError


@dataclass
class EngineStats:
    """What the engine thread has computed since it started."""

    # Sequences prefilled, and the prompt rows the model ran for them: fewer rows than
    # sequences when sequences shared a prompt's prefill.
    prefilled_sequences: int = 0
    prefill_rows: int = 0


@dataclass(frozen=True)
class Adapter:
    name: str
    path: str
    internal_name: str


@dataclass(eq=False)
class Request:
    """A submitted request as the engine thread sees it."""

    request_id: str
    prompt_token_ids: list[int]
    adapter: str | None
    params: SamplingParams
    n: int
    # Whose turn it takes (see the module docstring), and its sequences admitted so far.
    key: str
    loop: asyncio.AbstractEventLoop
    admitted: int = 0
    queue: asyncio.Queue[SequenceUpdate | RequestFailed] = field(default_factory=asyncio.Queue)

    def publish(self, item: SequenceUpdate | RequestFailed) -> None:
        publish_all([(self, item)])


def publish_all(items: list[tuple[Request, SequenceUpdate | RequestFailed]]) -> None:
    """Hand each item to its request's queue: one wake-up of each event loop for all of them
    (a step's tokens for a whole batch), rather than one per token."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Request, Any]]] = {}
    for request, item in items:
        by_loop.setdefault(request.loop, []).append((request, item))
    for loop, delivered in by_loop.items():
        # A closed event loop raises RuntimeError: nobody is listening any more.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_deliver, delivered)


def _deliver(items: list[tuple[Request, SequenceUpdate | RequestFailed]]) -> None:
    for request, item in items:
        request.queue.put_nowait(item)


class FairQueue:
    """Waiting requests, one queue per key; the keys take turns, one sequence at a time.

    The dict's order is the order of turns: a key that was served moves to the end.
    """

    def __init__(self) -> None:
        self._queues: dict[str, deque[Request]] = {}

    def __bool__(self) -> bool:
        return bool(self._queues)

    def push(self, request: Request) -> None:
        self._queues.setdefault(request.key, deque()).append(request)

    def next_request(self, held: Counter[str], cap: int) -> Request | None:
        """The head request of the first key in turn that holds fewer than ``cap`` places;
        that key's turn passes (it moves to the end)."""
        for key, queue in self._queues.items():
            if held[key] < cap:
                self._queues[key] = self._queues.pop(key)
                return queue[0]
        return None

    def done(self, request: Request) -> None:
        """Take a request out (all its sequences admitted, or failed)."""
        queue = self._queues.get(request.key)
        if queue is None:
            return
        with contextlib.suppress(ValueError):
            queue.remove(request)
        if not queue:
            del self._queues[request.key]

    def remove(self, request_ids: set[str]) -> None:
        for queue in list(self._queues.values()):
            for request in [r for r in queue if r.request_id in request_ids]:
                self.done(request)

    def drain(self) -> list[Request]:
        requests = [request for queue in self._queues.values() for request in queue]
        self._queues.clear()
        return requests


class SequenceState:
    def __init__(
        self,
        request: Request,
        index: int,
        internal_adapter: str | None,
        tokenizer: Any,
        device: torch.device,
    ) -> None:
        self.request = request
        self.index = index
        self.internal_adapter = internal_adapter
        self.params = request.params
        self.prompt_len = len(request.prompt_token_ids)
        self.num_generated = 0
        self.finished = False
        self.detokenizer = IncrementalDetokenizer(tokenizer, self.params)
        self.generator = torch.Generator(device=device)
        if self.params.seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(self.params.seed + index)

    def append(
        self, token: SampledToken, *, eos_token_ids: frozenset[int], max_len: int
    ) -> SequenceUpdate:
        """Record a sampled token, decide whether the sequence is done; the step to publish."""
        params = self.params
        self.num_generated += 1
        finish_reason: EngineFinishReason | None = None
        stop_reason: int | str | None = None
        if token.token_id in params.stop_token_ids:
            finish_reason, stop_reason = "stop", token.token_id
        elif token.token_id in eos_token_ids and not params.ignore_eos:
            finish_reason = "stop"
        else:
            matched = self.detokenizer.add(token.token_id)
            if matched is not None:
                finish_reason, stop_reason = "stop", matched
        if finish_reason is None and (
            self.num_generated >= params.max_tokens
            or self.prompt_len + self.num_generated >= max_len
        ):
            finish_reason = "length"
        if finish_reason is not None:
            self.finished = True
            if stop_reason is None or isinstance(stop_reason, int):
                self.detokenizer.flush()
        text = self.detokenizer.release(final=self.finished)
        return SequenceUpdate(self.index, token, text, finish_reason, stop_reason)


@dataclass(eq=False)
class Batch:
    """Running sequences, left-padded to a common length; the cache lacks each last token."""

    sequences: list[SequenceState]
    cache: DynamicCache
    attention_mask_BL: torch.Tensor
    next_tokens_B: torch.Tensor
    positions_B: torch.Tensor

    def absorb(self, other: Batch) -> None:
        width, other_width = self.attention_mask_BL.shape[1], other.attention_mask_BL.shape[1]
        self.attention_mask_BL = kvcache.left_pad(
            self.cache, self.attention_mask_BL, max(other_width - width, 0)
        )
        other.attention_mask_BL = kvcache.left_pad(
            other.cache, other.attention_mask_BL, max(width - other_width, 0)
        )
        kvcache.concatenate(self.cache, other.cache)
        self.attention_mask_BL = torch.cat([self.attention_mask_BL, other.attention_mask_BL])
        self.next_tokens_B = torch.cat([self.next_tokens_B, other.next_tokens_B])
        self.positions_B = torch.cat([self.positions_B, other.positions_B])
        self.sequences += other.sequences

    def drop_finished(self) -> bool:
        """Remove finished sequences; False when none is left."""
        keep = [i for i, sequence in enumerate(self.sequences) if not sequence.finished]
        if not keep:
            return False
        if len(keep) < len(self.sequences):
            rows = torch.tensor(keep, device=self.next_tokens_B.device)
            self.attention_mask_BL = kvcache.keep_rows(self.cache, self.attention_mask_BL, rows)
            self.next_tokens_B = self.next_tokens_B[rows]
            self.positions_B = self.positions_B[rows]
            self.sequences = [self.sequences[i] for i in keep]
        return True

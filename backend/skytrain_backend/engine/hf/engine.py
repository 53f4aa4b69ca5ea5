"""skytrain's CPU engine: continuous batching over a KV cache, several LoRA adapters at once.

One thread owns the model. It loops: run pending commands (load/unload an adapter, sleep,
wake), admit waiting sequences, decode one token for every running sequence, and publish each
new token to its request's asyncio queue as soon as it is sampled. Sequences that arrive while
others run are prefilled as a group and join the running batch at the next step (see
``kvcache``), so requests that arrive together are decoded together whatever adapter they use:
one forward pass serves every adapter in the batch. Sequences admitted in the same step with
the same prompt and adapter (a request's ``n`` choices, identical requests) share one row of
the prefill: the prompt is run once and its cache copied for each (``EngineStats`` counts
both), with the very tokens and logprobs that prefilling each in a row of its own gives
(bitwise on one thread where the CPU's kernels allow; see ``ModelRunner.forward``).

Each sequence carries its own sampling parameters and random generator (seeded with
``seed + index`` for a request with ``n`` choices, as vLLM does), so batching never changes a
seeded result beyond floating-point noise. The logprob of each sampled token comes from the
very logits it was sampled from.

Fair sharing: waiting requests are queued per *key* (the tenant the gateway names, else the
model or adapter asked for), and the batch is filled one sequence at a time, the keys taking
turns. A request's ``n`` sequences join as room frees (one with ``n`` above the batch size
does not need the batch to itself), and no key holds more than ``max_num_seqs -
reserved_seqs`` places, so a new tenant's request starts at the next step however much
another tenant has queued: its latency grows with the batch's size, not with the other
tenant's backlog.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import itertools
import logging
import threading
import time
from collections import Counter, deque
from collections.abc import AsyncIterator, Callable
from typing import Literal, TypeVar

import torch

from skytrain_backend.engine.hf import kvcache
from skytrain_backend.engine.hf.requests import (
    Adapter,
    Batch,
    EngineStats,
    FairQueue,
    Request,
    RequestFailed,
    SampledToken,
    SequenceState,
    SequenceUpdate,
    publish_all,
)
from skytrain_backend.engine.hf.runner import ModelRunner, PromptTokenLogprob, read_adapter
from skytrain_backend.engine.hf.sampling import SamplingParams, gather_logprobs, sample_next_tokens
from skytrain_backend.engine.wire import ControlCall
from skytrain_backend.errors import (
    ConfigurationError,
    EngineError,
    InvalidRequest,
    NotFound,
    SkytrainError,
    Unavailable,
)

logger = logging.getLogger(__name__)

T = TypeVar("T")

ASLEEP_MESSAGE = "the engine is sleeping: POST /wake_up before sending requests"
PAUSING_MESSAGE = "the engine is going to sleep once its running requests finish: retry later"

# What ``sleep`` does with requests in flight (vLLM's ``/sleep?mode=``): abort them, or let
# them finish while new ones are refused.
SleepMode = Literal["abort", "wait"]


class HFEngine:
    """A transformers + peft model behind an asyncio API; see the module docstring."""

    def __init__(
        self,
        model_path: str,
        *,
        served_model_name: str,
        max_model_len: int | None = None,
        max_num_seqs: int = 32,
        reserved_seqs: int | None = None,
        dtype: str = "auto",
        device: str | None = None,
        max_lora_rank: int | None = None,
        share_prefill: bool = True,
    ) -> None:
        """``share_prefill=False`` prefills every sequence in a row of its own (as the engine
        did before sharing; the tests compare the two)."""
        self.runner = ModelRunner(model_path, dtype=dtype, device=device)
        self.share_prefill = share_prefill
        self.stats = EngineStats()
        self.max_lora_rank = max_lora_rank
        self.served_model_name = served_model_name
        self.tokenizer = self.runner.tokenizer
        limit = self.runner.max_position_embeddings()
        if max_model_len is not None and limit is not None and max_model_len > limit:
            raise ConfigurationError(
                f"max_model_len {max_model_len} exceeds the model's "
                f"max_position_embeddings ({limit}); pass at most {limit}"
            )
        resolved = max_model_len or limit
        if resolved is None:
            raise ConfigurationError(
                f"{model_path} does not state its context length: pass --max-model-len"
            )
        self.max_model_len = resolved
        self.max_num_seqs = max_num_seqs
        # Places no single key may take, kept for the next one to arrive (default: an eighth).
        reserved = max(1, max_num_seqs // 8) if reserved_seqs is None else reserved_seqs
        if not 0 <= reserved < max_num_seqs:
            raise ConfigurationError(
                f"reserved_seqs {reserved} must be at least 0 and below max_num_seqs "
                f"({max_num_seqs})"
            )
        self.max_seqs_per_key = max_num_seqs - reserved
        self.eos_token_ids = self.runner.eos_token_ids()
        self.adapters: dict[str, Adapter] = {}
        self._internal_names = (f"lora{i}" for i in itertools.count())
        self._retired: set[str] = set()
        self._asleep = False
        # Set while a sleep waits for running requests: new requests are refused meanwhile.
        self._pausing = False
        # Sleeps waiting for the running requests to finish (``sleep(mode="wait")``).
        self._pending_sleeps: list[concurrent.futures.Future[None]] = []
        # Control calls as the engine thread carried them out: {"call", "at" (Unix time), ...}.
        self.control_log: list[ControlCall] = []
        self._batch: Batch | None = None
        self._mergeable: bool | None = None
        self._waiting = FairQueue()
        self._commands: deque[Callable[[], None]] = deque()
        self._aborted: set[str] = set()
        self._wakeup = threading.Condition()
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="skytrain-hf-engine", daemon=True)
        self._thread.start()

    # --- the asyncio side -------------------------------------------------------------------

    @property
    def is_sleeping(self) -> bool:
        return self._asleep

    def resolve_model(self, model: str) -> str | None:
        """The adapter a request's ``model`` names (None for the base model); 404 otherwise."""
        if model == self.served_model_name:
            return None
        if model in self.adapters:
            return model
        served = ", ".join([self.served_model_name, *self.adapters])
        raise NotFound(f"The model `{model}` does not exist. Served models: {served}")

    async def generate(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        *,
        adapter: str | None,
        params: SamplingParams,
        n: int = 1,
        tenant: str | None = None,
    ) -> AsyncIterator[SequenceUpdate]:
        """Every step of the ``n`` sequences of one prompt, as they are sampled.

        ``tenant`` (who asked) is whose turn the request takes; without one, the model's.
        """
        if self._asleep:
            raise Unavailable(ASLEEP_MESSAGE)
        if self._pausing:
            raise Unavailable(PAUSING_MESSAGE)
        key = f"tenant:{tenant}" if tenant else f"model:{adapter or self.served_model_name}"
        request = Request(
            request_id, prompt_token_ids, adapter, params, n, key, asyncio.get_running_loop()
        )
        with self._wakeup:
            self._waiting.push(request)
            self._wakeup.notify()
        running = n
        try:
            while running:
                item = await request.queue.get()
                if isinstance(item, RequestFailed):
                    raise item.error
                running -= item.finish_reason is not None
                yield item
        finally:
            if running:
                self.abort(request_id)

    async def score_prompt(
        self, prompt_token_ids: list[int], *, adapter: str | None, k: int
    ) -> list[PromptTokenLogprob | None]:
        """``Runner.score_prompt`` on the engine thread, between two decode steps."""
        if self._asleep:
            raise Unavailable(ASLEEP_MESSAGE)
        return await self._call(
            lambda: self.runner.score_prompt(prompt_token_ids, self._internal_adapter(adapter), k=k)
        )

    def abort(self, request_id: str) -> None:
        with self._wakeup:
            self._aborted.add(request_id)
            self._wakeup.notify()

    async def load_adapter(self, name: str, path: str, *, replace: bool = False) -> None:
        self._require_awake()
        if name == self.served_model_name:
            raise InvalidRequest(f"The lora adapter '{name}' conflicts with the served base model.")
        if name in self.adapters and not replace:
            raise InvalidRequest(
                f"The lora adapter '{name}' has already been loaded: unload it first, or pass "
                "load_inplace=true to replace it"
            )
        # Reading the files is slow and touches no model state: do it off the engine thread.
        weights = await asyncio.to_thread(read_adapter, path)
        rank = int(weights.config.r)
        if self.max_lora_rank is not None and rank > self.max_lora_rank:
            raise InvalidRequest(
                f"LoRA rank {rank} of adapter '{name}' is greater than max_lora_rank "
                f"{self.max_lora_rank}: start the engine with a larger --max-lora-rank"
            )

        def load() -> None:
            self._require_awake()
            if name in self.adapters and not replace:
                raise InvalidRequest(f"The lora adapter '{name}' has already been loaded.")
            internal_name = next(self._internal_names)
            self.runner.add_adapter(internal_name, weights)
            previous = self.adapters.get(name)
            self.adapters[name] = Adapter(name, path, internal_name)
            if previous is not None:
                self._retire(previous.internal_name)
            self._record("load_lora_adapter", lora_name=name)

        await self._call(load)

    async def unload_adapter(self, name: str) -> None:
        def unload() -> None:
            adapter = self.adapters.pop(name, None)
            if adapter is None:
                raise NotFound(f"The lora adapter '{name}' cannot be found.")
            self._retire(adapter.internal_name)
            self._record("unload_lora_adapter", lora_name=name)

        await self._call(unload)

    async def sleep(self, mode: SleepMode = "abort") -> None:
        """Drop the weights. ``abort`` fails the requests in flight at once; ``wait`` refuses
        new requests and lets those in flight (running or admitted) finish first."""
        if mode == "abort" or self._asleep:
            await self._call(self._sleep)
            return
        future: concurrent.futures.Future[None] = concurrent.futures.Future()
        with self._wakeup:
            self._pausing = True
            self._pending_sleeps.append(future)
            self._wakeup.notify()
        await asyncio.wrap_future(future)

    async def wake_up(self) -> None:
        await self._call(self._wake_up)

    def close(self) -> None:
        with self._wakeup:
            self._stopping = True
            self._wakeup.notify()
        self._thread.join(timeout=30)

    async def _call(self, command: Callable[[], T]) -> T:
        """Run ``command`` on the engine thread between two decode steps."""
        future: concurrent.futures.Future[T] = concurrent.futures.Future()

        def run() -> None:
            try:
                future.set_result(command())
            except BaseException as exc:
                future.set_exception(exc)

        with self._wakeup:
            self._commands.append(run)
            self._wakeup.notify()
        return await asyncio.wrap_future(future)

    # --- the engine thread ------------------------------------------------------------------

    def _run(self) -> None:
        with torch.inference_mode():
            while True:
                with self._wakeup:
                    while not (
                        self._stopping
                        or self._commands
                        or self._waiting
                        or self._aborted
                        or self._batch
                        or self._pending_sleeps
                    ):
                        self._wakeup.wait()
                    if self._stopping:
                        return
                    commands = list(self._commands)
                    self._commands.clear()
                    aborted = set(self._aborted)
                    self._aborted.clear()
                # Nothing a request does may end this thread: every later request would hang.
                try:
                    for command in commands:
                        command()
                    self._drop_aborted(aborted)
                    admitted = self._admit()
                    if admitted:
                        self._prefill_each_alone_if_needed(admitted)
                    if self._batch is not None:
                        self._step()
                except Exception as exc:
                    logger.exception("decode step failed")
                    self._fail_all(EngineError(f"the engine failed while decoding: {exc}"))
                self._sleep_when_idle()

    def _sleep_when_idle(self) -> None:
        """Carry out the sleeps that wait, once no request runs or waits any more."""
        with self._wakeup:
            if not self._pending_sleeps or self._batch is not None or self._waiting:
                return
            pending, self._pending_sleeps = self._pending_sleeps, []
        try:
            self._sleep()
        except BaseException as exc:
            for future in pending:
                future.set_exception(exc)
        else:
            for future in pending:
                future.set_result(None)

    def _admit(self) -> list[SequenceState]:
        """Waiting sequences that fit in the batch, one at a time, the keys taking turns."""
        running = self._batch.sequences if self._batch else []
        if running and not self._mergeable:
            return []
        held = Counter(sequence.request.key for sequence in running)
        admitted: list[SequenceState] = []
        with self._wakeup:
            while len(running) + len(admitted) < self.max_num_seqs:
                request = self._waiting.next_request(held, self.max_seqs_per_key)
                if request is None:
                    break
                try:
                    internal = self._internal_adapter(request.adapter)
                    sequence = SequenceState(
                        request, request.admitted, internal, self.tokenizer, self.runner.device
                    )
                except Exception as exc:
                    # Nothing a request carries may stop the others: it fails alone, with the
                    # sequences of it admitted so far.
                    self._waiting.done(request)
                    admitted = [s for s in admitted if s.request is not request]
                    request.publish(RequestFailed(_request_error(exc)))
                    continue
                admitted.append(sequence)
                request.admitted += 1
                held[request.key] += 1
                if request.admitted == request.n:
                    self._waiting.done(request)
        return admitted

    def _prefill_each_alone_if_needed(self, sequences: list[SequenceState]) -> None:
        """Prefill the admitted sequences together; if that fails, each request's alone, so
        a request that cannot run fails by itself while the others (and the running batch,
        which a failed prefill leaves untouched) go on."""
        requests = list(dict.fromkeys(s.request for s in sequences))
        if len(requests) > 1:
            try:
                self._prefill(sequences)
                return
            except Exception:
                logger.warning("prefill of %d requests failed; retrying each alone", len(requests))
        for request in requests:
            try:
                self._prefill([s for s in sequences if s.request is request])
            except Exception as exc:
                logger.exception("request %s failed in prefill", request.request_id)
                request.publish(RequestFailed(_request_error(exc)))

    def _internal_adapter(self, name: str | None) -> str | None:
        if self._asleep:
            raise Unavailable(ASLEEP_MESSAGE)
        if name is None:
            return None
        adapter = self.adapters.get(name)
        if adapter is None:
            raise NotFound(f"The lora adapter '{name}' was unloaded before the request started.")
        return adapter.internal_name

    def _prompt_rows(self, sequences: list[SequenceState]) -> tuple[list[SequenceState], list[int]]:
        """The sequences whose prompts the prefill runs (one per distinct prompt and adapter
        when prefills are shared), and for each sequence the index of its row among them."""
        if not (self.share_prefill and self.runner.can_expand_rows()):
            return sequences, list(range(len(sequences)))
        rows: dict[tuple[str | None, tuple[int, ...]], int] = {}
        prompts: list[SequenceState] = []
        row_of: list[int] = []
        for sequence in sequences:
            key = (sequence.internal_adapter, tuple(sequence.request.prompt_token_ids))
            if key not in rows:
                rows[key] = len(prompts)
                prompts.append(sequence)
            row_of.append(rows[key])
        return prompts, row_of

    def _prefill(self, sequences: list[SequenceState]) -> None:
        device = self.runner.device
        prompts, row_of = self._prompt_rows(sequences)
        width = max(sequence.prompt_len for sequence in prompts)
        pad = self.tokenizer.pad_token_id or 0
        input_ids_UT = torch.tensor(
            [[pad] * (width - s.prompt_len) + s.request.prompt_token_ids for s in prompts],
            device=device,
        )
        attention_mask_UL = torch.tensor(
            [[0] * (width - s.prompt_len) + [1] * s.prompt_len for s in prompts], device=device
        )
        position_ids_UT = (attention_mask_UL.cumsum(dim=-1) - 1).clamp(min=0)
        rows_B = torch.tensor(row_of, device=device) if len(prompts) < len(sequences) else None
        logits_BV, cache = self.runner.forward(
            input_ids_UT,
            attention_mask_UL,
            position_ids_UT,
            None,
            [s.internal_adapter for s in prompts],
            rows_B=rows_B,
        )
        self.stats.prefilled_sequences += len(sequences)
        self.stats.prefill_rows += len(prompts)
        if self._mergeable is None:
            self._mergeable = kvcache.is_mergeable(cache)
        batch = Batch(
            sequences,
            cache,
            attention_mask_UL if rows_B is None else attention_mask_UL[rows_B],
            self._sample(sequences, logits_BV),
            torch.tensor([s.prompt_len for s in sequences], device=device),
        )
        if self._batch is None:
            self._batch = batch
        else:
            self._batch.absorb(batch)
        self._drop_finished()

    def _step(self) -> None:
        batch = self._batch
        assert batch is not None
        ones = torch.ones_like(batch.attention_mask_BL[:, :1])
        batch.attention_mask_BL = torch.cat([batch.attention_mask_BL, ones], dim=-1)
        logits_BV, batch.cache = self.runner.forward(
            batch.next_tokens_B[:, None],
            batch.attention_mask_BL,
            batch.positions_B[:, None],
            batch.cache,
            [s.internal_adapter for s in batch.sequences],
        )
        batch.positions_B = batch.positions_B + 1
        batch.next_tokens_B = self._sample(batch.sequences, logits_BV)
        self._drop_finished()

    def _sample(self, sequences: list[SequenceState], logits_BV: torch.Tensor) -> torch.Tensor:
        params = [s.params for s in sequences]
        tokens_B = sample_next_tokens(logits_BV, params, [s.generator for s in sequences])
        top_k = max((p.num_logprobs or 0 for p in params), default=0)
        chosen, top = gather_logprobs(logits_BV.log_softmax(dim=-1), tokens_B, top_k)
        updates: list[tuple[Request, SequenceUpdate | RequestFailed]] = []
        for sequence, token_id, logprob, candidates in zip(
            sequences, tokens_B.tolist(), chosen, top, strict=True
        ):
            token = SampledToken(token_id, logprob, candidates[: sequence.params.num_logprobs or 0])
            update = sequence.append(
                token, eos_token_ids=self.eos_token_ids, max_len=self.max_model_len
            )
            updates.append((sequence.request, update))
        publish_all(updates)
        return tokens_B

    def _drop_finished(self) -> None:
        if self._batch is not None and not self._batch.drop_finished():
            self._batch = None
        self._delete_retired()

    def _drop_aborted(self, request_ids: set[str]) -> None:
        if not request_ids:
            return
        with self._wakeup:
            self._waiting.remove(request_ids)
        if self._batch is not None:
            for sequence in self._batch.sequences:
                if sequence.request.request_id in request_ids:
                    sequence.finished = True
            self._drop_finished()

    def _retire(self, internal_name: str) -> None:
        """Delete an adapter's weights once no running sequence uses them any more."""
        self._retired.add(internal_name)
        self._delete_retired()

    def _delete_retired(self) -> None:
        if not self._retired:
            return
        in_use = {s.internal_adapter for s in self._batch.sequences} if self._batch else set()
        for internal_name in self._retired - in_use:
            self.runner.remove_adapter(internal_name)
            self._retired.discard(internal_name)

    def _fail_all(self, error: SkytrainError) -> None:
        failed = {s.request for s in self._batch.sequences} if self._batch else set()
        self._batch = None
        for request in failed:
            request.publish(RequestFailed(error))
        self._delete_retired()

    def _require_awake(self) -> None:
        if self._asleep:
            raise Unavailable(ASLEEP_MESSAGE)

    def _sleep(self) -> None:
        if self._asleep:
            return
        self._asleep = True
        running = {s.request.request_id for s in self._batch.sequences} if self._batch else set()
        self._fail_all(Unavailable("the engine was put to sleep while this request ran: retry"))
        with self._wakeup:
            waiting = self._waiting.drain()
        for request in waiting:
            request.publish(RequestFailed(Unavailable(ASLEEP_MESSAGE)))
        self.runner.release()
        self._record("sleep", aborted_requests=len(running) + len(waiting))

    def _wake_up(self) -> None:
        if not self._asleep:
            return
        self.runner.restore()
        self._asleep = False
        self._pausing = False
        self._record("wake_up")

    def _record(
        self, call: str, *, lora_name: str | None = None, aborted_requests: int | None = None
    ) -> None:
        entry = ControlCall(call=call, at=time.time())
        if lora_name is not None:
            entry["lora_name"] = lora_name
        if aborted_requests is not None:
            entry["aborted_requests"] = aborted_requests
        self.control_log.append(entry)


def _request_error(exc: Exception) -> SkytrainError:
    """What a request that failed on the engine thread is told."""
    if isinstance(exc, SkytrainError):
        return exc
    return EngineError(f"the engine could not run this request ({type(exc).__name__}: {exc})")

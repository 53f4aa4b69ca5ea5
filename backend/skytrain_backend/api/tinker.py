"""The Tinker protocol's work inside the control plane: sampling and waiting on futures.

Sampling goes to the worker engine serving the sampler's checkpoint, through the inference
gateway (the route, the engine secret, the per-tenant limit): the prompt's token ids go to
``/v1/completions`` as vLLM takes them, and the sampled token ids and their logprobs come back.
Each ``asample`` is a future row; its answer is computed by a task of this process and stored,
so any control-plane process can hand it out.

``retrieve_future`` waits on the server (up to ``RETRIEVE_WAIT_S``) before answering
``try_again``, since the SDK asks again at once: one request per few seconds per future instead
of a busy loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from skytrain_backend import tinker_wire
from skytrain_backend.api.gateway import Gateway
from skytrain_backend.api.tinker_schemas import SamplingParams
from skytrain_backend.config import Settings
from skytrain_backend.db import tinker as tinker_rows
from skytrain_backend.db.models import TinkerRequest, utcnow
from skytrain_backend.errors import (
    EngineError,
    InvalidRequest,
    NotFound,
    RateLimited,
    SkytrainError,
    Unavailable,
)
from skytrain_backend.protocol import TOKEN_ID_PREFIX
from skytrain_backend.scheduler import tinker as runs
from skytrain_backend.storage.base import ObjectStore

logger = logging.getLogger(__name__)

# How long retrieve_future holds a request for a future that is not done (the SDK's own
# timeout for it is 45 s).
RETRIEVE_WAIT_S = 10.0
# How often a wait looks again without being notified, and how many look at once.
FALLBACK_POLL_S = 1.0
LOOKUP_CONCURRENCY = 4

T = TypeVar("T")


class TinkerService:
    """One per app: the sampling tasks of this process, and the waits on futures and queues.

    A wait looks at the database, then sleeps until this process records a change to what it
    waits for (``notify``) or ``FALLBACK_POLL_S`` passes (a change another control-plane
    process made). Lookups run ``LOOKUP_CONCURRENCY`` at a time, so many waiting clients never
    take the connections heartbeats and writes need.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        sessions: sessionmaker[Session],
        store: ObjectStore,
        gateway: Gateway,
    ) -> None:
        self.settings = settings
        self.sessions = sessions
        self._store = store
        self._gateway = gateway
        self._tasks: set[asyncio.Task[None]] = set()
        self._loop = asyncio.get_running_loop()
        self._waiting: defaultdict[str, set[asyncio.Event]] = defaultdict(set)
        self.lookups = anyio.CapacityLimiter(LOOKUP_CONCURRENCY)

    async def aclose(self) -> None:
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    # --- waiting --------------------------------------------------------------------------------

    def notify(self, key: str) -> None:
        """Wake the waits on ``key`` (``request:<id>``, ``job:<id>``); from any thread."""
        self._loop.call_soon_threadsafe(self._wake, key)

    def _wake(self, key: str) -> None:
        for event in self._waiting.pop(key, set()):
            event.set()

    async def watch(self, key: str, look: Callable[[], tuple[bool, T]], *, timeout_s: float) -> T:
        """``look()`` (in a thread) until it says it is done or ``timeout_s`` passed; the last
        answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = asyncio.Event()
            self._waiting[key].add(event)
            try:
                done, answer = await anyio.to_thread.run_sync(look, limiter=self.lookups)
                remaining = deadline - time.monotonic()
                if done or remaining <= 0:
                    return answer
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(event.wait(), min(remaining, FALLBACK_POLL_S))
            finally:
                waiting = self._waiting.get(key)
                if waiting is not None:
                    waiting.discard(event)
                    if not waiting:
                        del self._waiting[key]

    async def wait(
        self, *, tenant_id: str, request_id: str, on_done: Callable[[Session, TinkerRequest], Any]
    ) -> Any:
        """``on_done(session, row)`` once the future succeeded; else its failure, or its
        pending state after ``RETRIEVE_WAIT_S``."""

        def look() -> tuple[bool, Any]:
            with self.sessions() as session:
                row = tinker_rows.get_request(session, tenant_id=tenant_id, request_id=request_id)
                found = runs.state(
                    session, operation=row, sample_timeout_s=self.settings.tinker_sample_timeout_s
                )
                if found is None:
                    return True, on_done(session, row)
                return isinstance(found, runs.Failed), found

        return await self.watch(f"request:{request_id}", look, timeout_s=RETRIEVE_WAIT_S)

    # --- sampling -------------------------------------------------------------------------------

    def start_sample(
        self, *, request_id: str, tenant_id: str, model: str, body: dict[str, Any]
    ) -> None:
        task = asyncio.create_task(
            self._sample(request_id=request_id, tenant_id=tenant_id, model=model, body=body),
            name=f"tinker-sample-{request_id}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _sample(
        self, *, request_id: str, tenant_id: str, model: str, body: dict[str, Any]
    ) -> None:
        deadline = time.monotonic() + self.settings.tinker_sample_timeout_s
        while True:
            try:
                answer = await self._gateway.complete_tokens(
                    tenant_id=tenant_id, model=model, body=body
                )
                sequences = parse_completion(answer, num_samples=int(body["n"]))
            except (Unavailable, RateLimited) as exc:
                if time.monotonic() >= deadline:
                    await self._settle(request_id, error=exc.message, category="server")
                    return
                await asyncio.sleep(getattr(exc, "retry_after_s", 1.0))
                continue
            except (InvalidRequest, NotFound) as exc:
                await self._settle(request_id, error=exc.message, category="user")
                return
            except SkytrainError as exc:
                await self._settle(request_id, error=exc.message, category="server")
                return
            except Exception:
                logger.exception("sampling request %s failed", request_id)
                await self._settle(
                    request_id,
                    error="sampling failed: see the control plane's log",
                    category="server",
                )
                return
            await self._settle(
                request_id,
                result={
                    "sequences": [
                        {"tokens": s.tokens, "logprobs": s.logprobs, "stop_reason": s.stop_reason}
                        for s in sequences
                    ]
                },
            )
            return

    async def _settle(
        self,
        request_id: str,
        *,
        result: dict[str, Any] | None = None,
        error: str | None = None,
        category: str = "server",
    ) -> None:
        def write() -> None:
            with self.sessions() as session:
                row = session.get(TinkerRequest, request_id)
                if row is None or row.status in runs.FINISHED:
                    return
                if error is None:
                    row.status, row.result = "succeeded", result
                else:
                    row.status, row.error, row.error_category = "failed", error, category
                row.finished_at = utcnow()
                session.commit()

        await run_in_threadpool(write)
        self.notify(f"request:{request_id}")


def sampling_body(*, prompt: list[int], num_samples: int, params: SamplingParams) -> dict[str, Any]:
    """A ``/v1/completions`` request for the engine (vLLM's sampling parameters)."""
    body: dict[str, Any] = {
        "prompt": prompt,
        "n": num_samples,
        "max_tokens": params.max_tokens,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "logprobs": 0,
        "return_tokens_as_token_ids": True,
        "skip_special_tokens": False,
    }
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


def parse_completion(answer: Any, *, num_samples: int) -> list[tinker_wire.SampledSequence]:
    """The sampled token ids and logprobs of each choice of an engine's completion."""
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
            sequences.append(tinker_wire.SampledSequence(tokens, values, stop))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"the engine's completion has no token ids with logprobs ({exc})"
        ) from None
    if len(sequences) != num_samples:
        raise EngineError(f"the engine returned {len(sequences)} samples, not {num_samples}")
    return sequences

"""The Tinker protocol's work inside the control plane: sampling and waiting on futures.

Sampling goes to the worker engine serving the sampler's checkpoint, through the inference
gateway (the route, the engine secret, the per-tenant limit): the prompt's token ids go to
``/v1/completions`` as vLLM takes them, and the sampled token ids and their logprobs come back.
Each ``asample`` is a future row; its answer is computed by a task of this process and stored,
so any control-plane process can hand it out.

Each sample is counted against its tenant's requests, sequences and tokens in flight
(``Gateway.admit_completion``) from the moment ``asample`` accepts it until its answer is stored:
a tenant's samples waiting for their model to be placed are bounded like its requests being
generated, and past its limit ``asample`` answers 429 (the SDK backs off and sends it again).

``retrieve_future`` waits on the server (up to ``RETRIEVE_WAIT_S``) before answering
``try_again``, since the SDK asks again at once: one request per few seconds per future instead
of a busy loop. A tenant has at most ``max_waiting_polls`` waits at once in a process (the
long-polls' counter, ``api/longpoll.py``): past them a future not done yet is answered 429, and
the SDK backs off. The waits' lookups take turns per tenant (``api/admission/fairness.py``), so one
tenant's many waits never delay another's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import defaultdict
from collections.abc import Callable
from typing import Any, TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

from skytrain_backend import tinker_wire
from skytrain_backend.api.admission.fairness import FairLimiter
from skytrain_backend.api.gateway import Gateway
from skytrain_backend.api.tinker_schemas import SamplingParams
from skytrain_backend.config import Settings
from skytrain_backend.db import tinker as tinker_rows
from skytrain_backend.db.models import TinkerRequest, utcnow
from skytrain_backend.db.tenants import TenantLimits
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
from skytrain_backend.scheduler import tinker_futures as futures
from skytrain_backend.storage.base import ObjectStore

logger = logging.getLogger(__name__)

# How long retrieve_future holds a request for a future that is not done (the SDK's own
# timeout for it is 45 s).
RETRIEVE_WAIT_S = 10.0
# How often a wait looks again without being notified; how many look at once, and how many
# of them one tenant's.
FALLBACK_POLL_S = 1.0
LOOKUP_CONCURRENCY = 4
LOOKUP_PER_TENANT = 2

T = TypeVar("T")


class TinkerService:
    """One per app: the sampling tasks of this process, and the waits on futures and queues.

    A wait looks at the database, then sleeps until this process records a change to what it
    waits for (``notify``) or ``FALLBACK_POLL_S`` passes (a change another control-plane
    process made). Lookups run ``LOOKUP_CONCURRENCY`` at a time, at most ``LOOKUP_PER_TENANT``
    of them one tenant's, so many waiting clients never take the connections heartbeats and
    writes need, nor hold up another tenant's lookups.
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
        self.lookups = FairLimiter(total=LOOKUP_CONCURRENCY, per_key=LOOKUP_PER_TENANT)

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

    async def watch(
        self, key: str, look: Callable[[], tuple[bool, T]], *, turn: str, timeout_s: float
    ) -> T:
        """``look()`` (in a thread, in the turn of ``turn``: a tenant, a worker) until it says
        it is done or ``timeout_s`` passed; the last answer."""
        deadline = time.monotonic() + timeout_s
        while True:
            event = asyncio.Event()
            self._waiting[key].add(event)
            try:
                done, answer = await self.lookups.run_sync(turn, look)
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
        self,
        *,
        tenant_id: str,
        request_id: str,
        on_done: Callable[[Session, TinkerRequest], Any],
        wait_s: float = RETRIEVE_WAIT_S,
    ) -> Any:
        """``on_done(session, row)`` once the future succeeded; else its failure, or its
        pending state after ``wait_s``."""

        def look() -> tuple[bool, Any]:
            with self.sessions() as session:
                row = tinker_rows.get_request(session, tenant_id=tenant_id, request_id=request_id)
                found = futures.state(
                    session,
                    operation=row,
                    sample_timeout_s=self.settings.tinker_sample_timeout_s,
                    settings=self.settings,
                )
                if found is None:
                    return True, on_done(session, row)
                return isinstance(found, futures.Failed), found

        return await self.watch(f"request:{request_id}", look, turn=tenant_id, timeout_s=wait_s)

    # --- sampling -------------------------------------------------------------------------------

    async def admit_sample(
        self, *, tenant_id: str, limits: TenantLimits, body: dict[str, Any]
    ) -> Callable[[], None]:
        """Count a sample in against the tenant's limits (``RateLimited`` past them); the
        function that counts it out, which ``start_sample`` then owns."""
        return await self._gateway.admit_completion(tenant_id=tenant_id, limits=limits, body=body)

    def start_sample(
        self,
        *,
        request_id: str,
        tenant_id: str,
        model: str,
        body: dict[str, Any],
        release: Callable[[], None],
        prompt_logprobs_last_n: int | None = None,
    ) -> None:
        """Sample in a task of this process; ``release`` (its admission) once it is settled."""
        task = asyncio.create_task(
            self._sample(
                request_id=request_id,
                tenant_id=tenant_id,
                model=model,
                body=body,
                last_n=prompt_logprobs_last_n,
            ),
            name=f"tinker-sample-{request_id}",
        )
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        task.add_done_callback(lambda _: release())

    async def _sample(
        self,
        *,
        request_id: str,
        tenant_id: str,
        model: str,
        body: dict[str, Any],
        last_n: int | None,
    ) -> None:
        deadline = time.monotonic() + self.settings.tinker_sample_timeout_s
        while True:
            try:
                answer = await self._gateway.complete_tokens(
                    tenant_id=tenant_id, model=model, body=body
                )
                sequences = parse_completion(
                    answer, num_samples=int(body["n"]), k=int(body["logprobs"])
                )
                prompt = parse_prompt_logprobs(answer, body, last_n=last_n)
            except (Unavailable, RateLimited) as exc:
                # A model no worker can be started for fails now; anything else may pass.
                cannot = isinstance(exc, Unavailable) and exc.state == "failed"
                if cannot or time.monotonic() >= deadline:
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
            result: dict[str, Any] = {
                "sequences": [
                    {
                        "tokens": s.tokens,
                        "logprobs": s.logprobs,
                        "stop_reason": s.stop_reason,
                        "topk": s.topk,
                    }
                    for s in sequences
                ]
            }
            if prompt is not None:
                result["prompt"] = {"logprobs": prompt.logprobs, "topk": prompt.topk}
            await self._settle(request_id, result=result)
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


def sampling_body(
    *,
    prompt: list[int],
    num_samples: int,
    params: SamplingParams,
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
) -> list[tinker_wire.SampledSequence]:
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
            sequences.append(tinker_wire.SampledSequence(tokens, values, stop, topk))  # type: ignore[arg-type]
    except (KeyError, TypeError, ValueError, AttributeError) as exc:
        raise EngineError(
            f"the engine's completion has no token ids with logprobs ({exc})"
        ) from None
    if len(sequences) != num_samples:
        raise EngineError(f"the engine returned {len(sequences)} samples, not {num_samples}")
    return sequences


def parse_prompt_logprobs(
    answer: Any, body: dict[str, Any], *, last_n: int | None
) -> tinker_wire.PromptScores | None:
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
        topk: list[tinker_wire.TopLogprobs] = [None]
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
    return tinker_wire.PromptScores(logprobs, topk if k else None)

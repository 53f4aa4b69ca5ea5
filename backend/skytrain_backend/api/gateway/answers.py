"""An engine's answer as the caller gets it: JSON or server-sent events, rewritten.

The answer's ``model`` is written back to the caller's name, the chat answer's
``prompt_token_ids`` is copied onto each of its choices (the object a client keeps in its
trajectory), and each choice says the step that sampled it (``skytrain_step``, as the
``X-Skytrain-Step`` header says it of the answer): a group sent to train carries it, so the
job knows how far off-policy the group is. Streams are passed through event by event as the engine sends them; when the
caller goes away mid-stream the upstream request is closed at once, which makes the engine
stop generating for it.

Engine refusals of the request itself (4xx) pass through with the engine's status and
OpenAI-style body. Failures that are not the caller's doing are said in skytrain's words:
an engine that no longer serves the checkpoint is a 503 to retry, an engine that rejects the
control plane's credentials, redirects or fails is a 502.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncIterator, Callable
from typing import Any

import aiohttp
import msgspec
from fastapi import Response
from fastapi.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from skytrain_backend.api.gateway.upstream import Upstream
from skytrain_backend.asgi import until_disconnected
from skytrain_backend.errors import EngineError, Unavailable
from skytrain_backend.observability import gateway as observe
from skytrain_backend.scheduler.routing import EngineRoute

_JSON = msgspec.json.Encoder()


async def read_json(upstream: Upstream, *, route: EngineRoute) -> Any:
    """The engine's whole answer, parsed by msgspec (NaN, Infinity and numbers out of a
    float's range are not JSON: an answer holding them is refused as not JSON)."""
    try:
        return msgspec.json.decode(await upstream.read())
    except msgspec.DecodeError as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} answered what is not JSON ({exc}): retry"
        ) from exc
    except TimeoutError as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} did not finish in time: retry, with a "
            "smaller max_tokens if it keeps happening"
        ) from exc
    except (aiohttp.ClientError, ValueError) as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer "
            f"({type(exc).__name__}): retry"
        ) from exc
    finally:
        upstream.close()


def json_answer(content: Any, *, model: str, step: int, headers: dict[str, str]) -> Response:
    """The engine's parsed answer, ``model`` written back to the caller's name, each choice
    marked with the ``step`` that sampled it."""
    if isinstance(content, dict) and "model" in content:
        content["model"] = model
        _prompt_ids_onto_choices(content)
        _step_onto_choices(content, step)
        observe.metrics.count_usage(content)
    # msgspec read it, so every number is finite: written back as JSONResponse would.
    return Response(_JSON.encode(content), headers=headers, media_type="application/json")


async def refusal(upstream: Upstream, *, route: EngineRoute) -> Response:
    """The caller's answer to an engine that did not answer 200."""
    try:
        await upstream.read()
    except (aiohttp.ClientError, TimeoutError) as exc:
        raise EngineError(
            f"the engine of worker {route.worker_id} broke off its answer "
            f"({upstream.status_code}, {type(exc).__name__}): retry"
        ) from exc
    finally:
        upstream.close()
    status = upstream.status_code
    said = engine_message(upstream)
    worker = f"worker {route.worker_id}"
    if status in (401, 403):
        raise EngineError(
            f"the engine of {worker} refused the control plane's credentials ({status}: "
            f"{said}): the worker's engine secret is out of date; restart the worker"
        )
    if status == 404:
        raise Unavailable(
            f"{worker} does not serve step {route.step} of this model right now (its engine "
            f"said: {said}); it is being loaded again: retry shortly",
            retry_after_s=2.0,
        )
    if status == 503:
        raise Unavailable(f"the engine of {worker} cannot serve now: {said}", retry_after_s=5.0)
    if status >= 500:
        raise EngineError(f"the engine of {worker} failed ({status}): {said}")
    if 300 <= status < 400:
        raise EngineError(
            f"the engine of {worker} answered with a redirect ({status}), which the control "
            "plane does not follow: its operator must check what answers at its address"
        )
    return Response(
        upstream.content,
        status_code=status,
        media_type=upstream.headers.get("content-type", "application/json"),
    )


def engine_message(upstream: Upstream) -> str:
    try:
        body = json.loads(upstream.content)
    except ValueError:
        return upstream.text().strip() or upstream.reason
    error = body.get("error", body) if isinstance(body, dict) else body
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(error)


class EventStream(StreamingResponse):
    """The engine's server-sent events, passed on one event at a time with ``model``
    rewritten; the upstream request is closed as soon as the caller leaves."""

    def __init__(
        self,
        upstream: Upstream,
        *,
        model: str,
        step: int,
        headers: dict[str, str],
    ) -> None:
        super().__init__(
            _events(upstream, model=model, step=step),
            media_type="text/event-stream",
            headers={**headers, "Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
        self._upstream = upstream
        # Set by the route: counts the request out of its tenant's limit.
        self.on_close: Callable[[], None] = lambda: None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            # OSError: the caller left while an event was being written.
            with contextlib.suppress(OSError), observe.stream_open():
                await until_disconnected(receive, self.stream_response(send))
        finally:
            self._upstream.close()
            self.on_close()


async def _events(upstream: Upstream, *, model: str, step: int) -> AsyncIterator[str]:
    """The engine's events, rewritten, and an error event if it breaks off (events that came
    in the same instant as the broken connection may be lost with it: the caller retries)."""
    event: list[str] = []
    try:
        async for line in upstream.lines():
            if line:
                event.append(_rewrite_data_line(line, model=model, step=step))
                continue
            if event:
                yield "\n".join(event) + "\n\n"
                event = []
        if event:
            yield "\n".join(event) + "\n\n"
    except (aiohttp.ClientError, TimeoutError, UnicodeDecodeError) as exc:
        # The status line is long sent: the failure can only be told as a last event.
        message = f"the engine broke off the stream ({type(exc).__name__}): retry the request"
        payload = {"error": {"type": EngineError.type, "message": message}}
        yield f"data: {json.dumps(payload)}\n\n"


def _rewrite_data_line(line: str, *, model: str, step: int) -> str:
    if not line.startswith("data:"):
        return line
    payload = line.removeprefix("data:").strip()
    if not payload.startswith("{"):
        return line
    try:
        data = json.loads(payload)
    except ValueError:
        return line
    if not isinstance(data, dict) or "model" not in data:
        return line
    data["model"] = model
    _prompt_ids_onto_choices(data)
    _step_onto_choices(data, step)
    observe.metrics.count_usage(data)
    return "data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":"))


def _prompt_ids_onto_choices(data: dict[str, Any]) -> None:
    """vLLM gives a chat answer's prompt ids once, at the top (a stream: in its first chunk);
    a client keeps only the choice, so each choice gets them too (where ART reads them)."""
    prompt_ids = data.get("prompt_token_ids")
    choices = data.get("choices")
    if not isinstance(prompt_ids, list) or not isinstance(choices, list):
        return
    for choice in choices:
        if isinstance(choice, dict) and choice.get("prompt_token_ids") is None:
            choice["prompt_token_ids"] = prompt_ids


def _step_onto_choices(data: dict[str, Any], step: int) -> None:
    choices = data.get("choices")
    if isinstance(choices, list):
        for choice in choices:
            if isinstance(choice, dict):
                choice["skytrain_step"] = step

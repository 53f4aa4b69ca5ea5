"""The worker's (and the tests') async client for an engine: vLLM or skytrain's CPU engine.

Both speak the same HTTP surface, so every method works against either. Failures raise
``EngineError`` carrying the engine's own message (``{"error": {"message": ...}}`` from the CPU
engine and vLLM, or the plain text some vLLM routes answer with).
"""

from __future__ import annotations

import asyncio
import time
from types import TracebackType
from typing import Any, Protocol

import httpx

from skytrain_backend.engine.wire import ControlCall
from skytrain_backend.errors import EngineError, EngineRefused, EngineTimeout
from skytrain_backend.protocol import TOKEN_ID_PREFIX


class WatchedProcess(Protocol):
    """What waiting needs from an engine process: whether it ended, and its last words."""

    def poll(self) -> int | None: ...

    def log_tail(self, lines: int = 40) -> str: ...


class EngineClient:
    def __init__(
        self,
        base_url: str,
        api_key: str | None = None,
        *,
        timeout_s: float = 300.0,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.base_url = base_url.rstrip("/")
        self._http = httpx.AsyncClient(
            base_url=self.base_url, headers=headers, timeout=timeout_s, transport=transport
        )

    async def __aenter__(self) -> EngineClient:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.aclose()

    async def aclose(self) -> None:
        await self._http.aclose()

    async def _request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            response = await self._http.request(method, path, **kwargs)
        except httpx.TimeoutException as exc:
            timeout = kwargs.get("timeout")
            within = f" within {timeout:.0f}s" if isinstance(timeout, int | float) else ""
            raise EngineTimeout(
                f"engine at {self.base_url} did not answer {method} {path}{within} "
                f"({type(exc).__name__})"
            ) from exc
        except httpx.HTTPError as exc:
            raise EngineError(
                f"engine at {self.base_url} did not answer {method} {path}: {exc}"
            ) from exc
        if response.is_error:
            # A 4xx is the request's own fault (sending it again changes nothing); 401/403
            # and 5xx are the engine's or the credentials'.
            refused = 400 <= response.status_code < 500 and response.status_code not in (401, 403)
            raise (EngineRefused if refused else EngineError)(
                f"engine at {self.base_url} refused {method} {path} "
                f"({response.status_code}): {_error_message(response)}"
            )
        return response

    async def metrics_text(self) -> str:
        """The engine's Prometheus text (vLLM's ``/metrics``; the CPU engine has none)."""
        response = await self._request("GET", "/metrics", timeout=2)
        return response.text

    # --- liveness -------------------------------------------------------------------------------

    async def health(self) -> bool:
        """True when the engine answers ``/health`` with 200."""
        try:
            response = await self._http.get("/health", timeout=5.0)
        except httpx.HTTPError:
            return False
        return response.status_code == 200

    async def wait_until_healthy(
        self,
        timeout_s: float,
        process: WatchedProcess | None = None,
        *,
        poll_interval_s: float = 0.5,
    ) -> None:
        """Return once ``/health`` answers; fail at once if ``process`` exits, or at the timeout."""
        deadline = time.monotonic() + timeout_s
        while True:
            if process is not None and (code := process.poll()) is not None:
                raise EngineError(
                    f"the engine exited with code {code} before it was ready; "
                    f"its last log lines:\n{process.log_tail()}"
                )
            if await self.health():
                return
            if time.monotonic() >= deadline:
                tail = f"; its last log lines:\n{process.log_tail()}" if process else ""
                raise EngineError(
                    f"the engine at {self.base_url} did not become healthy within "
                    f"{timeout_s:.0f}s{tail}"
                )
            await asyncio.sleep(poll_interval_s)

    # --- models and adapters ------------------------------------------------------------------

    async def models(self) -> list[str]:
        """Names the engine serves: the base model and every loaded adapter."""
        response = await self._request("GET", "/v1/models")
        return [card["id"] for card in response.json()["data"]]

    async def is_serving(self, name: str) -> bool:
        return name in await self.models()

    async def load_lora(self, name: str, path: str, *, replace: bool = False) -> None:
        body = {"lora_name": name, "lora_path": path, "load_inplace": replace}
        await self._request("POST", "/v1/load_lora_adapter", json=body)

    async def unload_lora(self, name: str) -> None:
        await self._request("POST", "/v1/unload_lora_adapter", json={"lora_name": name})

    async def sleep(
        self, level: int = 1, *, mode: str = "wait", timeout_s: float | None = None
    ) -> None:
        """Put the engine to sleep; ``wait`` (the default here, unlike vLLM's ``abort``) lets
        the requests in flight finish first, refusing new ones. ``EngineTimeout`` past
        ``timeout_s`` (default: the client's); the engine goes on with the sleep all the
        same, so a ``mode="abort"`` sleep then ends the requests it waits for."""
        await self._request(
            "POST",
            "/sleep",
            params={"level": level, "mode": mode},
            **({} if timeout_s is None else {"timeout": timeout_s}),
        )

    async def wake_up(self, *, timeout_s: float | None = None) -> None:
        """Wake the engine (vLLM maps its memory again and copies its weights back);
        ``EngineTimeout`` past ``timeout_s`` (default: the client's)."""
        await self._request(
            "POST", "/wake_up", **({} if timeout_s is None else {"timeout": timeout_s})
        )

    async def is_sleeping(self) -> bool:
        response = await self._request("GET", "/is_sleeping")
        return bool(response.json()["is_sleeping"])

    async def control_log(self) -> list[ControlCall] | None:
        """The control calls the engine carried out, with their times (the CPU engine keeps
        them); None for an engine that keeps no such log (vLLM)."""
        response = await self._http.get("/control_log")
        if response.status_code == 404:
            return None
        if response.is_error:
            raise EngineError(
                f"engine at {self.base_url} refused GET /control_log "
                f"({response.status_code}): {_error_message(response)}"
            )
        return list(response.json()["data"])

    async def check_generates(self, name: str, prompt: str = "Hello") -> None:
        """One greedy token through ``name``: EngineError unless the engine generates with it."""
        await self._greedy(name, prompt, 1)

    async def verify_adapter(
        self,
        name: str,
        base_name: str,
        prompt: str,
        *,
        max_tokens: int = 16,
        atol: float = 1e-4,
    ) -> None:
        """Check that adapter ``name`` is really served: raise EngineError otherwise.

        A greedy completion of ``prompt`` must succeed through the adapter and differ from the
        base model's, in its tokens or in their logprobs by more than ``atol`` (a lightly
        trained adapter often keeps the base model's greedy text but never its exact
        probabilities). Do not call it for an adapter that is a no-op, such as step 0.
        """
        adapter_tokens = await self._greedy(name, prompt, max_tokens)
        base_tokens = await self._greedy(base_name, prompt, max_tokens)
        if [t for t, _ in adapter_tokens] != [t for t, _ in base_tokens]:
            return
        difference = max(
            (abs(a - b) for (_, a), (_, b) in zip(adapter_tokens, base_tokens, strict=True)),
            default=0.0,
        )
        if not difference > atol:
            raise EngineError(
                f"adapter {name!r} answers exactly like the base model {base_name!r} "
                f"(same {len(adapter_tokens)} greedy tokens, logprobs within {difference:.2g}): "
                "the engine is not applying it"
            )

    async def _greedy(self, model: str, prompt: str, max_tokens: int) -> list[tuple[str, float]]:
        body = {
            "model": model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "logprobs": 0,
            "return_tokens_as_token_ids": True,
        }
        response = await self._request("POST", "/v1/completions", json=body)
        logprobs = response.json()["choices"][0]["logprobs"]
        tokens = [token.removeprefix(TOKEN_ID_PREFIX) for token in logprobs["tokens"]]
        return list(zip(tokens, logprobs["token_logprobs"], strict=True))


def _error_message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text.strip() or response.reason_phrase
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    if error is not None:
        return str(error)
    return str(body)

"""The connection to a skytrain control plane: authentication, timeouts, retries, errors.

Only requests that are safe to repeat are retried: GETs, DELETEs, and the few POSTs the
server treats as idempotent (registering a model with ``return_existing``). A POST that
creates a training job is sent once; if its answer is lost, the job may exist, and sending it
again would train twice.
"""

from __future__ import annotations

import asyncio
import os
import random
from collections.abc import AsyncIterator, Awaitable, Callable, Mapping
from pathlib import Path
from types import TracebackType
from typing import Any, Self, TypeVar
from urllib.parse import quote

import anyio
import httpx

from skytrain._exceptions import (
    APIConnectionError,
    APIError,
    APITimeoutError,
    ConfigurationError,
    ServerError,
    _error_from_response,
)
from skytrain._version import __version__
from skytrain._wire import (
    _CheckpointAnswer,
    _CheckpointsDeleted,
    _FileAnswer,
    _JobAnswer,
    _JobEventsPage,
    _LogBody,
    _ModelAnswer,
    _ModelCreateBody,
    _QueryParams,
    _SFTTrainBody,
    _TrainBody,
)

_DEFAULT_BASE_URL = "http://127.0.0.1:8000"
_RETRY_STATUSES = frozenset({429, 502, 503, 504})
_IDEMPOTENT_METHODS = frozenset({"GET", "HEAD", "OPTIONS", "PUT", "DELETE"})
_RETRY_BASE_DELAY_S = 0.5
_RETRY_MAX_DELAY_S = 30.0
_PAGE_SIZE = 100

_T = TypeVar("_T")


def _retry_delay_s(attempt: int, error: Exception) -> float:
    """The server's Retry-After when it gave one, else exponential backoff with jitter."""
    retry_after = error.retry_after if isinstance(error, APIError) else None
    if retry_after is not None:
        return min(retry_after, _RETRY_MAX_DELAY_S)
    backoff = min(_RETRY_BASE_DELAY_S * 2**attempt, _RETRY_MAX_DELAY_S)
    return backoff * (0.5 + random.random() / 2)


def _json(response: httpx.Response) -> Any:
    if response.status_code == 204 or not response.content:
        return None
    try:
        return response.json()
    except ValueError as exc:
        raise ServerError(
            f"{response.request.method} {response.request.url} answered "
            f"{response.status_code} with a body that is not JSON",
            status_code=response.status_code,
            type="invalid_response",
        ) from exc


class Backend:
    """A skytrain control plane, reached over HTTP with an API key.

    ``base_url`` defaults to ``$SKYTRAIN_BASE_URL`` or ``http://127.0.0.1:8000`` (a trailing
    ``/v1`` is accepted and dropped); ``api_key`` to ``$SKYTRAIN_API_KEY``. ``timeout`` bounds
    each HTTP request in seconds; waits that span many requests (``register``, ``train``) have
    their own. ``transport`` is passed to httpx (e.g. ``httpx.AsyncHTTPTransport(uds=...)`` for
    a control plane on a Unix socket, or one with client certificates).

    Use it as ``async with Backend() as backend: ...`` or call ``await backend.close()``.
    """

    def __init__(
        self,
        base_url: str | None = None,
        api_key: str | None = None,
        *,
        timeout: float = 60.0,
        max_retries: int = 3,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        base_url = base_url or os.environ.get("SKYTRAIN_BASE_URL") or _DEFAULT_BASE_URL
        api_key = api_key or os.environ.get("SKYTRAIN_API_KEY")
        if not api_key:
            raise ConfigurationError(
                "no skytrain API key: pass Backend(api_key=...) or set SKYTRAIN_API_KEY "
                "(`skytrain keys create --tenant NAME` on the server makes one)"
            )
        url = httpx.URL(base_url)
        if url.scheme not in ("http", "https") or not url.host:
            raise ConfigurationError(
                f"base_url {base_url!r} is not an http(s) URL: use e.g. http://127.0.0.1:8000"
            )
        if timeout <= 0:
            raise ConfigurationError(f"timeout={timeout} must be a positive number of seconds")
        if max_retries < 0:
            raise ConfigurationError(f"max_retries={max_retries} must not be negative")
        self.base_url = str(url).rstrip("/").removesuffix("/v1")
        self.api_key = api_key
        self.timeout = timeout
        self.max_retries = max_retries
        self._client = httpx.AsyncClient(
            base_url=self.base_url,
            headers={
                "Authorization": f"Bearer {api_key}",
                "User-Agent": f"skytrain-python/{__version__}",
            },
            timeout=httpx.Timeout(timeout),
            transport=transport,
        )

    def __repr__(self) -> str:
        return f"Backend(base_url={self.base_url!r})"

    async def __aenter__(self) -> Self:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def close(self) -> None:
        """Close the connection pool."""
        await self._client.aclose()

    # --- the API's calls ---------------------------------------------------------------------
    # Every path of the /v1 API the SDK uses is written here, once; the model objects ask
    # for these calls and never build a URL (as ART's ``Model`` hands its calls to its
    # backend). Each returns the server's JSON as it came.

    @property
    def _inference_base_url(self) -> str:
        """The OpenAI-compatible endpoint that serves the registered models."""
        return f"{self.base_url}/v1"

    async def _register_model(self, body: _ModelCreateBody) -> _ModelAnswer:
        """Create a model, or return the existing one of that name (safe to repeat)."""
        return await self._post("/v1/models", json=body, idempotent=True)

    async def _get_model(self, model_id: str) -> _ModelAnswer:
        return await self._get(f"/v1/models/{model_id}")

    async def _update_model(self, model_id: str, body: Mapping[str, object]) -> _ModelAnswer:
        """Change a model's settings (those in ``body``)."""
        return await self._patch(f"/v1/models/{model_id}", json=body)

    async def _log(self, model_id: str, body: _LogBody) -> None:
        await self._post(f"/v1/models/{model_id}/log", json=body)

    async def _create_training_job(self, body: _TrainBody) -> _JobAnswer:
        """Submit an RL training job (sent once: a repeat would train twice)."""
        return await self._post("/v1/training-jobs", json=body)

    async def _create_sft_training_job(self, body: _SFTTrainBody) -> _JobAnswer:
        """Submit a supervised fine-tuning job (sent once, likewise)."""
        return await self._post("/v1/sft-training-jobs", json=body)

    async def _get_training_job(self, job_id: str) -> _JobAnswer:
        return await self._get(f"/v1/training-jobs/{job_id}")

    async def _training_job_events(
        self, job_id: str, *, after: str | None, limit: int, wait_s: float
    ) -> _JobEventsPage:
        """A page of the job's events after ``after``; the server holds the request up to
        ``wait_s`` seconds for the next one (a long-poll)."""
        params: _QueryParams = {"limit": limit, "wait_s": wait_s}
        if after is not None:
            params["after"] = after
        return await self._get(f"/v1/training-jobs/{job_id}/events", params=params)

    def _checkpoints(self, model_id: str) -> AsyncIterator[_CheckpointAnswer]:
        """Every checkpoint of the model, oldest step first."""
        return self._paginate(f"/v1/models/{model_id}/checkpoints", params={"order": "asc"})

    async def _delete_checkpoints(self, model_id: str, steps: list[int]) -> _CheckpointsDeleted:
        return await self._delete(f"/v1/models/{model_id}/checkpoints", json={"steps": steps})

    async def _checkpoint_files(self, model_id: str, step: int) -> list[_FileAnswer]:
        """The files of checkpoint ``step`` (name and size of each)."""
        listing = await self._get(f"/v1/models/{model_id}/checkpoints/{step}/files")
        return listing["data"]

    async def _download_checkpoint_file(
        self, model_id: str, step: int, name: str, destination: Path, *, expected_size: int | None
    ) -> int:
        return await self._download(
            f"/v1/models/{model_id}/checkpoints/{step}/files/{quote(name)}",
            destination,
            expected_size=expected_size,
        )

    # --- requests ---------------------------------------------------------------------------

    async def _get(self, path: str, *, params: _QueryParams | None = None) -> Any:
        return await self._send("GET", path, params=params)

    async def _post(self, path: str, *, json: Any, idempotent: bool = False) -> Any:
        return await self._send("POST", path, json=json, idempotent=idempotent)

    async def _patch(self, path: str, *, json: Any) -> Any:
        # Setting the same fields again changes nothing: safe to retry.
        return await self._send("PATCH", path, json=json, idempotent=True)

    async def _delete(self, path: str, *, json: Any = None) -> Any:
        return await self._send("DELETE", path, json=json)

    async def _paginate(
        self, path: str, *, params: _QueryParams | None = None
    ) -> AsyncIterator[Any]:
        """Every item of a cursor-paginated list, fetching the next page as needed."""
        after: str | None = None
        while True:
            page_params = {**(params or {}), "limit": _PAGE_SIZE}
            if after is not None:
                page_params["after"] = after
            page = await self._get(path, params=page_params)
            items = page["data"]
            for item in items:
                yield item
            if not page.get("has_more") or not items:
                return
            after = str(items[-1]["id"])

    async def _send(
        self,
        method: str,
        path: str,
        *,
        params: _QueryParams | None = None,
        json: Any = None,
        idempotent: bool | None = None,
    ) -> Any:
        async def attempt() -> Any:
            response = await self._client.request(method, path, params=params, json=json)
            if not response.is_success:
                raise _error_from_response(response)
            return _json(response)

        retryable = method in _IDEMPOTENT_METHODS if idempotent is None else idempotent
        return await self._retrying(f"{method} {path}", attempt, retryable=retryable)

    async def _download(self, path: str, destination: Path, *, expected_size: int | None) -> int:
        """Stream a file to ``destination``, following a redirect to a presigned URL.

        httpx drops the Authorization header when a redirect leaves this server, so the API
        key never reaches the object store.
        """

        async def attempt() -> int:
            written = 0
            async with self._client.stream("GET", path, follow_redirects=True) as response:
                if not response.is_success:
                    await response.aread()
                    raise _error_from_response(response)
                async with await anyio.open_file(destination, "wb") as out:
                    async for chunk in response.aiter_bytes():
                        await out.write(chunk)
                        written += len(chunk)
            if expected_size is not None and written != expected_size:
                raise APIConnectionError(
                    f"GET {path}: received {written} bytes of {expected_size}; the download "
                    "was cut short"
                )
            return written

        return await self._retrying(f"GET {path}", attempt, retryable=True)

    async def _retrying(
        self, what: str, attempt: Callable[[], Awaitable[_T]], *, retryable: bool
    ) -> _T:
        """Run ``attempt``, turning transport failures into SDK errors and retrying if allowed.

        Retried: connection failures, timeouts and 429/502/503/504, at most ``max_retries``
        times, waiting the server's Retry-After or an exponential backoff.
        """
        attempt_number = 0
        while True:
            error: APIConnectionError | APIError
            try:
                return await attempt()
            except httpx.TimeoutException as exc:
                error = APITimeoutError(
                    f"{what}: no answer from {self.base_url} within {self.timeout:g} s"
                )
                error.__cause__ = exc
            except httpx.TransportError as exc:
                error = APIConnectionError(
                    f"{what}: could not reach the skytrain server at {self.base_url} ({exc!r}); "
                    "is `skytrain serve` running there?"
                )
                error.__cause__ = exc
            except APIConnectionError as exc:
                error = exc
            except APIError as exc:
                if exc.status_code not in _RETRY_STATUSES:
                    raise
                error = exc
            if not retryable or attempt_number >= self.max_retries:
                raise error
            await asyncio.sleep(_retry_delay_s(attempt_number, error))
            attempt_number += 1

"""The worker's own small HTTP client for the control plane (``/v1/worker/...``).

The worker never touches the database: everything goes through these calls, so the same code
works from a laptop or from a GPU on another cloud. Bodies and answers are the worker protocol's
types (``protocol/worker.py``); an answer that does not validate fails the call with the control
plane's version in the message, since it means the two were not installed from the same
release. Idempotent calls (heartbeat, renew, downloads) are retried through transient failures;
calls that change state once (lease, complete, fail) are not, and the control plane's lease
rules make a lost answer harmless. Once the worker is stopping (``stop_retrying``) nothing is
retried any more: a control plane that is gone (it stopped its own local workers) must not
keep a worker from ending before it is killed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import hashlib
import logging
import os
import tempfile
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any, TypeVar

import httpx
from pydantic import BaseModel, ValidationError
from tenacity import (
    AsyncRetrying,
    RetryCallState,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from skytrain_backend import protocol
from skytrain_backend.errors import LeaseLost, ObjectDamaged, SkytrainError
from skytrain_backend.observability import logs
from skytrain_backend.protocol import tinker_ops
from skytrain_backend.protocol.worker import ListedFile

logger = logging.getLogger(__name__)

T = TypeVar("T")
Answer = TypeVar("Answer", bound=BaseModel)

# After a failed lease request, the pause before the next one.
LEASE_RETRY_S = 1.0


def _is_transient(exc: BaseException) -> bool:
    if isinstance(exc, httpx.TransportError):
        return True
    return isinstance(exc, httpx.HTTPStatusError) and exc.response.status_code >= 500


async def _with_request_id(request: httpx.Request) -> None:
    """A call made for a job goes with the request id the job was created by (the job's
    lines are bound to it), so the control plane's lines for it share that id."""
    request_id = logs.current_request_id()
    if request_id is not None:
        request.headers.setdefault(logs.REQUEST_ID_HEADER, request_id)


class ControlPlaneClient:
    """Calls the control plane's worker routes with the worker's token."""

    def __init__(
        self, base_url: str, token: str, *, timeout_s: float = 30.0, retry_for_s: float = 120.0
    ) -> None:
        self._http = httpx.AsyncClient(
            base_url=base_url.rstrip("/") + "/v1/worker",
            headers={"Authorization": f"Bearer {token}"},
            timeout=httpx.Timeout(timeout_s, connect=10.0),
            event_hooks={"request": [_with_request_id]},
        )
        self._retry_for_s = retry_for_s
        self._stopping = asyncio.Event()

    async def aclose(self) -> None:
        await self._http.aclose()

    def stop_retrying(self) -> None:
        """Fail every call at its next failure from now on, and end the waits between tries."""
        self._stopping.set()

    def _give_up(self, state: RetryCallState) -> bool:
        return self._stopping.is_set() or stop_after_delay(self._retry_for_s)(state)

    async def _pause(self, seconds: float) -> None:
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._stopping.wait(), seconds)

    async def _retrying(self, call: Callable[[], Awaitable[T]]) -> T:
        async for attempt in AsyncRetrying(
            retry=retry_if_exception(_is_transient),
            wait=wait_exponential(multiplier=0.5, max=10),
            stop=self._give_up,
            sleep=self._pause,
            reraise=True,
        ):
            with attempt:
                return await call()
        raise AssertionError("unreachable")  # pragma: no cover

    async def _send(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        response = await self._http.request(method, path, **kwargs)
        if response.status_code == 409:
            raise LeaseLost(_message(response))
        _raise_if_damaged(response)
        if response.status_code >= 400:
            if response.status_code < 500:
                raise SkytrainError(f"control plane refused {method} {path}: {_message(response)}")
            response.raise_for_status()
        return response

    async def check(self, base_model: str) -> None:
        """Refused (SkytrainError saying why) unless this token may register a worker for
        ``base_model``. Retried while the control plane is unreachable; a control plane too
        old to know the check (404) is taken at its word when the worker registers."""

        async def ask() -> None:
            response = await self._http.get("/check", params={"base_model": base_model})
            if response.status_code == 404:
                return
            if response.status_code >= 500:
                response.raise_for_status()
            if response.status_code >= 400:
                raise SkytrainError(f"the control plane refused this worker: {_message(response)}")

        await self._retrying(ask)

    async def register(
        self, registration: protocol.WorkerRegistration
    ) -> protocol.WorkerRegistered:
        """Register; a worker that joined with a join token switches to the token it is given.

        Not retried: a join that succeeded but whose answer was lost would leave a second
        worker row behind (it is declared lost after the heartbeat timeout).
        """
        response = await self._send("POST", "/register", json=_body(registration))
        answer = _answer(protocol.WorkerRegistered, response)
        if answer.worker_token:
            self._http.headers["Authorization"] = f"Bearer {answer.worker_token}"
        return answer

    async def heartbeat(self, build: Callable[[], protocol.Heartbeat]) -> protocol.HeartbeatAnswer:
        """Send what ``build`` says the worker does, built again for each try: a body retried
        after a job committed (the control plane was away meanwhile) would set the worker back
        to what it did before, its engine asleep or without the new step."""
        response = await self._retrying(
            lambda: self._send("POST", "/heartbeat", json=_body(build()))
        )
        return _answer(protocol.HeartbeatAnswer, response)

    async def lease(self, *, wait_s: float = 0.0) -> protocol.LeasedJob | None:
        """A job for this worker: the control plane answers as soon as one is queued, or
        None after ``wait_s`` (a long-poll, so a queued job reaches the worker at once)."""
        response = await self._lease("/jobs/lease", wait_s=wait_s)
        return None if response is None else _answer(protocol.JobLease, response).job

    async def _lease(self, path: str, *, wait_s: float) -> httpx.Response | None:
        """The answer of a lease long-poll: None when nothing came within ``wait_s``."""
        response = await self._send(
            "POST",
            path,
            params={"wait_s": wait_s},
            json={},
            timeout=self._long_poll_timeout(wait_s),
        )
        return None if response.status_code == 204 else response

    def _long_poll_timeout(self, wait_s: float) -> httpx.Timeout:
        """The client's timeouts, with the read timeout extended by the server's wait."""
        timeout = self._http.timeout
        read_s = None if timeout.read is None else timeout.read + wait_s
        return httpx.Timeout(timeout.connect, read=read_s, write=timeout.write, pool=timeout.pool)

    async def renew(self, job_id: str, *, attempt: int) -> protocol.LeaseRenewed:
        body = _body(protocol.JobAttempt(attempt=attempt))
        response = await self._retrying(
            lambda: self._send("POST", f"/jobs/{job_id}/renew", json=body)
        )
        return _answer(protocol.LeaseRenewed, response)

    async def renewals(
        self, job_id: str, *, attempt: int, lease_s: float, what: str
    ) -> AsyncIterator[protocol.LeaseRenewed]:
        """The lease renewed every third of ``lease_s``, each answer as it comes, for ever: a
        renewal that fails is logged and tried again at the next; ``LeaseLost`` ends it."""
        while True:
            await asyncio.sleep(max(lease_s / 3, 0.5))
            try:
                answer = await self.renew(job_id, attempt=attempt)
            except LeaseLost:
                raise
            except Exception:
                logger.exception("renewing the lease of %s failed", what)
                continue
            yield answer

    async def event(
        self, job_id: str, *, attempt: int, type: protocol.WorkerEventType, data: dict[str, Any]
    ) -> protocol.JobEventRecorded:
        """Report an event; the answer says whether the job is to stop (cancel or yield)."""
        body = _body(protocol.JobEventReport(attempt=attempt, type=type, data=data))
        response = await self._retrying(
            lambda: self._send("POST", f"/jobs/{job_id}/events", json=body)
        )
        return _answer(protocol.JobEventRecorded, response)

    async def download_input(self, job_id: str, target: Path) -> Path:
        return await self._retrying(lambda: self._download(f"/jobs/{job_id}/input", target))

    async def list_checkpoint_files(self, model_id: str, step: int) -> list[ListedFile]:
        path = f"/models/{model_id}/checkpoints/{step}/files"
        response = await self._retrying(lambda: self._send("GET", path))
        return list(response.json()["data"])

    async def download_checkpoint_file(
        self, model_id: str, step: int, name: str, target: Path, *, sha256: str | None = None
    ) -> Path:
        """One file of a step into ``target``; with ``sha256`` (as the listing gives it), a
        file whose bytes hash otherwise is not kept: ``ObjectDamaged`` names it."""
        path = f"/models/{model_id}/checkpoints/{step}/files/{name}"
        return await self._retrying(
            lambda: self._download(
                path, target, sha256=sha256, what=f"file {name} of step {step} of model {model_id}"
            )
        )

    async def upload_file(self, job_id: str, path: Path, *, attempt: int) -> None:
        async def send() -> httpx.Response:
            return await self._send(
                "PUT",
                f"/jobs/{job_id}/files/{path.name}",
                params={"attempt": attempt},
                content=_file_chunks(path),
                headers={"Content-Type": "application/octet-stream"},
            )

        await self._retrying(send)

    async def complete(
        self, job_id: str, *, attempt: int, step: int, metrics: dict[str, float], files: list[Path]
    ) -> protocol.JobCompleted:
        body = protocol.JobCompletion(
            attempt=attempt,
            step=step,
            metrics=metrics,
            files=await asyncio.to_thread(lambda: [staged_file(f) for f in files]),
        )
        response = await self._send("POST", f"/jobs/{job_id}/complete", json=_body(body))
        return _answer(protocol.JobCompleted, response)

    async def fail(
        self,
        job_id: str,
        *,
        attempt: int,
        error_message: str,
        retryable: bool = False,
        cancelled: bool = False,
    ) -> protocol.JobFailed:
        body = protocol.JobFailure(
            attempt=attempt,
            error_message=error_message,
            retryable=retryable,
            cancelled=cancelled,
        )
        response = await self._send("POST", f"/jobs/{job_id}/fail", json=_body(body))
        return _answer(protocol.JobFailed, response)

    async def preempt(
        self, job_id: str, *, attempt: int, steps_done: int, files: list[Path]
    ) -> protocol.JobPreempted:
        """Hand back a job asked to yield, its state in the attempt's uploaded ``files``."""
        body = protocol.JobPreemption(
            attempt=attempt,
            steps_done=steps_done,
            files=[protocol.CheckpointFile(name=f.name, size=f.stat().st_size) for f in files],
        )
        response = await self._send("POST", f"/jobs/{job_id}/preempt", json=_body(body))
        return _answer(protocol.JobPreempted, response)

    async def download_saved_state(self, job_id: str, directory: Path) -> Path:
        """The state the job saved when it last yielded, into ``directory``."""
        path = f"/jobs/{job_id}/saved-state"
        response = await self._retrying(lambda: self._send("GET", path))
        for item in response.json()["data"]:
            name = str(item["name"])
            if Path(name).name != name or name in ("", ".", ".."):
                raise SkytrainError(f"the saved state of job {job_id} has a file named {name!r}")
            await self._retrying(
                functools.partial(self._download, f"{path}/{name}", directory / name)
            )
        return directory

    # --- the Tinker executor's calls (``/v1/worker/tinker/...``, ``protocol/tinker_ops.py``) ---

    async def tinker_lease(self, *, wait_s: float = 0.0) -> tinker_ops.LeasedRun | None:
        """A Tinker run placed on this worker, with its rebuild plan; None after ``wait_s``."""
        response = await self._lease("/tinker/lease", wait_s=wait_s)
        return None if response is None else _answer(tinker_ops.TinkerLease, response).run

    async def tinker_next(
        self, job_id: str, *, attempt: int, seq_id: int, wait_s: float
    ) -> tinker_ops.LeasedOperation | None:
        """Operation ``seq_id`` of the run once it has arrived; None after ``wait_s``."""
        body = _body(tinker_ops.NextOperationRequest(attempt=attempt, seq_id=seq_id, wait_s=wait_s))
        response = await self._send(
            "POST",
            f"/tinker/runs/{job_id}/next",
            json=body,
            timeout=self._long_poll_timeout(wait_s),
        )
        if response.status_code == 204:
            return None
        return _answer(tinker_ops.LeasedOperation, response)

    async def tinker_operation(
        self, job_id: str, seq_id: int, *, attempt: int
    ) -> tinker_ops.LeasedOperation:
        path = f"/tinker/runs/{job_id}/operations/{seq_id}"
        response = await self._retrying(
            lambda: self._send("GET", path, params={"attempt": attempt})
        )
        return _answer(tinker_ops.LeasedOperation, response)

    async def tinker_input(self, job_id: str, seq_id: int, *, attempt: int, target: Path) -> Path:
        """An operation's input object (a forward-backward's protobuf batch) into ``target``."""
        path = f"/tinker/runs/{job_id}/operations/{seq_id}/input?attempt={attempt}"
        return await self.download(path, target)

    async def tinker_output(
        self, job_id: str, seq_id: int, *, attempt: int, content: bytes, media_type: str
    ) -> None:
        path = f"/tinker/runs/{job_id}/operations/{seq_id}/output"
        await self._retrying(
            lambda: self._send(
                "PUT",
                path,
                params={"attempt": attempt},
                content=content,
                headers={"Content-Type": media_type},
            )
        )

    async def tinker_complete(
        self, job_id: str, seq_id: int, completion: tinker_ops.OperationCompletion
    ) -> None:
        path = f"/tinker/runs/{job_id}/operations/{seq_id}/complete"
        await self._retrying(lambda: self._send("POST", path, json=_body(completion)))

    async def tinker_fail(
        self, job_id: str, seq_id: int, failure: tinker_ops.OperationFailure
    ) -> None:
        path = f"/tinker/runs/{job_id}/operations/{seq_id}/fail"
        await self._send("POST", path, json=_body(failure))

    async def tinker_save(self, job_id: str, seq_id: int, commit: tinker_ops.SaveCommit) -> None:
        path = f"/tinker/runs/{job_id}/operations/{seq_id}/save"
        await self._retrying(lambda: self._send("POST", path, json=_body(commit)))

    async def tinker_checkpoint_files(
        self, job_id: str, model_id: str, step: int, *, attempt: int
    ) -> list[tinker_ops.CheckpointFileInfo]:
        path = f"/tinker/runs/{job_id}/checkpoints/{model_id}/{step}/files"
        response = await self._retrying(
            lambda: self._send("GET", path, params={"attempt": attempt})
        )
        files = _answer(tinker_ops.CheckpointFileList, response).data
        for item in files:
            if Path(item.name).name != item.name or item.name in (".", ".."):
                raise SkytrainError(f"checkpoint {model_id}:{step} has a file named {item.name!r}")
        return files

    async def tinker_checkpoint_file(
        self, job_id: str, model_id: str, step: int, name: str, *, attempt: int, target: Path
    ) -> Path:
        path = f"/tinker/runs/{job_id}/checkpoints/{model_id}/{step}/files/{name}"
        return await self.download(f"{path}?attempt={attempt}", target)

    async def download(self, path: str, target: Path) -> Path:
        """A worker route's body into ``target`` (never half a file), retried."""
        return await self._retrying(lambda: self._download(path, target))

    async def _download(
        self, path: str, target: Path, *, sha256: str | None = None, what: str = ""
    ) -> Path:
        """Stream to a temporary file beside ``target``, then rename: never half a file, nor
        one whose SHA-256 is not ``sha256`` (when given)."""
        target.parent.mkdir(parents=True, exist_ok=True)
        handle, staging = tempfile.mkstemp(prefix=f".{target.name}.", dir=target.parent)
        digest = hashlib.sha256()
        try:
            with os.fdopen(handle, "wb") as out:
                async with self._http.stream("GET", path, follow_redirects=True) as response:
                    if response.status_code >= 400:
                        await response.aread()
                        await self._send_error(response, path)
                    async for chunk in response.aiter_bytes():
                        digest.update(chunk)
                        out.write(chunk)
            if sha256 is not None and digest.hexdigest() != sha256:
                raise ObjectDamaged(
                    f"{what or path} downloaded with a SHA-256 other than the one committed: "
                    "the object store's copy is damaged since its commit, so it is not loaded "
                    "(the operator's `skytrain storage check --read` lists such files)"
                )
            os.replace(staging, target)
        except BaseException:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(staging)
            raise
        return target

    async def _send_error(self, response: httpx.Response, path: str) -> None:
        _raise_if_damaged(response)
        if response.status_code >= 500:
            response.raise_for_status()
        raise SkytrainError(f"control plane refused GET {path}: {_message(response)}")


async def until_stopped(call: Awaitable[T], stopping: asyncio.Event) -> T | None:
    """``call``'s answer, or None once ``stopping`` is set (the call is cancelled then: a
    pending long-poll never holds up a worker's shutdown)."""
    task = asyncio.ensure_future(call)
    stopped = asyncio.ensure_future(stopping.wait())
    try:
        await asyncio.wait({task, stopped}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopped.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
    return None if task.cancelled() else task.result()


def staged_file(path: Path, chunk_bytes: int = 1 << 20) -> protocol.StagedFile:
    """What the control plane checks the staged copy of ``path`` against before it commits."""
    sha256 = hashlib.sha256()
    size = 0
    with path.open("rb") as handle:
        while chunk := handle.read(chunk_bytes):
            sha256.update(chunk)
            size += len(chunk)
    return protocol.StagedFile(name=path.name, size=size, sha256=sha256.hexdigest())


async def _file_chunks(path: Path, chunk_bytes: int = 1 << 20) -> AsyncIterator[bytes]:
    """A file's bytes in chunks, read off the event loop: adapters can be gigabytes."""
    handle = await asyncio.to_thread(open, path, "rb")
    try:
        while chunk := await asyncio.to_thread(handle.read, chunk_bytes):
            yield chunk
    finally:
        handle.close()


def _body(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(mode="json", by_alias=True)


def _answer(kind: type[Answer], response: httpx.Response) -> Answer:
    """The control plane's answer as ``kind``; a mismatch means mismatched versions."""
    try:
        return kind.model_validate(response.json())
    except (ValueError, ValidationError) as exc:
        path = response.request.url.path
        raise SkytrainError(
            f"the control plane answered {path} in a shape this worker does not know "
            f"({exc}): install the control plane's version of skytrain on the worker"
        ) from None


def _raise_if_damaged(response: httpx.Response) -> None:
    """A step the store lost or damaged is not retried (it stays so): ``ObjectDamaged``
    with the control plane's words, which name the step."""
    if response.status_code != ObjectDamaged.status_code:
        return
    try:
        body = response.json()
    except ValueError:
        return
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("type") == ObjectDamaged.type:
        raise ObjectDamaged(str(error.get("message")))


def _message(response: httpx.Response) -> str:
    try:
        body = response.json()
    except ValueError:
        return response.text[:500] or f"HTTP {response.status_code}"
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and "message" in error:
        return str(error["message"])
    return str(body)[:500]

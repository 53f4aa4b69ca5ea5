"""Every error the SDK raises on purpose, under one root the user can catch.

Each class also inherits the standard exception it stands for, so code that knows nothing of
skytrain still catches it (a timeout is a ``TimeoutError``, a missing model a ``LookupError``).
An ``APIError`` carries the server's own message as its text, with the HTTP status and the
server's error ``type`` beside it.

    SkytrainError
    ├── ConfigurationError (ValueError)              no API key, a malformed base URL
    ├── NotRegisteredError (RuntimeError)            a TrainableModel used before register()
    ├── APIConnectionError (ConnectionError)         the server could not be reached
    │   └── APITimeoutError (TimeoutError)           no answer within the request timeout
    ├── APIError                                     the server answered with an error status
    │   ├── InvalidRequestError (ValueError)         400, 413, 422
    │   ├── AuthenticationError (PermissionError)    401, 403
    │   ├── NotFoundError (LookupError)              404
    │   ├── ConflictError                            409
    │   ├── RateLimitError                           429
    │   └── ServerError                              5xx
    │       └── ServiceUnavailableError              503 (+ retry_after)
    ├── ServingFailedError (RuntimeError)            the model's worker could not serve it
    ├── TrainingFailedError (RuntimeError)           the training job ended in failure
    └── WaitTimeoutError (TimeoutError)              register()/train() waited past its timeout
"""

from __future__ import annotations

import json

import httpx


class SkytrainError(Exception):
    """Root of the SDK's errors."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class ConfigurationError(SkytrainError, ValueError):
    """The client is set up in a way that cannot work (no API key, a malformed URL)."""


class NotRegisteredError(SkytrainError, RuntimeError):
    """A call needs the model's server-side id: ``await model.register(backend)`` first."""


class APIConnectionError(SkytrainError, ConnectionError):
    """The request never got an answer: the server is down, unreachable, or hung up."""


class APITimeoutError(APIConnectionError, TimeoutError):
    """The server did not answer within the request timeout."""


class APIError(SkytrainError):
    """The server answered with an error status; ``message`` is the server's own.

    ``retry_after`` is the server's ``Retry-After`` in seconds, when it sent one (429, 503).
    """

    def __init__(
        self, message: str, *, status_code: int, type: str, retry_after: float | None = None
    ) -> None:
        super().__init__(message)
        self.status_code = status_code
        self.type = type
        self.retry_after = retry_after

    def __repr__(self) -> str:
        return (
            f"{type(self).__name__}(status_code={self.status_code}, type={self.type!r}, "
            f"message={self.message!r})"
        )


class InvalidRequestError(APIError, ValueError):
    """The server refused the request as malformed (400), too large (413) or invalid (422)."""


class AuthenticationError(APIError, PermissionError):
    """The API key is missing, unknown, revoked (401) or not allowed to do this (403)."""


class NotFoundError(APIError, LookupError):
    """The resource does not exist, or belongs to another tenant (404)."""


class ConflictError(APIError):
    """The resource exists already or is in a state that forbids the request (409)."""


class RateLimitError(APIError):
    """Too many requests in flight for this tenant (429)."""


class ServerError(APIError):
    """The server failed while handling the request (5xx)."""


class ServiceUnavailableError(ServerError):
    """Nothing can serve the request yet (503); ``retry_after`` says when to try again."""


class ServingFailedError(SkytrainError, RuntimeError):
    """The server could not start serving the model; the message is the server's reason."""


class TrainingFailedError(SkytrainError, RuntimeError):
    """A training job failed on the server; the message is the server's ``error_message``."""

    def __init__(self, message: str, *, job_id: str) -> None:
        super().__init__(f"training job {job_id} failed: {message}")
        self.job_id = job_id
        self.error_message = message


class WaitTimeoutError(SkytrainError, TimeoutError):
    """``register()`` or ``train()`` waited longer than its ``timeout`` allows."""


_STATUS_ERRORS: dict[int, type[APIError]] = {
    400: InvalidRequestError,
    401: AuthenticationError,
    403: AuthenticationError,
    404: NotFoundError,
    409: ConflictError,
    413: InvalidRequestError,
    422: InvalidRequestError,
    429: RateLimitError,
}


def _retry_after_s(response: httpx.Response) -> float | None:
    value = response.headers.get("retry-after")
    if value is None:
        return None
    try:
        return max(0.0, float(value))
    except ValueError:
        return None  # an HTTP date; the caller's own backoff applies


def _error_from_response(response: httpx.Response) -> APIError:
    """The APIError subclass for an error response, carrying the server's message verbatim.

    skytrain answers ``{"error": {"type", "message"}}``; FastAPI's own validation errors come
    as ``{"detail": ...}``, and a proxy in front of the server may answer with plain text, so
    those are kept readable too.
    """
    status = response.status_code
    error_type = "http_error"
    try:
        body = response.json()
    except (json.JSONDecodeError, UnicodeDecodeError):
        body = None
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        error = body["error"]
        error_type = str(error.get("type") or error_type)
        message = str(error.get("message") or f"HTTP {status}")
    elif isinstance(body, dict) and "detail" in body:
        message = str(body["detail"])
    else:
        text = response.text.strip()
        message = f"HTTP {status} from {response.request.url}" + (f": {text[:500]}" if text else "")
    if status == 503:
        cls: type[APIError] = ServiceUnavailableError
    else:
        cls = _STATUS_ERRORS.get(status, ServerError if status >= 500 else APIError)
    return cls(message, status_code=status, type=error_type, retry_after=_retry_after_s(response))

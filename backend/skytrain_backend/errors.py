"""Every error skytrain raises on purpose.

Each class also inherits the standard exception it stands for, so callers that know nothing of
skytrain can still catch it. The API maps them to HTTP in one handler (``status_code``,
``type``) with the body ``{"error": {"type": ..., "message": ...}}``.

    SkytrainError
    ├── InvalidRequest (ValueError)            400
    │   ├── PayloadTooLarge                     413
    │   └── FitsNoGpu                           (the memory plan: no configured GPU holds it)
    ├── AuthenticationFailed (PermissionError)  401
    ├── QuotaExceeded (PermissionError)         403
    ├── NotFound (LookupError)                  404
    │   └── ObjectMissing
    ├── Conflict                                409
    │   └── LeaseLost
    ├── RateLimited                             429 (+ Retry-After)
    ├── Unavailable (ConnectionError)           503 (+ Retry-After)
    │   ├── DatabaseUnavailable
    │   └── ModelConfigUnavailable              (a base model's config.json: not from the Hub)
    ├── ConfigurationError (ValueError)         500; raised at start-up
    │   ├── SchemaOutdated
    │   └── MachineTooSmall                     (a worker's host or GPU is short of its plan)
    ├── StorageError (OSError)                  502
    │   └── StoreUnavailable                    503 (+ Retry-After)
    ├── ObjectDamaged (OSError)                 500 (a committed row's objects are gone)
    ├── EngineError (RuntimeError)              502
    │   ├── EngineRefused                       (the engine answered 4xx)
    │   └── EngineTimeout                       (no answer in the time given)
    └── TrainingError (RuntimeError)            500
        └── OutOfMemory (MemoryError)
"""

from __future__ import annotations


class SkytrainError(Exception):
    """Root of skytrain's errors."""

    status_code: int = 500
    type: str = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class InvalidRequest(SkytrainError, ValueError):
    """The request is malformed or asks for something impossible."""

    status_code = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    """The request body exceeds the configured limit."""

    status_code = 413
    type = "payload_too_large"


class FitsNoGpu(InvalidRequest):
    """The base model fits none of the GPUs workers may get, by the memory plan."""


class AuthenticationFailed(SkytrainError, PermissionError):
    """No key, or a key that is unknown or revoked."""

    status_code = 401
    type = "authentication_error"


class QuotaExceeded(SkytrainError, PermissionError):
    """The tenant's quota forbids the request, and waiting will not change that."""

    status_code = 403
    type = "quota_exceeded"

    def __init__(self, message: str, *, limit: str | None = None) -> None:
        super().__init__(message)
        self.limit = limit  # the quota's name (max_models), counted in the metrics


class NotFound(SkytrainError, LookupError):
    """The resource does not exist, or belongs to another tenant."""

    status_code = 404
    type = "not_found_error"


class ObjectMissing(NotFound):
    """An object the database points at is not in the object store."""


class Conflict(SkytrainError):
    """The resource exists already, or is in a state that forbids the request."""

    status_code = 409
    type = "conflict_error"


class LeaseLost(Conflict):
    """A worker no longer holds the training job it reports on (its lease expired, another
    attempt leased it, or it ended): the control plane answers 409 and the worker drops it."""


class RateLimited(SkytrainError):
    """The tenant has too much in flight, or in use, right now; retry after ``retry_after_s``."""

    status_code = 429
    type = "rate_limit_error"

    def __init__(
        self, message: str, *, retry_after_s: float = 1.0, limit: str | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        self.limit = limit  # the limit's name (max_tokens_in_flight), counted in the metrics


class Unavailable(SkytrainError, ConnectionError):
    """Nothing can serve the request yet (provisioning, training); retry after a while."""

    status_code = 503
    type = "unavailable_error"

    def __init__(
        self, message: str, *, retry_after_s: float = 5.0, state: str | None = None
    ) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        # What is under way, when known (a model's serving state: "loading", "starting"...).
        self.state = state


class ModelConfigUnavailable(Unavailable):
    """A base model's ``config.json``, which the memory plan needs before any launch, could
    not be had from the Hugging Face Hub: gated or private, missing, or the Hub unreachable.
    The message names the base model and what to do; it never shows the Hub's address."""


class DatabaseUnavailable(Unavailable):
    """The database could not be reached, or dropped the connection (a restart, a failover):
    the same request may succeed in a moment. Made by the API from the driver's error."""

    type = "database_unavailable"


class ConfigurationError(SkytrainError, ValueError):
    """Settings or environment that skytrain cannot run with."""

    type = "configuration_error"


class SchemaOutdated(ConfigurationError):
    """The database schema is older than this version of skytrain."""


class MachineTooSmall(ConfigurationError):
    """A worker's host or GPU memory is less than its memory plan needs: it stops at start."""

    type = "machine_too_small"


class StorageError(SkytrainError, OSError):
    """The object store failed."""

    status_code = 502
    type = "storage_error"


class StoreUnavailable(StorageError):
    """The object store could not be reached, or said it cannot serve now (a refused or cut
    connection, a timeout, a 5xx): the same request may succeed once it is back."""

    status_code = 503
    type = "storage_unavailable"
    retry_after_s = 5.0


class ObjectDamaged(SkytrainError, OSError):
    """What the store holds for a committed row is missing or not what was committed. Its
    message names the row (a model and step, never a key or the store's location): the
    caller is told, and the operator's ``skytrain storage check`` lists every such row."""

    status_code = 500
    type = "object_damaged"


class EngineError(SkytrainError, RuntimeError):
    """The inference engine failed or could not be started."""

    status_code = 502
    type = "engine_error"


class EngineTimeout(EngineError):
    """The engine did not answer a control call (a sleep, a wake-up) in the time given."""


class EngineRefused(EngineError):
    """The engine refused a request as malformed (a 4xx): sending it again changes nothing.

    An adapter whose rank is above the engine's limit, or a path it cannot read, says so here.
    """


class TrainingError(SkytrainError, RuntimeError):
    """Training could not run on the given data or configuration."""

    type = "training_error"


class OutOfMemory(TrainingError, MemoryError):
    """A job needed more (GPU) memory than the worker has; the same job would fail again."""

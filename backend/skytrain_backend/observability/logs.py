"""Log lines, as text or one JSON object a line, and the request's context they carry.

``configure_logging(fmt)`` sets the root logger up once per process (``SKYTRAIN_LOG_FORMAT``:
``text`` or ``json``). The context (request id, tenant, model, job, worker) lives in
contextvars: ``bind(...)`` sets it for the block, and every line logged inside carries it; a
JSON line always has every field (null when unknown), so a query never misses a key.

One request id follows an inference request: the control plane takes the caller's
``X-Request-Id`` when it is sane (``accept_request_id``) or makes one, answers it in
``X-Request-Id``, and sends it on to the worker's front door and from there to the engine
(with a suffix that keeps it unique there), so the lines each of them logs for it share it.
"""

from __future__ import annotations

import contextlib
import contextvars
import json
import logging
import re
import secrets
import sys
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Literal

REQUEST_ID_HEADER = "X-Request-Id"
# Printable, no spaces or quotes: safe in a header, a log line and a query string.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")

LogFormat = Literal["text", "json"]
CONTEXT_FIELDS = ("request_id", "tenant_id", "model_id", "job_id", "worker_id")

_context: dict[str, contextvars.ContextVar[str | None]] = {
    name: contextvars.ContextVar(f"skytrain_{name}", default=None) for name in CONTEXT_FIELDS
}


def accept_request_id(value: str | None) -> str:
    """The caller's request id when it is 1-64 characters of ``A-Za-z0-9._:-``; else a new one."""
    if value is not None and _REQUEST_ID_RE.match(value):
        return value
    return uuid.uuid4().hex


def engine_request_id(request_id: str) -> str:
    """The id a request goes to the engine with: the request's (cut to 55 characters), then
    ``-`` and 8 random hex digits, so the engine's lines are found by the request's id while
    two requests a caller gave one id never share one in the engine."""
    return f"{request_id[:55]}-{secrets.token_hex(4)}"


def current(name: str) -> str | None:
    return _context[name].get()


def current_request_id() -> str | None:
    return _context["request_id"].get()


@contextlib.contextmanager
def bind(**values: str | None) -> Iterator[None]:
    """Set context fields (``request_id``, ``tenant_id``...) for the block's log lines."""
    tokens = [(_context[name], _context[name].set(value)) for name, value in values.items()]
    try:
        yield
    finally:
        for var, token in reversed(tokens):
            var.reset(token)


def set_context(**values: str | None) -> None:
    """Set context fields for the rest of the current task (a request's handler)."""
    for name, value in values.items():
        _context[name].set(value)


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for name in CONTEXT_FIELDS:
            if not hasattr(record, name):
                setattr(record, name, _context[name].get())
        return True


class JsonFormatter(logging.Formatter):
    """One JSON object a line: time (UTC, ISO 8601), level, logger, message, the context
    fields, and the exception's traceback when there is one."""

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, object] = {
            "time": datetime.fromtimestamp(record.created, UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        for name in CONTEXT_FIELDS:
            entry[name] = getattr(record, name, None)
        if record.exc_info:
            entry["exception"] = self.formatException(record.exc_info)
        return json.dumps(entry, ensure_ascii=False, default=str)


class _TextFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line = super().format(record)
        request_id = getattr(record, "request_id", None)
        return f"{line} [request {request_id}]" if request_id else line


def configure_logging(fmt: LogFormat = "text", *, level: int | str = logging.INFO) -> None:
    """skytrain's log lines (``level`` and up) on stderr, as text or JSON, with the context."""
    handler = logging.StreamHandler(sys.stderr)
    handler.addFilter(_ContextFilter())
    if fmt == "json":
        handler.setFormatter(JsonFormatter())
    else:
        handler.setFormatter(_TextFormatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    for existing in list(root.handlers):
        root.removeHandler(existing)
    root.addHandler(handler)
    root.setLevel(level)
    # Uvicorn's loggers write through the root's handler, in the same format.
    for name in ("uvicorn", "uvicorn.error", "uvicorn.access"):
        logging.getLogger(name).handlers.clear()
        logging.getLogger(name).propagate = True
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per request is noise

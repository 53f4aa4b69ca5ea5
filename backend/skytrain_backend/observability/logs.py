"""Log lines, as text or one JSON object a line, and the request's context they carry.

``configure_logging(fmt)`` sets the root logger up once per process (``SKYTRAIN_LOG_FORMAT``:
``text`` or ``json``). The context (request id, tenant, model, job, worker) lives in
contextvars: ``bind(...)`` sets it for the block, and every line logged inside carries it; a
JSON line always has every field (null when unknown), so a query never misses a key.

In JSON mode every line the process writes is one JSON object: what other code prints to
stdout or stderr (a library's own handler, a progress bar, a stray ``print``) is wrapped into
one (``logger`` ``stdout``/``stderr``; a ``\r``-updated bar gives a line per update), Python's
warnings go through logging, library loggers with handlers of their own (transformers) are
routed to the root's, and processes started from then on draw no progress bars
(``TQDM_DISABLE``, ``HF_HUB_DISABLE_PROGRESS_BARS``).

One request id follows an inference request: the control plane takes the caller's
``X-Request-Id`` when it is sane (``accept_request_id``) or makes one, answers it in
``X-Request-Id``, and sends it on to the worker's front door and from there to the engine
(with a suffix that keeps it unique there), so the lines each of them logs for it share it.
"""

from __future__ import annotations

import contextlib
import contextvars
import io
import json
import logging
import os
import re
import secrets
import sys
import threading
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Literal, TextIO

REQUEST_ID_HEADER = "X-Request-Id"
# Printable, no spaces or quotes: safe in a header, a log line and a query string.
_REQUEST_ID_RE = re.compile(r"^[A-Za-z0-9._:\-]{1,64}$")

LogFormat = Literal["text", "json"]
CONTEXT_FIELDS = ("request_id", "tenant_id", "model_id", "job_id", "worker_id")

_context: dict[str, contextvars.ContextVar[str | None]] = {
    name: contextvars.ContextVar(f"skytrain_{name}", default=None) for name in CONTEXT_FIELDS
}
# Fields of the whole process (a worker's id once it registered): every line of every task,
# those started before it was known included, unless the task's context says otherwise.
_process_context: dict[str, str | None] = dict.fromkeys(CONTEXT_FIELDS)
# Progress bars drawn with \r have no place in a log of JSON lines: processes started in JSON
# mode (a worker's engine and trainer) draw none.
_NO_PROGRESS_BARS = {"TQDM_DISABLE": "1", "HF_HUB_DISABLE_PROGRESS_BARS": "1"}


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
    return _context[name].get() or _process_context[name]


def current_request_id() -> str | None:
    return current("request_id")


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


def set_process_context(**values: str | None) -> None:
    """Set context fields for every line this process logs from now on, in every task."""
    for name, value in values.items():
        if name not in _process_context:
            raise KeyError(name)
        _process_context[name] = value


class _ContextFilter(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        for name in CONTEXT_FIELDS:
            if getattr(record, name, None) is None:
                setattr(record, name, current(name))
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


class JsonLinesStream(io.TextIOBase):
    """A text stream that writes each line given to it to ``target`` as a JSON line (logger
    ``name``, with the context); a line that already is a JSON object passes as it is. A
    ``\r`` ends a line too (a progress bar's update); blank lines are dropped."""

    def __init__(self, target: TextIO, *, name: str, level: str = "info") -> None:
        super().__init__()
        self._target = target
        self._name = name
        self._level = level
        self._pending = ""
        self._lock = threading.Lock()

    def writable(self) -> bool:
        return True

    def isatty(self) -> bool:
        return False  # libraries draw no bars or colours for a log

    def fileno(self) -> int:
        return self._target.fileno()

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return getattr(self._target, "encoding", None) or "utf-8"

    def write(self, text: str) -> int:
        with self._lock:
            lines = (self._pending + text).replace("\r\n", "\n").replace("\r", "\n").split("\n")
            self._pending = lines.pop()
            for line in lines:
                self._emit(line)
        return len(text)

    def flush(self) -> None:
        with self._lock:
            if self._pending:
                self._emit(self._pending)
                self._pending = ""
        self._target.flush()

    def _emit(self, line: str) -> None:
        line = line.rstrip()
        if not line.strip():
            return
        if line.startswith("{") and line.endswith("}"):
            with contextlib.suppress(ValueError):
                if isinstance(json.loads(line), dict):
                    self._target.write(line + "\n")
                    return
        entry: dict[str, object] = {
            "time": datetime.now(UTC).isoformat(timespec="milliseconds"),
            "level": self._level,
            "logger": self._name,
            "message": line,
        }
        for name in CONTEXT_FIELDS:
            entry[name] = current(name)
        self._target.write(json.dumps(entry, ensure_ascii=False) + "\n")
        self._target.flush()


def _route_library_handlers(streams: tuple[object, ...]) -> None:
    """Loggers that print with a handler of their own (transformers adds one to stderr when
    imported) log through the root's instead, in its format."""
    for logger in list(logging.Logger.manager.loggerDict.values()):
        if not isinstance(logger, logging.Logger):
            continue
        for handler in list(logger.handlers):
            if isinstance(handler, logging.StreamHandler) and handler.stream in streams:
                logger.removeHandler(handler)
                logger.propagate = True


def configure_logging(
    fmt: LogFormat = "text",
    *,
    level: int | str = logging.INFO,
    whole_process: bool = False,
    worker_id: str | None = None,
) -> None:
    """skytrain's log lines (``level`` and up) on stderr, as text or JSON, with the context.

    ``whole_process`` (a server's, a worker's or an engine's entry point): in JSON mode, also
    everything else the process prints, as JSON lines (module docstring). ``worker_id`` (a
    launched worker and its engine know it from the start): on every line.
    """
    if worker_id:
        set_process_context(worker_id=worker_id)
    stream = sys.stderr
    if fmt == "json" and whole_process:
        originals = (sys.stdout, sys.stderr, sys.__stdout__, sys.__stderr__)
        stream = sys.__stderr__ or sys.stderr
        if not isinstance(sys.stderr, JsonLinesStream):
            sys.stderr = JsonLinesStream(stream, name="stderr")
        if not isinstance(sys.stdout, JsonLinesStream):
            sys.stdout = JsonLinesStream(sys.__stdout__ or sys.stdout, name="stdout")
        _route_library_handlers(originals)
        logging.captureWarnings(True)
        os.environ.update(_NO_PROGRESS_BARS)
    handler = logging.StreamHandler(stream)
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

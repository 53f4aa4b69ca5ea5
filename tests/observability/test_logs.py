"""Structured log lines: one JSON object a line with every context field."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator

import pytest

from skytrain_backend.observability import logs


@pytest.fixture
def root_logger() -> Iterator[None]:
    """configure_logging sets the process's root logger up: as it was after the test."""
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    uvicorn = {
        name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    }
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, (kept, propagate) in uvicorn.items():
        logging.getLogger(name).handlers[:] = kept
        logging.getLogger(name).propagate = propagate


@pytest.mark.usefixtures("root_logger")
def test_json_lines_carry_the_bound_context_and_null_for_the_rest(
    capsys: pytest.CaptureFixture[str],
) -> None:
    logs.configure_logging("json")
    with logs.bind(request_id="req-1", tenant_id="t-1"):
        logging.getLogger("skytrain_backend.test").info("routed %s", "there")
    logging.getLogger("skytrain_backend.test").warning("after")
    first, second = (json.loads(line) for line in capsys.readouterr().err.splitlines()[-2:])
    assert first["message"] == "routed there"
    assert first["level"] == "info" and first["logger"] == "skytrain_backend.test"
    assert (first["request_id"], first["tenant_id"]) == ("req-1", "t-1")
    assert first["model_id"] is None and first["job_id"] is None and first["worker_id"] is None
    assert first["time"].endswith("+00:00")
    assert second["request_id"] is None  # the block's context ended with it


@pytest.mark.parametrize(
    ("given", "kept"),
    [
        ("abc-123", True),
        ("a" * 64, True),
        ("a" * 65, False),
        ("with space", False),
        ("new\nline", False),
        ("", False),
        (None, False),
    ],
)
def test_request_ids_are_kept_only_when_sane(given: str | None, kept: bool) -> None:
    accepted = logs.accept_request_id(given)
    assert (accepted == given) is kept
    assert 1 <= len(accepted) <= 64


def test_the_engine_gets_the_request_id_unique_and_still_sane() -> None:
    first, second = (logs.engine_request_id("x" * 64) for _ in range(2))
    assert first != second and first.startswith("x" * 55)
    assert logs.accept_request_id(first) == first  # the engine keeps it

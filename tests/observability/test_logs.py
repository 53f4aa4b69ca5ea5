"""Structured log lines: one JSON object a line with every context field."""

from __future__ import annotations

import json
import logging
import subprocess
import sys

import pytest

from skytrain_backend.observability import logs


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


WHOLE_PROCESS = """
import logging, sys, warnings
from skytrain_backend.observability import logs

library = logging.getLogger("somelib")  # a library with a handler of its own (transformers)
library.addHandler(logging.StreamHandler(sys.stderr))
library.propagate = False
logs.configure_logging("json", whole_process=True)
logs.set_process_context(worker_id="w-1")
print("a plain print")
sys.stderr.write("bar 10%\\rbar 100%\\n\\n")
warnings.warn("an old call")
library.warning("from the library")
try:
    raise OSError("disk gone")
except OSError:
    logging.getLogger("skytrain_backend.x").exception("it failed")
import os
print(os.environ["TQDM_DISABLE"], os.environ["HF_HUB_DISABLE_PROGRESS_BARS"])
"""


def test_json_mode_makes_every_line_the_process_prints_json() -> None:
    """Issue 36: a worker's and its engine's logs mixed progress bars, library warnings and
    boxed tracebacks into the JSON lines. A process in JSON mode (its own, as a worker is)."""
    result = subprocess.run(
        [sys.executable, "-c", WHOLE_PROCESS], capture_output=True, text=True, timeout=120
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in (result.stdout + result.stderr).splitlines()]
    assert all(line["worker_id"] == "w-1" for line in lines)
    found = {(line["logger"], line["level"], line["message"]) for line in lines}
    assert ("stdout", "info", "a plain print") in found
    assert {("stderr", "info", "bar 10%"), ("stderr", "info", "bar 100%")} <= found
    assert ("somelib", "warning", "from the library") in found
    assert ("stdout", "info", "1 1") in found  # its children draw no progress bars
    (warned,) = [line for line in lines if line["logger"] == "py.warnings"]
    assert warned["level"] == "warning" and "an old call" in warned["message"]
    (failed,) = [line for line in lines if line["level"] == "error"]
    assert failed["message"] == "it failed"
    assert "Traceback" in failed["exception"] and "OSError: disk gone" in failed["exception"]

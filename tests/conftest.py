"""Shared test setup. Fixtures live in tests/fixtures/, one module per kind of real part."""

from __future__ import annotations

import importlib.util
import json
import logging
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import tqdm

# tqdm's monitor thread outlives every bar: none in the tests (see tests/fixtures/leaks.py).
tqdm.tqdm.monitor_interval = 0

pytest_plugins = [
    "tests.fixtures.leaks",
    "tests.fixtures.art_oracle",
    "tests.fixtures.hub",
    "tests.fixtures.models",
    "tests.fixtures.services",
    "tests.fixtures.callers",
    "tests.fixtures.cli",
]


@pytest.fixture(autouse=True)
def _tracebacks_kept() -> Iterator[None]:
    """SkyPilot's ``ux_utils.print_exception_no_traceback`` sets ``sys.tracebacklimit = 0``
    and does not restore it when the exception it wraps propagates: every traceback the
    process formats afterwards has no frames (a later test that checks a recorded traceback
    failed in a run where a provider test came first). Each test starts with the limit as it
    was."""
    limit = getattr(sys, "tracebacklimit", None)
    yield
    if limit is None:
        if hasattr(sys, "tracebacklimit"):
            del sys.tracebacklimit
    else:
        sys.tracebacklimit = limit


@pytest.fixture(autouse=True)
def _logging_kept() -> Iterator[None]:
    """A command run in this process (Typer's runner: `skytrain worker`, `serve`) sets the
    root logger up on the runner's stream, which closes when the command returns: every line
    logged afterwards, by a later test or a thread, then printed "--- Logging error ---" into
    whatever that test captured (a `--json` output that no longer parsed). Each test ends with
    logging, the standard streams and the process's log context as they began."""
    from skytrain_backend.observability import logs

    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    named = {
        name: (list(logging.getLogger(name).handlers), logging.getLogger(name).propagate)
        for name in ("uvicorn", "uvicorn.error", "uvicorn.access")
    }
    streams = sys.stdout, sys.stderr
    context = dict(logs._process_context)
    yield
    root.handlers[:] = handlers
    root.setLevel(level)
    for name, (kept, propagate) in named.items():
        logging.getLogger(name).handlers[:] = kept
        logging.getLogger(name).propagate = propagate
    sys.stdout, sys.stderr = streams
    logs._process_context.update(context)


def _cuda_available() -> bool:
    if importlib.util.find_spec("torch") is None:
        return False
    import torch

    return torch.cuda.is_available()


# Seconds each test file took in a whole run (setup, calls and teardown), written by
# bench/test_durations.py from a run's `--durations=0` report. Only the order uses them.
DURATIONS = Path(__file__).with_name("durations.json")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    _refuse_session_fixtures_over_a_narrower_override(items)
    if config.getoption("dist", "no") != "no":
        _longest_files_first(items)
    _deselect_vllm_unless_asked(config, items)
    if _cuda_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA; this machine has none")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)


def _longest_files_first(items: list[pytest.Item]) -> None:
    """Under pytest-xdist, scripts/test.sh hands whole files to its processes (``loadfile``,
    with ``--no-loadscope-reorder``) in collection order: the longest go first, so the run does not
    end with one process on a long file while the others idle. Stable: a file's tests stay in
    order, and files of no known duration (new ones) keep theirs, last."""
    seconds: dict[str, float] = json.loads(DURATIONS.read_text()) if DURATIONS.exists() else {}
    root = Path(__file__).parents[1]

    def weight(item: pytest.Item) -> float:
        if not item.path.is_relative_to(root):
            return 0.0
        return -seconds.get(item.path.relative_to(root).as_posix(), 0.0)

    items.sort(key=weight)


def _refuse_session_fixtures_over_a_narrower_override(items: list[pytest.Item]) -> None:
    """pytest keeps one value of a session fixture for the whole run, whichever override of a
    fixture it depends on was active when it was made. A package that overrides ``settings``
    but not ``db_sessions`` got the database another package's settings made first, and its own
    ``control_plane`` on another database: its join tokens were unknown to the control plane,
    only in runs where such a package came first. Refused at collection, in every order."""
    for item in items:
        info = getattr(item, "_fixtureinfo", None)
        if info is None:
            continue
        for name, definitions in info.name2fixturedefs.items():
            made = definitions[-1]
            if made.scope != "session":
                continue
            for argname in made.argnames:
                if argname not in info.name2fixturedefs:
                    continue
                used = info.name2fixturedefs[argname][-1]
                if used.baseid != made.baseid and _inside(used.baseid, made.baseid):
                    raise pytest.UsageError(
                        f"{item.nodeid}: session fixture {name!r} (from {made.baseid or 'a plugin'})"
                        f" is built on {argname!r}, overridden in {used.baseid}: override {name!r}"
                        " there too (see DEVELOPERS.md, Test fixtures)"
                    )


def _inside(nodeid: str, parent: str) -> bool:
    return parent == "" or nodeid.startswith((parent + "/", parent + "::"))


def _deselect_vllm_unless_asked(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``vllm`` need real vLLM (scripts/test-vllm.sh builds it and runs
    ``-m vllm``): a run whose -m does not name vllm leaves them out, as not collected rather
    than skipped, so they never count as coverage of a run that did not start vLLM."""
    if "vllm" in (config.option.markexpr or ""):
        return
    left_out = [item for item in items if item.get_closest_marker("vllm")]
    if left_out:
        config.hook.pytest_deselected(items=left_out)
        items[:] = [item for item in items if not item.get_closest_marker("vllm")]

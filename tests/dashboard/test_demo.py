"""``skytrain demo`` prints the dashboard's address, and the page shows the demo's model while
it trains; Ctrl-C then stops the control plane, its workers and the open job (tiny model: only
the dashboard and the shutdown are under test here; one demo run serves both, as it starts a
control plane, a worker and its engine)."""

from __future__ import annotations

import contextlib
import re
import signal
import sqlite3
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.demo.support import (
    assert_nothing_left,
    processes_of,
    start_demo,
    wait_for_output,
    wait_until_training,
)

pytestmark = [pytest.mark.e2e]

LINK = re.compile(r"dashboard \(open it while the demo runs\): (http://127\.0\.0\.1:\d+/#key=\S+)")


@pytest.mark.slow
def test_the_demos_dashboard_shows_its_model_while_it_trains_and_ctrl_c_stops_everything(
    tmp_path: Path, tiny_model_path: Path, open_page: Callable[..., Page]
) -> None:
    """Started as a background command, with SIGINT ignored (issue 36): the Ctrl-C while a
    training job is open is also that moment of the test below. A demo started from a
    terminal begins with the handler the demo takes back when it finds SIGINT ignored."""
    home, log_path = tmp_path / "home", tmp_path / "demo.out"
    with open(log_path, "w") as log:
        process = start_demo(
            home, "--base-model", str(tiny_model_path), "--steps", "50", stdout=log,
            sigint_ignored=True,
        )  # fmt: skip
    try:
        found = LINK.search(wait_until_training(process, log_path))
        assert found, log_path.read_text()[-4000:]
        assert len(processes_of(home)) >= 3  # the server, a worker and its engine

        page = open_page()
        page.goto(found.group(1))
        model = page.locator("table.models tbody tr th a")
        expect(model).to_have_count(1)
        expect(model).to_contain_text(f"{tiny_model_path.name.lower()}-")
        model.click()
        # The held-out evaluation of step 0 is logged before the first training step.
        expect(page.locator('[data-chart="reward"]')).to_be_visible()
        expect(page.locator("h1.model-name")).to_contain_text("demo")
        assert "key=" not in page.url
        page.close()  # before the demo's control plane stops answering its requests

        # 50 steps are far from done: the Ctrl-C lands while a training job is open.
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=180) == 130
    finally:
        if process.poll() is None:  # a failed check above: stop the demo all the same
            process.send_signal(signal.SIGINT)
            process.wait(timeout=180)
    output = log_path.read_text()
    assert "interrupted: the control plane and its workers are stopped" in output
    assert_nothing_left(home)
    # No job is left to be picked up by the next demo's worker.
    with contextlib.closing(sqlite3.connect(home / "skytrain.db")) as db:
        statuses = [status for (status,) in db.execute("SELECT status FROM training_jobs")]
    assert statuses and set(statuses) <= {"succeeded", "cancelled"}, statuses


@pytest.mark.slow
@pytest.mark.parametrize(
    "moment",
    [
        "==> starting the embedded control plane",  # the server starting
        "==> registering",  # the worker and its engine starting
        # A training job open: the test above, which also opens the dashboard meanwhile.
    ],
)
def test_ctrl_c_stops_the_demo_at_any_moment_even_started_in_the_background(
    moment: str, tmp_path: Path, tiny_model_path: Path
) -> None:
    """Issue 36: a demo sent SIGINT trained on to its last step and exited 0. It had been
    started the way a non-interactive shell starts a background command, with SIGINT ignored
    (``scripts/test.sh &``): Python then raises no KeyboardInterrupt. Here the demo starts
    that way and gets one SIGINT at each moment of a run (while it trains: the test above)."""
    home, log_path = tmp_path / "home", tmp_path / "demo.out"
    with open(log_path, "w") as log:
        process = start_demo(
            home, "--base-model", str(tiny_model_path), "--steps", "50", stdout=log,
            sigint_ignored=True,
        )  # fmt: skip
    try:
        wait_for_output(process, log_path, moment)
        process.send_signal(signal.SIGINT)
        assert process.wait(timeout=180) == 130, log_path.read_text()[-4000:]
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=60)
    assert "interrupted: the control plane and its workers are stopped" in log_path.read_text()
    assert_nothing_left(home)

"""``skytrain demo`` prints the dashboard's address, and the page shows the demo's model while
it trains (tiny model: only the dashboard is under test here)."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from playwright.sync_api import Page, expect

from tests.fixtures.models import model_cache_dir

pytestmark = [pytest.mark.e2e]

LINK = re.compile(r"dashboard \(open it while the demo runs\): (http://127\.0\.0\.1:\d+/#key=\S+)")


def test_the_demos_dashboard_link_shows_its_model_while_it_trains(
    tmp_path: Path, tiny_model_path: Path, open_page: Callable[..., Page]
) -> None:
    home, log_path = tmp_path / "home", tmp_path / "demo.out"
    env = {**os.environ, "SKYTRAIN_MODEL_CACHE_DIR": str(model_cache_dir())}
    command = [sys.executable, "-m", "skytrain_backend", "demo", "--home", str(home)]
    with open(log_path, "w") as log:
        process = subprocess.Popen(
            [*command, "--base-model", str(tiny_model_path), "--steps", "50"],
            env=env,
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    try:
        deadline = time.monotonic() + 600
        # Training is under way once the SDK's progress bar shows.
        while "train:" not in log_path.read_text():
            assert process.poll() is None, log_path.read_text()[-4000:]
            assert time.monotonic() < deadline, log_path.read_text()[-4000:]
            time.sleep(0.2)
        found = LINK.search(log_path.read_text())
        assert found, log_path.read_text()[-4000:]

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
    finally:
        process.send_signal(signal.SIGINT)
        process.wait(timeout=180)

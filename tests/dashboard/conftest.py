"""The dashboard in a real browser: the system's Chromium (Debian's package, which
``scripts/setup.sh`` installs), driven by Playwright, which never downloads a browser here.

- ``browser`` (package): one headless Chromium for every test here.
- ``open_page(key=None, expected_errors=())``: a fresh browser context (its own local
  storage) and page, signed in with ``key`` if given. Every console error and uncaught page
  error is recorded; at the end of the test any that ``expected_errors`` (regular
  expressions) does not explain fails it.
- ``screenshot(page, name)``: saves ``<name>.png`` to ``$SKYTRAIN_TEST_SCREENSHOTS`` (set it to
  ``docs/screenshots`` to refresh the committed ones), else to a temporary directory.
- ``run_async(coroutine)``: runs SDK code in a thread of its own (Playwright's sync API keeps
  an event loop in this one).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
from collections.abc import Callable, Coroutine, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import pytest
from playwright.sync_api import Browser, ConsoleMessage, Page, expect, sync_playwright

T = TypeVar("T")
VIEWPORT = {"width": 1280, "height": 900}
# Waits for what a page shows: the worker and its trainer share two busy cores with the tests.
EXPECT_TIMEOUT_MS = 60_000
expect.set_options(timeout=EXPECT_TIMEOUT_MS)


@pytest.fixture(scope="session")
def chromium_path() -> str:
    path = shutil.which("chromium")
    if path is None:
        pytest.fail(
            "no chromium on PATH: run scripts/setup.sh (as root on Debian it installs the "
            "chromium package), or apt-get install chromium"
        )
    return path


@pytest.fixture(scope="package")
def browser(chromium_path: str) -> Iterator[Browser]:
    with sync_playwright() as playwright:
        # --no-sandbox: Chromium's sandbox refuses to run as root, which CI is.
        browser = playwright.chromium.launch(executable_path=chromium_path, args=["--no-sandbox"])
        yield browser
        browser.close()


@dataclass
class Browsing:
    """A page and the console errors it logged."""

    page: Page
    errors: list[str] = field(default_factory=list)
    expected: tuple[str, ...] = ()

    def unexpected_errors(self) -> list[str]:
        return [e for e in self.errors if not any(re.search(p, e) for p in self.expected)]


@pytest.fixture
def open_page(browser: Browser, request: pytest.FixtureRequest) -> Iterator[Callable[..., Page]]:
    opened: list[Browsing] = []

    def open_(key: str | None = None, *, expected_errors: tuple[str, ...] = ()) -> Page:
        context = browser.new_context(viewport=VIEWPORT, accept_downloads=True)
        context.set_default_timeout(EXPECT_TIMEOUT_MS)
        if key is not None:
            # What the sign-in form stores; set before any script of the page runs.
            context.add_init_script(f"localStorage.setItem('skytrain.apiKey', {key!r});")
        page = context.new_page()
        browsing = Browsing(page=page, expected=expected_errors)

        def console(message: ConsoleMessage) -> None:
            if message.type == "error":
                browsing.errors.append(f"console: {message.text} ({message.location})")

        page.on("console", console)
        page.on("pageerror", lambda error: browsing.errors.append(f"page error: {error.stack}"))
        opened.append(browsing)
        return page

    yield open_
    for browsing in opened:
        browsing.page.context.close()
    failures = [error for browsing in opened for error in browsing.unexpected_errors()]
    assert not failures, f"errors in the browser console: {failures}"


@pytest.fixture(scope="session")
def screenshot(tmp_path_factory: pytest.TempPathFactory) -> Callable[[Page, str], Path]:
    directory = Path(
        os.environ.get("SKYTRAIN_TEST_SCREENSHOTS") or tmp_path_factory.mktemp("screenshots")
    )
    directory.mkdir(parents=True, exist_ok=True)

    def take(page: Page, name: str) -> Path:
        path = directory / f"{name}.png"
        page.screenshot(path=str(path))  # what a 1280x900 window shows
        return path

    return take


_async_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sdk")


def run_async(coroutine: Coroutine[Any, Any, T]) -> T:
    return _async_thread.submit(asyncio.run, coroutine).result()

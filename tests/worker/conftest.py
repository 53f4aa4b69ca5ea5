"""The worker protocol's suites run on the embedded control plane (SQLite, local directory)."""

from __future__ import annotations

import pytest

from skytrain_backend.config import Settings


@pytest.fixture(scope="session")
def settings(embedded_settings: Settings) -> Settings:
    return embedded_settings

"""``skytrain worker``'s configuration: the settings and the CLI's options read into a
``WorkerConfig``, and what it says when they cannot run a worker."""

from __future__ import annotations

import pytest

from skytrain_backend.config import Settings
from skytrain_backend.errors import ConfigurationError
from skytrain_backend.worker.main import WorkerConfig

JOIN = {"control_plane_url": "http://127.0.0.1:8000", "token": "swt-test", "base_model": "m"}


@pytest.mark.parametrize("secret", ["too-short", "x" * 129])
def test_an_engine_secret_out_of_bounds_is_named_with_its_rule(
    monkeypatch: pytest.MonkeyPatch, secret: str
) -> None:
    monkeypatch.setenv("SKYTRAIN_ENGINE_SECRET", secret)
    with pytest.raises(ConfigurationError) as raised:
        WorkerConfig.from_settings(Settings(), **JOIN)
    message = str(raised.value)
    assert "SKYTRAIN_ENGINE_SECRET" in message
    assert "16 to 128 characters" in message
    assert secret not in message  # a secret is never echoed back


def test_an_engine_secret_in_bounds_is_the_front_doors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("SKYTRAIN_ENGINE_SECRET", "s" * 16)
    assert WorkerConfig.from_settings(Settings(), **JOIN).engine_secret == "s" * 16


def test_without_an_engine_secret_the_worker_makes_one(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SKYTRAIN_ENGINE_SECRET", raising=False)
    first = WorkerConfig.from_settings(Settings(), **JOIN).engine_secret
    second = WorkerConfig.from_settings(Settings(), **JOIN).engine_secret
    assert first != second and 16 <= len(first) <= 128

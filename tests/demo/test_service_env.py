"""The demo's embedded control plane loads the base model the user named by its directory."""

from __future__ import annotations

from pathlib import Path

import pytest

from skytrain_backend.base_models import check_base_model
from skytrain_backend.config import Settings
from skytrain_backend.demo.service import service_env
from skytrain_backend.errors import InvalidRequest


def test_the_embedded_server_allows_the_model_cache_and_the_demos_model_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    cache, models = tmp_path / "cache", tmp_path / "models"
    (models / "my-model").mkdir(parents=True)
    env = service_env(tmp_path / "home", port=8000, model_cache_dir=cache, base_model_dirs=[models])
    for name, value in env.items():
        if name.startswith("SKYTRAIN_"):
            monkeypatch.setenv(name, value)
    allowed = Settings().storage.resolved_base_model_dirs
    assert allowed == [cache, models]
    assert check_base_model(str(models / "my-model"), allowed_dirs=allowed)
    with pytest.raises(InvalidRequest):
        check_base_model(str(tmp_path / "elsewhere"), allowed_dirs=allowed)

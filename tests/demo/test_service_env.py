"""The demo's embedded control plane loads the base model the user named by its directory."""

from __future__ import annotations

import socket
from pathlib import Path

import httpx
import pytest

from skytrain_backend.base_models import check_base_model
from skytrain_backend.config import Settings
from skytrain_backend.demo import service
from skytrain_backend.demo.service import PortTaken, embedded_service, free_port, service_env
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


@pytest.mark.slow
def test_a_port_taken_before_the_server_binds_it_is_tried_again_only_when_chosen_here(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The demo picks a free port and the server binds it a moment later: another process
    can take it in between (seen once: the demo failed at start). A port the demo chose is
    chosen again; a port the user named is refused, naming it."""
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        home = tmp_path / "home"
        taken_port = embedded_service(home, port=busy, model_cache_dir=tmp_path / "cache")
        with pytest.raises(PortTaken, match=f"port {busy} is taken"), taken_port:
            pass
        # The first port the demo picks is taken by then; the next is not.
        picks = iter([busy])
        monkeypatch.setattr(service, "free_port", lambda: next(picks, None) or free_port())
        with embedded_service(home, port=None, model_cache_dir=tmp_path / "cache") as running:
            assert not running.url.endswith(f":{busy}")
            assert httpx.get(f"{running.url}/health", timeout=10).status_code == 200

"""Hostile input against the real control plane, on both databases (SQLite and PostgreSQL
differ where it matters here: 64-bit against 32-bit integer columns, NUL in text).

``settings`` is overridden for this package: {sqlite, postgres} with the local object store
(storage is not what these tests are about), small request limits as in the rest of the suite
(and 256 KiB for inference bodies), base models from the test model cache and from the
home's ``allowed-models`` directory.
"""

from __future__ import annotations

import pytest

from skytrain_backend.config import Settings
from tests.fixtures.models import model_cache_dir
from tests.fixtures.services import MakeSettings, fixtures_on_settings

INFERENCE_LIMIT = 256 * 1024


@pytest.fixture(
    scope="session", params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)]
)
def settings(
    request: pytest.FixtureRequest,
    tmp_path_factory: pytest.TempPathFactory,
    make_settings: MakeSettings,
) -> Settings:
    home = tmp_path_factory.mktemp(f"hostile-{request.param}")
    (home / "allowed-models").mkdir()
    return make_settings(
        database=request.param,
        storage={
            "home": home,
            "model_cache_dir": model_cache_dir(),
            "base_model_dirs": f"{model_cache_dir()}:{home / 'allowed-models'}",
        },
        server={
            "max_request_bytes": 1024 * 1024,
            "max_inference_request_bytes": INFERENCE_LIMIT,
            "max_trajectories_per_request": 500,
        },
    )


# The session fixtures built on ``settings`` are defined again for this package.
control_plane, db_sessions, object_store = fixtures_on_settings()

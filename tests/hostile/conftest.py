"""Hostile input against the real control plane, on both databases (SQLite and PostgreSQL
differ where it matters here: 64-bit against 32-bit integer columns, NUL in text).

``settings`` is overridden for this package: {sqlite, postgres} with the local object store
(storage is not what these tests are about), small request limits as in the rest of the suite
(and 256 KiB for inference bodies), base models from the test model cache and from the
home's ``allowed-models`` directory.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.config import Settings
from skytrain_backend.storage import ObjectStore, open_object_store
from tests.fixtures.models import model_cache_dir
from tests.fixtures.services import (
    ControlPlane,
    MakeSettings,
    database_sessions,
    running_control_plane,
)

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
        home=home,
        max_request_bytes=1024 * 1024,
        max_inference_request_bytes=INFERENCE_LIMIT,
        max_trajectories_per_request=500,
        model_cache_dir=model_cache_dir(),
        base_model_dirs=f"{model_cache_dir()}:{home / 'allowed-models'}",
    )


# The session fixtures that depend on ``settings`` are overridden too: pytest would otherwise
# hand this package the control plane another package's settings made first.


@pytest.fixture(scope="session")
def control_plane(settings: Settings) -> Iterator[ControlPlane]:
    with running_control_plane(settings) as plane:
        yield plane


@pytest.fixture(scope="session")
def db_sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    with database_sessions(settings) as sessions:
        yield sessions


@pytest.fixture(scope="session")
def object_store(settings: Settings) -> ObjectStore:
    return open_object_store(settings.resolved_object_store_url, settings)

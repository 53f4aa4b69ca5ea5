"""Hostile input against the real control plane, on both databases (SQLite and PostgreSQL
differ where it matters here: 64-bit against 32-bit integer columns, NUL in text).

``settings`` is overridden for this package: {sqlite, postgres} with the local object store
(storage is not what these tests are about), small request limits as in the rest of the suite
(and 256 KiB for inference bodies), base models from the test model cache and from the
home's ``allowed-models`` directory.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import httpx
import pytest
from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.app import create_app
from skytrain_backend.config import Settings
from skytrain_backend.db.session import create_db_engine, session_factory
from skytrain_backend.storage import ObjectStore, open_object_store
from tests.api import support
from tests.api.conftest import Caller
from tests.fixtures.models import model_cache_dir
from tests.fixtures.services import ApiKey, ControlPlane, MakeSettings
from tests.gateway.conftest import serve_in_thread

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
    served = settings.model_copy(update={"host": "127.0.0.1"})
    with serve_in_thread(create_app(served)) as url:
        yield ControlPlane(url=url, settings=served)


@pytest.fixture(scope="session")
def db_sessions(settings: Settings) -> Iterator[sessionmaker[Session]]:
    engine = create_db_engine(settings.resolved_database_url)
    yield session_factory(engine)
    engine.dispose()


@pytest.fixture(scope="session")
def object_store(settings: Settings) -> ObjectStore:
    return open_object_store(settings.resolved_object_store_url, settings)


@pytest.fixture
def caller(control_plane: ControlPlane, api_key: Callable[..., ApiKey]) -> Iterator[Caller]:
    key = api_key()
    with httpx.Client(base_url=control_plane.url, headers=key.headers, timeout=60) as http:
        yield Caller(key=key, http=http)


@pytest.fixture
def stored(db_sessions: Any, object_store: Any) -> Callable[[Caller], Any]:
    """``stored(caller)``: the caller's rows and objects, to compare before and after."""
    return lambda who: support.snapshot(db_sessions, object_store, who.key.tenant_id)

"""Fresh, empty databases of each kind, one per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from sqlalchemy import Engine

from skytrain_backend.db.session import create_db_engine


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def empty_engine(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[Engine]:
    if request.param == "sqlite":
        url = f"sqlite:///{tmp_path / 'skytrain.db'}"
    else:
        make: Callable[[], str] = request.getfixturevalue("make_postgres_url")
        url = make()
    engine = create_db_engine(url)
    yield engine
    engine.dispose()

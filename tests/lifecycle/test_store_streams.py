"""What a worker downloads (a job's input, a committed step's files) streams with no database
transaction open: a slow download holds no table and no pooled connection for its length.
Table locks are PostgreSQL's: on SQLite there is nothing to see."""

from __future__ import annotations

import pytest

from skytrain_backend.config import Settings
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import OnWorker, held_tables, leased_job, store_watched

ADAPTER = {"adapter_config.json": b'{"r": 8}', "adapter_model.safetensors": bytes(range(256))}
TABLES = ("training_jobs", "models", "checkpoints")


@pytest.fixture(autouse=True)
def _postgres_only(lifecycle_settings: Settings) -> None:
    if lifecycle_settings.storage.resolved_database_url.startswith("sqlite"):
        pytest.skip("table locks are PostgreSQL's: SQLite has none to hold")


def test_a_jobs_input_and_a_steps_files_stream_with_no_transaction_open(
    on_worker: OnWorker, lifecycle_plane: ServedPlane
) -> None:
    alice, model_id, worker = on_worker
    job_id = leased_job(alice, worker, model_id)
    held: list[list[str]] = []

    def watch() -> None:
        held.append(held_tables(lifecycle_plane.sessions, *TABLES))

    with store_watched(lifecycle_plane.app, watch, on="iter_chunks"):
        read = worker.http.get(f"/jobs/{job_id}/input")
    assert read.status_code == 200, read.text
    assert read.content.count(b"\n") == 1  # the one group queued
    worker.stage(job_id, ADAPTER)
    assert worker.complete(job_id, ADAPTER, step=1).status_code == 200
    with store_watched(lifecycle_plane.app, watch, on="iter_chunks"):
        weights = worker.http.get(
            f"/models/{model_id}/checkpoints/1/files/adapter_model.safetensors"
        )
    assert weights.status_code == 200, weights.text
    assert weights.content == ADAPTER["adapter_model.safetensors"]
    assert held == [[], []]

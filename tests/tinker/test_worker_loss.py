"""A Tinker run whose worker is killed in the middle of a sequence of operations: its futures
still resolve, and the rebuilt state is exactly the one the operations produce."""

from __future__ import annotations

import json
import os
import signal
import sqlite3
from collections.abc import Iterator
from contextlib import closing

import pytest

import tinker
from tests.fixtures.service import Service
from tests.tinker.conftest import run_service
from tests.tinker.test_sdk import BATCH, TIMEOUT_S, ClientFactory, train_step
from tinker import types

pytestmark = [pytest.mark.e2e]

STEPS = 10
SAVE_AFTER = 3


@pytest.fixture(scope="module")
def tinker_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """A service of this module's own: its worker is killed."""
    yield from run_service(request, tmp_path_factory.mktemp("tinker-killed"))


def _live_worker_pid(service: Service) -> int:
    with closing(sqlite3.connect(service.home / "skytrain.db")) as db:
        rows = db.execute(
            "select hardware from workers where status in ('ready', 'training')"
        ).fetchall()
    assert len(rows) == 1, rows
    return int(json.loads(rows[0][0])["pid"])


@pytest.mark.slow
def test_a_killed_worker_loses_nothing_and_every_future_resolves(
    tinker_client: ClientFactory, tinker_service: Service, base_model: str
) -> None:
    service_client = tinker_client("alice")

    def new_client() -> tinker.TrainingClient:
        return service_client.create_lora_training_client(
            base_model=base_model, rank=8, seed=5
        ).result(timeout=TIMEOUT_S)

    # What the operations produce, run one by one on an undisturbed worker.
    reference = new_client()
    expected = [train_step(reference) for _ in range(STEPS)]

    training = new_client()
    futures: list[tinker.APIFuture[types.ForwardBackwardOutput | types.OptimStepResponse]] = []
    for step in range(STEPS):
        futures.append(training.forward_backward(BATCH, "cross_entropy"))
        futures.append(training.optim_step(types.AdamParams(learning_rate=1e-2)))
        if step == SAVE_AFTER:
            saved = training.save_state("midway")
    saved.result(timeout=TIMEOUT_S)
    os.killpg(_live_worker_pid(tinker_service), signal.SIGKILL)  # worker and engine at once

    results = [future.result(timeout=TIMEOUT_S) for future in futures]
    losses = [
        result.metrics["loss:sum"]
        for result in results
        if isinstance(result, types.ForwardBackwardOutput)
    ]
    print(f"losses with the worker killed after step {SAVE_AFTER}: {losses}")
    assert losses == pytest.approx(expected, rel=1e-4)
    # The state after the last step is the reference's too.
    after = training.forward(BATCH, "cross_entropy").result(timeout=TIMEOUT_S)
    reference_after = reference.forward(BATCH, "cross_entropy").result(timeout=TIMEOUT_S)
    assert after.metrics["loss:sum"] == pytest.approx(reference_after.metrics["loss:sum"], rel=1e-4)

    # The run's lease went to a second worker, as a training job's would.
    model_name = training.model_id.replace(":", "-")
    with tinker_service.http("alice") as http:
        models = http.get("/v1/models", params={"project": "tinker", "limit": 100}).json()["data"]
        model = next(m for m in models if m["name"] == model_name)
        jobs = http.get("/v1/training-jobs", params={"model_id": model["id"]}).json()["data"]
    assert [(job["kind"], job["status"], job["attempts"]) for job in jobs] == [
        ("tinker", "running", 2)
    ]

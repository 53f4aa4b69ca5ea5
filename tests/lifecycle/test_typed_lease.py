"""A leased job carries its config typed by kind (``LeasedRLJob`` / ``LeasedSFTJob``), and its
JSON is what it was when the config travelled as a dict, so a worker and a control plane of
either version read each other's leases during a rolling upgrade."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from sqlalchemy.orm import Session, sessionmaker

from skytrain_backend.db.models import TrainingJob
from skytrain_backend.protocol import (
    JobLease,
    LeasedRLJob,
    LeasedSFTJob,
    RLTrainConfig,
    SFTTrainConfig,
)
from tests.api.support import group, sft_trajectory
from tests.fixtures.services import ServedPlane
from tests.lifecycle.conftest import Who, WorkerClient


def _stored_config(db: sessionmaker[Session], job_id: str) -> dict[str, Any]:
    with db() as session:
        return dict(session.get_one(TrainingJob, job_id).config)


def test_a_leased_job_carries_its_config_typed_by_kind_in_the_old_json_shape(
    who: Callable[[], Who],
    worker_client: Callable[..., WorkerClient],
    lifecycle_plane: ServedPlane,
) -> None:
    alice = who()
    rl_model, sft_model = (str(alice.create_model()["id"]) for _ in range(2))
    rl_job = alice.http.post(
        "/v1/training-jobs",
        json={
            "model_id": rl_model,
            "trajectory_groups": [group(1.0, 0.0)],
            "config": {"learning_rate": 1e-5, "loss_fn": "cispo", "num_gradient_steps": 1},
        },
    ).json()["id"]
    sft_job = alice.http.post(
        "/v1/sft-training-jobs",
        json={
            "model_id": sft_model,
            "trajectories": [sft_trajectory("4")],
            "config": {"learning_rate": [1e-4, 5e-5], "batch_size": 1},
        },
    ).json()["id"]
    worker = worker_client(rl_model, sft_model)

    leases = [worker.http.post("/jobs/lease", json={}) for _ in range(2)]
    assert [lease.status_code for lease in leases] == [200, 200]
    by_id = {lease.json()["job"]["id"]: lease.json() for lease in leases}
    assert set(by_id) == {rl_job, sft_job}

    for job_id in (rl_job, sft_job):
        # What an older control plane sent (the row's config as stored): an older worker reads
        # the same JSON from this one.
        stored = _stored_config(lifecycle_plane.sessions, job_id)
        assert by_id[job_id]["job"]["config"] == stored

    rl = JobLease.model_validate(by_id[rl_job]).job
    assert isinstance(rl, LeasedRLJob) and isinstance(rl.config, RLTrainConfig)
    assert (rl.config.learning_rate, rl.config.loss_fn) == (1e-5, "cispo")
    sft = JobLease.model_validate(by_id[sft_job]).job
    assert isinstance(sft, LeasedSFTJob) and isinstance(sft.config, SFTTrainConfig)
    assert (sft.config.learning_rate, sft.config.batch_size) == ([1e-4, 5e-5], 1)


def test_a_worker_reads_an_older_control_planes_lease() -> None:
    """An older control plane sent the stored dict as it was, a key retired since included."""
    old_answer = {
        "job": {
            "id": "job-1",
            "kind": "rl",
            "model_id": "m",
            "base_model": "tiny",
            "config": {"learning_rate": 2e-6, "grad_accumulation_sequences": None},
            "model_config": {},
            "base_step": 0,
            "step": 1,
            "attempt": 1,
        }
    }
    job = JobLease.model_validate(old_answer).job
    assert isinstance(job, LeasedRLJob) and job.config.learning_rate == 2e-6
    assert job.steps_done == 0 and job.request_id is None

"""The SDK against the real control plane over HTTP (no worker yet: jobs stay queued, and
``register`` does not wait for serving, which no worker would ever provide here).

These check that what the SDK sends is what the server accepts and that the SDK reads the
server's answers right: registration, logs merged into checkpoint metrics, errors with the
server's messages, and a training job followed through its events. Where a worker would
report a job's events, the test writes them through the control plane's own job store,
as the worker's commit path does; the SDK reads them over HTTP like any other.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from sqlalchemy.orm import Session, sessionmaker

import skytrain
from skytrain_backend.db import jobs
from skytrain_backend.protocol import EventType
from tests.client.test_trajectories import make_choice
from tests.fixtures.services import ApiKey, ControlPlane

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def backend_for(control_plane: ControlPlane, key: ApiKey) -> skytrain.Backend:
    return skytrain.Backend(control_plane.url, key.key, timeout=30.0)


def sampled_group(*rewards: float) -> skytrain.TrajectoryGroup:
    return skytrain.TrajectoryGroup(
        skytrain.Trajectory(
            messages_and_choices=[{"role": "user", "content": "2+2?"}, make_choice("4")],
            reward=reward,
            metrics={"correct": reward > 0.5},
        )
        for reward in rewards
    )


Registered = tuple[skytrain.Backend, skytrain.TrainableModel]


@pytest_asyncio.fixture(loop_scope="function")
async def registered(
    control_plane: ControlPlane, api_key: Callable[..., ApiKey]
) -> AsyncIterator[Registered]:
    """A new tenant's backend and a model registered through it (no worker serves it)."""
    async with backend_for(control_plane, api_key()) as backend:
        model = skytrain.TrainableModel(name="agent", project="sdk", base_model=BASE_MODEL)
        await model.register(backend, wait=False)
        yield backend, model


async def test_register_is_idempotent_and_adopts_the_tenant_as_entity(
    control_plane: ControlPlane, api_key: Callable[..., ApiKey]
) -> None:
    key = api_key()
    async with backend_for(control_plane, key) as backend:
        model = skytrain.TrainableModel(
            name="agent",
            project="sdk",
            base_model=BASE_MODEL,
            config=skytrain.ModelConfig(lora_rank=4),
        )
        await model.register(backend, wait=False)
        again = skytrain.TrainableModel(name="agent", project="sdk", base_model=BASE_MODEL)
        await again.register(backend, wait=False)

        assert model.id is not None and again.id == model.id
        assert model.entity == key.tenant_name
        assert model.get_inference_name(step=2) == f"{key.tenant_name}/sdk/agent:step2"
        assert await model.get_step() == 0
        checkpoints = await model.list_checkpoints()
        assert [c.step for c in checkpoints] == [0]
        assert await model.delete_checkpoints() == []
        with pytest.raises(ValueError, match="step 0 is the base model"):
            await model.pull_checkpoint(0, Path("unused"))


async def test_logged_metrics_reach_the_checkpoint_the_best_is_chosen_by(
    registered: Registered,
) -> None:
    model = registered[1]
    await model.log([sampled_group(1.0, 0.0), sampled_group(1.0, 1.0)], split="val")
    (step0,) = await model.list_checkpoints()
    assert step0.metrics["val/reward"] == pytest.approx(0.75)
    assert step0.metrics["val/correct"] == pytest.approx(0.75)


async def test_server_errors_arrive_as_typed_errors_with_the_servers_message(
    control_plane: ControlPlane,
    registered: Registered,
) -> None:
    async with skytrain.Backend(control_plane.url, "sk-st-not-a-key", timeout=30.0) as stranger:
        model = skytrain.TrainableModel(name="agent", project="sdk", base_model=BASE_MODEL)
        with pytest.raises(skytrain.AuthenticationError) as denied:
            await model.register(stranger)
        assert denied.value.status_code == 401

    model = registered[1]
    unsampled = skytrain.TrajectoryGroup(
        [
            skytrain.Trajectory(
                messages_and_choices=[
                    {"role": "user", "content": "2+2?"},
                    {"role": "assistant", "content": "4"},
                ],
                reward=1.0,
            )
        ]
    )
    with pytest.raises(skytrain.InvalidRequestError, match="allow_training_without_logprobs"):
        await model.train([unsampled], progress=False)
    with pytest.raises(skytrain.NotFoundError, match="step 5"):
        await model.pull_checkpoint(5, Path("unused"))


async def test_train_follows_the_jobs_events_to_its_result(
    db_sessions: sessionmaker[Session],
    registered: Registered,
) -> None:
    backend, model = registered
    training = asyncio.create_task(
        model.train(
            [sampled_group(1.0, 0.0)],
            config=skytrain.TrainConfig(learning_rate=1e-5),
            poll_interval=0.05,
            timeout=120,
            progress=False,
        )
    )
    job_id = await _queued_job(backend, model, training)
    events: list[tuple[EventType, dict[str, Any]]] = [
        ("training_started", {"num_sequences": 2, "num_gradient_steps": 2}),
        ("gradient_step", {"loss/policy": 0.5}),
        ("gradient_step", {"loss/policy": 0.25}),
        ("training_ended", {"step": 1}),
    ]
    with db_sessions() as session:
        for kind, data in events:
            jobs.add_event(session, job_id=job_id, type=kind, data=data)
        session.commit()
    result = await training
    assert result == skytrain.TrainResult(
        step=1,
        metrics={"loss/policy": 0.375, "train/reward": 0.5, "train/num_trajectories": 2.0},
    )


async def test_a_job_cancelled_on_the_server_fails_the_train_call(registered: Registered) -> None:
    backend, model = registered
    training = asyncio.create_task(
        model.train([sampled_group(1.0, 0.0)], poll_interval=0.05, timeout=120, progress=False)
    )
    job_id = await _queued_job(backend, model, training)
    await backend._post(f"/v1/training-jobs/{job_id}/cancel", json=None)
    with pytest.raises(skytrain.TrainingFailedError) as failed:
        await training
    assert failed.value.job_id == job_id
    assert "cancel" in failed.value.error_message


async def _queued_job(
    backend: skytrain.Backend, model: skytrain.TrainableModel, training: asyncio.Task[object]
) -> str:
    """The id of the model's job once the SDK has created it."""
    while True:
        if training.done():
            training.result()  # raises what stopped the train call before its job existed
            pytest.fail("train() returned before its job existed")
        page = await backend._get("/v1/training-jobs", params={"model_id": model.id})
        if page["data"]:
            return str(page["data"][0]["id"])
        await asyncio.sleep(0.05)


async def test_set_replicas_changes_the_models_bounds_and_refuses_more_than_its_quota(
    registered: Registered,
) -> None:
    model = registered[1]
    answer = await model.set_replicas(max_replicas=2)
    assert (answer["config"]["min_replicas"], answer["config"]["max_replicas"]) == (1, 2)
    with pytest.raises(skytrain.InvalidRequestError, match="max_workers"):
        await model.set_replicas(max_replicas=64)
    with pytest.raises(skytrain.InvalidRequestError, match="min_replicas"):
        await model.set_replicas(min_replicas=3)
    # Nothing of the refused calls was stored.
    answer = await model.set_replicas()
    assert (answer["config"]["min_replicas"], answer["config"]["max_replicas"]) == (1, 2)

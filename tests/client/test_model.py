"""TrainableModel and Model against the real control plane, through a fault proxy.

There is no worker: where one would act, the test does what the worker's side does (joins
and heartbeats over HTTP, writes a job's events through the job store, commits checkpoint
files to the real object store), see ``server_side.py``. The SDK's requests are the ones a
user's would be; the proxy records them and, where a test says so, injects a fault.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
import pytest_asyncio
from sqlalchemy.orm import Session, sessionmaker

import skytrain
from skytrain import _backend
from skytrain_backend.db import workers
from skytrain_backend.storage import ObjectStore
from tests.client.faults import Before, FaultProxy, RewriteJson, Truncate, eventually
from tests.client.server_side import (
    JoinedWorker,
    add_events,
    commit_checkpoint,
    end_job_silently,
    sampled_group,
    stored_files,
)
from tests.fixtures.services import ApiKey, ControlPlane

BASE_MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"


def trajectory(reward: float) -> skytrain.Trajectory:
    return skytrain.Trajectory(
        messages_and_choices=[
            {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "yo"},
        ],
        reward=reward,
    )


def group(*rewards: float) -> skytrain.TrajectoryGroup:
    return skytrain.TrajectoryGroup([trajectory(r) for r in rewards])


def listing(directory: Path) -> dict[str, bytes | None]:
    """File names with their bytes (None for a directory)."""
    return {p.name: None if p.is_dir() else p.read_bytes() for p in directory.iterdir()}


def terminal_lines(err: str) -> list[str]:
    """What a terminal shows over time: tqdm rewrites its line with carriage returns."""
    return [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]


def unique_base_model() -> str:
    """A base model no other test's worker serves, so placements do not mix."""
    return f"test-org/base-{uuid.uuid4().hex[:8]}"


@pytest_asyncio.fixture(loop_scope="function")
async def model(backend: skytrain.Backend) -> AsyncIterator[skytrain.TrainableModel]:
    """A model registered with the real control plane (no worker serves it)."""
    model = skytrain.TrainableModel(name="agent", project="demo", base_model=BASE_MODEL)
    await model.register(backend, wait=False)
    yield model


# --- registration ---------------------------------------------------------------------------


async def test_register_sends_the_model_and_adopts_the_servers_names(
    proxy: FaultProxy, key: ApiKey, backend: skytrain.Backend
) -> None:
    model = skytrain.TrainableModel(
        name="agent",
        project="demo",
        base_model=BASE_MODEL,
        config=skytrain.ModelConfig(lora_rank=16, max_seq_length=2048),
    )
    await model.register(backend, wait=False)

    (request,) = proxy.seen("POST", "^/v1/models$")
    assert request.json() == {
        "project": "demo",
        "name": "agent",
        "base_model": BASE_MODEL,
        "config": {"lora_rank": 16, "max_seq_length": 2048},
        "return_existing": True,
    }
    stored = await backend._get(f"/v1/models/{model.id}")
    assert stored["config"]["lora_rank"] == 16
    assert stored["config"]["max_seq_length"] == 2048
    assert model.id == stored["id"]
    assert model.entity == key.tenant_name
    assert model.get_inference_name() == f"{key.tenant_name}/demo/agent"
    assert model.get_inference_name(step=3) == f"{key.tenant_name}/demo/agent:step3"
    client = model.openai_client()
    assert str(client.base_url) == f"{proxy.url}/v1/"
    assert client.api_key == key.key
    assert model.openai_client() is client


async def test_register_sends_an_explicit_entity(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    model = skytrain.TrainableModel(name="agent", project="demo", base_model="m", entity="team")
    await model.register(backend, wait=False)
    assert proxy.seen("POST", "^/v1/models$")[0].json()["entity"] == "team"
    assert model.entity == "team"
    assert model.get_inference_name() == "team/demo/agent"


async def test_register_waits_until_served_showing_each_status(
    control_plane: ControlPlane,
    proxy: FaultProxy,
    key: ApiKey,
    backend: skytrain.Backend,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No worker, then one starting, loading the model's latest step, and serving it: the
    status line shows each state the real scheduler reports, and register() returns once the
    model is served."""
    base = unique_base_model()
    name = f"{key.tenant_name}/demo/agent"
    model = skytrain.TrainableModel(name="agent", project="demo", base_model=base)
    registering = asyncio.create_task(model.register(backend, poll_interval=0.01))
    err = ""

    async def shows(status: str) -> None:
        async def shown() -> bool:
            nonlocal err
            if registering.done():
                registering.result()  # raises what ended the wait early
            err += capsys.readouterr().err
            return any(line.startswith(f"serving {name}: {status}") for line in terminal_lines(err))

        await eventually(shown, f"register() to show {status!r}")

    waiting = f"waiting for a worker for {base} to be placed on"
    await shows(waiting)
    assert model.id is not None
    commit_checkpoint(db_sessions, object_store, key=key, model_id=model.id, step=1)
    worker = JoinedWorker(db_sessions, control_plane_url=control_plane.url, base_model=base)
    try:
        starting = f"worker {worker.id} is starting its engine for {base}"
        await shows(starting)
        worker.register()
        loading = f"worker {worker.id} is loading step 1 of {name}"
        await shows(loading)
        worker.heartbeat(served=[(model.id, 1)])
        await registering
    finally:
        worker.close()

    err += capsys.readouterr().err
    statuses = [
        line.removeprefix(f"serving {name}: ").rpartition(" [")[0]
        for line in terminal_lines(err)
        if line.startswith(f"serving {name}: ")
    ]
    shown = [s for i, s in enumerate(statuses) if i == 0 or statuses[i - 1] != s]
    # Between "no worker" and "placed on it" the scheduler may report the worker launching,
    # and, once the worker is ready, the model being placed on it.
    launching = f"starting a worker for {base} (manual): launching"
    placing = f"placing {name} on worker {worker.id}, which loads it in a few seconds"
    assert [s for s in shown if s not in (launching, placing)] == [
        waiting,
        starting,
        loading,
        "ready",
    ]
    polls = len(proxy.seen("GET", f"^/v1/models/{model.id}$"))

    # Registering a served model again returns at once.
    await model.register(backend)
    assert len(proxy.seen("GET", f"^/v1/models/{model.id}$")) == polls


async def test_register_raises_the_servers_reason_when_serving_fails(
    backend: skytrain.Backend, db_sessions: sessionmaker[Session]
) -> None:
    base = unique_base_model()
    # What the scheduler records when the provider could not launch a worker.
    with db_sessions() as session:
        row, _ = workers.create_worker(
            session, provider="skypilot", base_model=base, max_models=1, status="failed"
        )
        row.status_message = "sky launch failed: no GPU quota in us-east-1"
        session.commit()
    model = skytrain.TrainableModel(name="agent", project="demo", base_model=base)
    with pytest.raises(skytrain.ServingFailedError) as caught:
        await model.register(backend, progress=False)
    message = str(caught.value)
    assert message.startswith(
        f"model {model.get_inference_name()} cannot be served: the last worker for base model "
        f"{base!r} failed to start"
    )
    assert f"`skytrain logs {row.id}`" in message
    # What the provider said is the operator's to read, not the tenant's.
    assert "quota" not in message


async def test_register_gives_up_after_its_timeout(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    base = unique_base_model()
    model = skytrain.TrainableModel(name="agent", project="demo", base_model=base)
    with pytest.raises(
        skytrain.WaitTimeoutError,
        match=f"last status: waiting for a worker for {base} to be placed on",
    ) as caught:
        await model.register(backend, timeout=0.0, poll_interval=0, progress=False)
    assert isinstance(caught.value, TimeoutError)
    assert model.id is not None  # registered; only the wait ended
    assert (await backend._get(f"/v1/models/{model.id}"))["serving"]["state"] == "waiting"


async def test_register_does_not_wait_when_told(
    proxy: FaultProxy, backend: skytrain.Backend
) -> None:
    model = skytrain.TrainableModel(name="agent", project="demo", base_model=unique_base_model())
    await model.register(backend, wait=False)
    assert model.id is not None
    assert [s.method for s in proxy.seen()] == ["POST"]  # no polling


async def test_a_model_must_be_registered_before_it_trains() -> None:
    model = skytrain.TrainableModel(name="agent", project="demo", base_model="m")
    with pytest.raises(skytrain.NotRegisteredError, match=r"await model.register\(backend\)"):
        await model.train([group(1.0)])
    with pytest.raises(skytrain.NotRegisteredError):
        model.get_inference_name()
    with pytest.raises(skytrain.NotRegisteredError):
        model.openai_client()
    named = skytrain.TrainableModel(name="agent", project="demo", base_model="m", entity="acme")
    assert named.get_inference_name(step=2) == "acme/demo/agent:step2"


def test_prompted_model_points_anywhere() -> None:
    model = skytrain.Model(
        name="gpt-baseline",
        project="demo",
        inference_model_name="gpt-4o-mini",
        inference_base_url="https://api.example.com/v1",
        inference_api_key="sk-other",
    )
    client = model.openai_client()
    assert str(client.base_url) == "https://api.example.com/v1/"
    assert client.api_key == "sk-other"
    assert model.get_inference_name() == "gpt-4o-mini"
    assert "sk-other" not in repr(model)
    assert "inference_api_key" not in model.model_dump()
    with pytest.raises(ValueError, match="no steps"):
        model.get_inference_name(step=1)
    with pytest.raises(skytrain.ConfigurationError, match="inference_base_url"):
        skytrain.Model(name="x", project="demo").openai_client()


# --- training -------------------------------------------------------------------------------


async def created_job(proxy: FaultProxy, backend: skytrain.Backend, task: asyncio.Task[Any]) -> str:
    """The id of the job the SDK's train call created, once the server has it."""
    job_ids: list[str] = []

    async def created() -> bool:
        if task.done():
            task.result()  # raises what stopped the train call before its job existed
            pytest.fail("train() returned before its job existed")
        page = await backend._get("/v1/training-jobs")
        job_ids[:] = [job["id"] for job in page["data"]]
        return bool(job_ids)

    await eventually(created, "the training job to be created")
    (job_id,) = job_ids
    return job_id


StartTraining = Callable[..., Awaitable[tuple["asyncio.Task[skytrain.TrainResult]", str]]]


@pytest.fixture
def start_training(
    proxy: FaultProxy, backend: skytrain.Backend, model: skytrain.TrainableModel
) -> StartTraining:
    """``await start_training(**options)``: ``model.train`` on one sampled group running in a
    task (polling every 10 ms, no progress bar unless ``progress=True``), and the id of its
    job once the server has it."""

    async def start(**options: Any) -> tuple[asyncio.Task[skytrain.TrainResult], str]:
        options = {"poll_interval": 0.01, "progress": False} | options
        training = asyncio.create_task(model.train([sampled_group(0.0, 1.0)], **options))
        return training, await created_job(proxy, backend, training)

    return start


def cursors(proxy: FaultProxy, job_id: str) -> list[str | None]:
    """The ``after`` cursors the SDK read the job's events from, each once, in order."""
    seen = [s.query.get("after") for s in proxy.seen("GET", f"^/v1/training-jobs/{job_id}/events$")]
    return [c for i, c in enumerate(seen) if i == 0 or seen[i - 1] != c]


async def test_train_warns_when_the_job_says_the_trainer_is_far_from_the_sampler(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
) -> None:
    training, job_id = await start_training()
    warning = "the trainer's logprobs of the sampled tokens differ from the sampler's by 0.5"
    started = {"num_sequences": 1, "num_gradient_steps": 1, "attempt": 1, "warning": warning}
    with pytest.warns(RuntimeWarning, match=f"training job {job_id}: the trainer's logprobs"):
        add_events(db_sessions, job_id, ("training_started", started))
        add_events(db_sessions, job_id, ("training_ended", {"step": 1}))
        assert (await training).step == 1


async def test_train_posts_groups_and_follows_events_to_the_result(
    proxy: FaultProxy,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The worker reports one event at a time; each is read from the cursor of the last."""
    groups = [sampled_group(0.0, 1.0), sampled_group(0.5, 0.25)]
    training = asyncio.create_task(
        model.train(groups, config=skytrain.TrainConfig(learning_rate=1e-5), poll_interval=0.01)
    )
    job_id = await created_job(proxy, backend, training)
    events: list[tuple[Any, dict[str, Any]]] = [
        ("training_started", {"num_sequences": 2, "num_gradient_steps": 2, "attempt": 1}),
        ("gradient_step", {"loss/policy": 0.5, "grad_norm": 1.0, "step": 0}),
        ("gradient_step", {"loss/policy": 0.25, "grad_norm": 3.0, "step": 1}),
        ("training_ended", {"step": 1, "groups/skipped_zero_variance": 0}),
    ]
    ids: list[str | None] = [None]
    for event in events:
        # Once the SDK reads from the last event on, the worker reports the next one.
        await eventually(
            lambda: cursors(proxy, job_id)[-1:] == ids[-1:], f"a read after event {ids[-1]}"
        )
        ids.extend(add_events(db_sessions, job_id, event))
    result = await training

    assert result == skytrain.TrainResult(
        step=1,
        metrics={
            "train/reward": (0.0 + 1.0 + 0.5 + 0.25) / 4,  # what was trained on
            "train/num_trajectories": 4.0,
            "loss/policy": 0.375,
            "grad_norm": 2.0,
            "groups/skipped_zero_variance": 0.0,
        },
    )
    (sent,) = proxy.seen("POST", "^/v1/training-jobs$")
    assert sent.json() == {
        "model_id": model.id,
        "trajectory_groups": [g.model_dump(mode="json") for g in groups],
        "config": {"learning_rate": 1e-5},
    }
    job = await backend._get(f"/v1/training-jobs/{job_id}")
    assert (job["num_groups"], job["num_trajectories"]) == (2, 4)
    assert job["config"]["learning_rate"] == 1e-5
    assert cursors(proxy, job_id) == ids[:-1]
    final = terminal_lines(capsys.readouterr().err)[-1]
    assert final.startswith("train: 100%")
    assert "2/2" in final
    assert "loss/policy=0.25" in final
    assert "grad_norm=3" in final


async def test_train_shows_why_its_job_waits(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """No worker serves the model's base model: the bar says so while the job is queued,
    then counts steps once it starts."""
    training, job_id = await start_training(progress=True)
    shown: list[str] = []

    async def waiting_shown() -> bool:
        shown.extend(terminal_lines(capsys.readouterr().err))
        return any(f"waiting for a worker for {BASE_MODEL}" in line for line in shown)

    await eventually(waiting_shown, "the reason the job waits, on the progress bar")
    assert shown[-1].startswith("train: waiting for a worker")
    add_events(db_sessions, job_id, ("training_started", {"num_gradient_steps": 1}))
    add_events(db_sessions, job_id, ("training_ended", {"step": 1}))
    assert (await training).step == 1
    final = terminal_lines(capsys.readouterr().err)[-1]
    assert final.startswith("train: ") and "waiting" not in final


async def test_training_failure_raises_with_the_job_and_the_servers_message(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
) -> None:
    training, job_id = await start_training()
    add_events(
        db_sessions,
        job_id,
        ("training_started", {"num_sequences": 1, "num_gradient_steps": 1, "attempt": 1}),
        ("training_failed", {"error_message": "CUDA out of memory at sequence 3"}),
    )
    with pytest.raises(skytrain.TrainingFailedError) as caught:
        await training
    assert caught.value.job_id == job_id
    assert caught.value.error_message == "CUDA out of memory at sequence 3"
    assert job_id in str(caught.value)


async def test_a_retried_attempt_restarts_the_count(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
) -> None:
    training, job_id = await start_training()
    started = {"num_sequences": 2, "num_gradient_steps": 2}
    add_events(
        db_sessions,
        job_id,
        ("training_started", started | {"attempt": 1}),
        ("gradient_step", {"loss/policy": 9.0}),
        ("training_started", started | {"attempt": 2}),
        ("gradient_step", {"loss/policy": 1.0}),
        ("gradient_step", {"loss/policy": 2.0}),
        ("training_ended", {"step": 4}),
    )
    result = await training
    assert result == skytrain.TrainResult(
        step=4,
        metrics={"loss/policy": 1.5, "train/reward": 0.5, "train/num_trajectories": 2.0},
    )


async def test_a_job_that_yields_its_worker_keeps_its_steps_and_the_bar_says_why_it_waits(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
    capsys: pytest.CaptureFixture[str],
) -> None:
    """A job preempted for another tenant's job resumes from the state it saved: the steps
    before the pause count, a step an attempt trained after the resume and lost with its
    worker is trained again from the saved one, and meanwhile the bar says what it waits
    for."""
    training, job_id = await start_training(progress=True)
    resumed = {"steps_done": 2, "num_gradient_steps": 3}
    add_events(
        db_sessions,
        job_id,
        ("training_started", {"num_sequences": 3, "num_gradient_steps": 3, "attempt": 1}),
        ("gradient_step", {"loss/policy": 1.0}),
        ("gradient_step", {"loss/policy": 2.0}),
        ("training_preempted", {"steps_done": 2, "attempt": 1}),
        ("training_resumed", resumed | {"attempt": 2}),
        ("gradient_step", {"loss/policy": 9.0}),
        ("training_resumed", resumed | {"attempt": 3}),
        ("gradient_step", {"loss/policy": 3.0}),
        ("training_ended", {"step": 1}),
    )
    result = await training
    assert result.metrics["loss/policy"] == 2.0  # steps 1, 2 and 3, once each
    shown = terminal_lines(capsys.readouterr().err)
    assert any("yielded the worker to another tenant's job after step 2" in line for line in shown)
    assert shown[-1].startswith("train: 100%") and "3/3" in shown[-1]


async def test_a_job_cancelled_on_the_server_ends_the_wait(
    start_training: StartTraining,
    proxy: FaultProxy,
    db_sessions: sessionmaker[Session],
) -> None:
    """A job that ended without an event saying how (as before jobs had events) is found
    ended by its status, which the SDK checks when no event comes."""
    training, job_id = await start_training()
    end_job_silently(db_sessions, job_id, status="cancelled")
    with pytest.raises(skytrain.TrainingFailedError, match="the job was cancelled"):
        await training
    assert proxy.seen("GET", f"^/v1/training-jobs/{job_id}$")


async def test_a_job_that_succeeded_without_an_end_event_still_returns_its_step(
    start_training: StartTraining,
    db_sessions: sessionmaker[Session],
) -> None:
    training, job_id = await start_training()
    add_events(db_sessions, job_id, ("gradient_step", {"loss/policy": 0.5}))
    end_job_silently(db_sessions, job_id, status="succeeded", step=7)
    result = await training
    assert result == skytrain.TrainResult(
        step=7,
        metrics={"loss/policy": 0.5, "train/reward": 0.5, "train/num_trajectories": 2.0},
    )


async def test_train_gives_up_after_its_timeout_and_says_the_job_runs_on(
    backend: skytrain.Backend, model: skytrain.TrainableModel
) -> None:
    with pytest.raises(skytrain.WaitTimeoutError, match=r"did not finish.*keeps running") as caught:
        await model.train([sampled_group(0.0, 1.0)], timeout=0.0, poll_interval=0, progress=False)
    (job,) = (await backend._get("/v1/training-jobs", params={"model_id": model.id}))["data"]
    assert f"training job {job['id']} did not finish" in str(caught.value)
    assert job["status"] == "queued"  # the job is still there, waiting for a worker


async def test_train_refuses_groups_whose_rollouts_have_not_run(
    proxy: FaultProxy, model: skytrain.TrainableModel
) -> None:
    async def rollout() -> skytrain.Trajectory:
        return trajectory(1.0)

    pending = skytrain.TrajectoryGroup([rollout()])
    with pytest.raises(ValueError, match=r"groups\[1\] still holds rollouts"):
        await model.train([sampled_group(1.0), pending], progress=False)
    await pending  # the coroutine is consumed, not left dangling
    assert [s.path for s in proxy.seen()] == ["/v1/models"]  # the registration, nothing since


async def test_train_sft_sends_trajectories_inline_and_follows_the_job(
    proxy: FaultProxy,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
) -> None:
    trajectories = [trajectory(0.0), trajectory(1.0)]
    training = asyncio.create_task(
        model.train_sft(
            trajectories,
            config=skytrain.SFTConfig(learning_rate=2e-4, num_epochs=2),
            poll_interval=0.01,
            progress=False,
        )
    )
    job_id = await created_job(proxy, backend, training)
    add_events(
        db_sessions,
        job_id,
        ("training_started", {"num_sequences": 1, "num_gradient_steps": 1, "attempt": 1}),
        ("gradient_step", {"loss/sft": 2.5}),
        ("training_ended", {"step": 2}),
    )
    assert await training == skytrain.TrainResult(step=2, metrics={"loss/sft": 2.5})
    (sent,) = proxy.seen("POST", "^/v1/sft-training-jobs$")
    assert sent.json() == {
        "model_id": model.id,
        "trajectories": [t.model_dump(mode="json") for t in trajectories],
        "config": {"learning_rate": 2e-4, "num_epochs": 2},
    }
    job = await backend._get(f"/v1/training-jobs/{job_id}")
    assert (job["kind"], job["num_trajectories"]) == ("sft", 2)


# --- logging and steps ----------------------------------------------------------------------


async def test_log_sends_groups_with_split_and_step(
    proxy: FaultProxy,
    key: ApiKey,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    assert model.id is not None
    for step in (1, 2):
        commit_checkpoint(db_sessions, object_store, key=key, model_id=model.id, step=step)
    await model.log([group(1.0, 0.5)], split="val", step=1)
    await model.log([group(0.25)], split="train")  # at the latest step, 2

    first, second = (s.json() for s in proxy.seen("POST", f"^/v1/models/{model.id}/log$"))
    assert first == {
        "trajectory_groups": [group(1.0, 0.5).model_dump(mode="json")],
        "split": "val",
        "step": 1,
    }
    assert second == {"trajectory_groups": [group(0.25).model_dump(mode="json")], "split": "train"}
    metrics = {c.step: c.metrics for c in await model.list_checkpoints()}
    assert metrics[1]["val/reward"] == 0.75
    assert "train/reward" not in metrics[1]
    assert metrics[2]["train/reward"] == 0.25
    assert "val/reward" not in metrics[2]


async def test_get_step_reads_the_latest_step(
    key: ApiKey,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> None:
    assert model.id is not None
    assert await model.get_step() == 0
    for step in (1, 12):
        commit_checkpoint(db_sessions, object_store, key=key, model_id=model.id, step=step)
    assert await model.get_step() == 12


# --- checkpoints ----------------------------------------------------------------------------


@pytest.fixture
def checkpoints(
    key: ApiKey,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> Callable[..., None]:
    """``checkpoints({step: metrics, ...})``: commit those steps of ``model``."""

    def commit(metrics_by_step: dict[int, dict[str, float]]) -> None:
        assert model.id is not None
        for step, metrics in metrics_by_step.items():
            commit_checkpoint(
                db_sessions, object_store, key=key, model_id=model.id, step=step, metrics=metrics
            )

    return commit


async def test_list_checkpoints_reads_every_page(
    proxy: FaultProxy,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    checkpoints: Callable[..., None],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    checkpoints({s: {"loss/policy": s / 10} for s in range(1, 5)})
    monkeypatch.setattr(_backend, "_PAGE_SIZE", 2)

    listed = await model.list_checkpoints()

    assert [c.step for c in listed] == [0, 1, 2, 3, 4]
    assert listed[3].metrics == {"loss/policy": 0.3}
    assert listed[0].metrics == {}
    raw = await backend._get(f"/v1/models/{model.id}/checkpoints/3")
    assert listed[3].id == raw["id"]
    assert listed[3].created_at is not None
    assert listed[3].created_at.isoformat() == raw["created_at"].replace("Z", "+00:00")
    assert len(proxy.seen("GET", f"^/v1/models/{model.id}/checkpoints$")) == 3


async def remaining_steps(backend: skytrain.Backend, model: skytrain.TrainableModel) -> list[int]:
    page = await backend._get(f"/v1/models/{model.id}/checkpoints", params={"limit": 100})
    return [c["step"] for c in page["data"]]


async def test_delete_checkpoints_keeps_the_latest_and_the_best(
    proxy: FaultProxy,
    key: ApiKey,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    checkpoints: Callable[..., None],
    object_store: ObjectStore,
) -> None:
    assert model.id is not None
    val_rewards = {1: 0.1, 2: 0.9, 3: 0.3, 4: 0.2, 5: 0.4}
    checkpoints({s: {"val/reward": r, "train/reward": 1.0} for s, r in val_rewards.items()})

    deleted = await model.delete_checkpoints(best_checkpoint_metric="val/reward")

    assert deleted == [1, 3, 4]
    (request,) = proxy.seen("DELETE", f"^/v1/models/{model.id}/checkpoints$")
    assert request.json() == {"steps": [1, 3, 4]}
    assert await remaining_steps(backend, model) == [0, 2, 5]
    for step in (1, 3, 4):
        assert stored_files(object_store, key=key, model_id=model.id, step=step) == []
    for step in (2, 5):
        assert stored_files(object_store, key=key, model_id=model.id, step=step) == [
            "adapter_config.json"
        ]


async def test_delete_checkpoints_reports_only_what_it_deleted(
    control_plane: ControlPlane,
    proxy: FaultProxy,
    key: ApiKey,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    checkpoints: Callable[..., None],
) -> None:
    """Another client deletes step 2 between the SDK's listing and its delete."""
    checkpoints({s: {"accuracy": s / 10} for s in (1, 2, 3)})

    def other_client_deletes_step_2() -> None:
        httpx.request(
            "DELETE",
            f"{control_plane.url}/v1/models/{model.id}/checkpoints",
            json={"steps": [2]},
            headers={"Authorization": f"Bearer {key.key}"},
        ).raise_for_status()

    proxy.fault("DELETE", "/checkpoints$", Before(other_client_deletes_step_2), times=1)
    assert await model.delete_checkpoints(best_checkpoint_metric="accuracy") == [1]
    (request,) = proxy.seen("DELETE", f"^/v1/models/{model.id}/checkpoints$")
    assert request.json() == {"steps": [1, 2]}
    assert await remaining_steps(backend, model) == [0, 3]


async def test_delete_checkpoints_ignores_steps_without_the_metric_when_ranking(
    backend: skytrain.Backend, model: skytrain.TrainableModel, checkpoints: Callable[..., None]
) -> None:
    """Steps never evaluated cannot be the best, but are deleted unless they are the latest."""
    checkpoints({1: {"val/reward": 0.5}, 2: {}, 3: {"val/reward": 0.2}, 4: {}})
    assert await model.delete_checkpoints() == [2, 3]
    assert await remaining_steps(backend, model) == [0, 1, 4]


async def test_delete_checkpoints_without_the_metric_deletes_nothing(
    proxy: FaultProxy,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    checkpoints: Callable[..., None],
) -> None:
    checkpoints({s: {"loss/policy": 1.0} for s in (1, 2)})
    with pytest.raises(ValueError, match=r"no checkpoint .* has metric 'val/reward'.*loss/policy"):
        await model.delete_checkpoints()
    assert proxy.seen("DELETE") == []
    assert await remaining_steps(backend, model) == [0, 1, 2]


async def test_delete_checkpoints_with_one_trained_step_has_nothing_to_do(
    proxy: FaultProxy,
    backend: skytrain.Backend,
    model: skytrain.TrainableModel,
    checkpoints: Callable[..., None],
) -> None:
    checkpoints({1: {"val/reward": 1.0}})
    assert await model.delete_checkpoints() == []
    assert proxy.seen("DELETE") == []
    assert await remaining_steps(backend, model) == [0, 1]


FILES = {
    "adapter_config.json": b'{"r": 8}',
    "adapter_model.safetensors": b"\x00\x01weights" * 1000,
}


@pytest.fixture
def trained_step(
    key: ApiKey,
    model: skytrain.TrainableModel,
    db_sessions: sessionmaker[Session],
    object_store: ObjectStore,
) -> int:
    """Step 3 of ``model``, its files ``FILES`` in the real object store."""
    assert model.id is not None
    commit_checkpoint(db_sessions, object_store, key=key, model_id=model.id, step=3, files=FILES)
    return 3


@pytest.fixture
def store_proxy(control_plane: ControlPlane, proxy: FaultProxy) -> Iterator[FaultProxy | None]:
    """On S3, a fault proxy in front of the object store, which the control plane's presigned
    redirects are sent through; None where the control plane serves the bytes itself."""
    endpoint = control_plane.settings.storage.s3_endpoint_url
    if not control_plane.settings.storage.resolved_object_store_url.startswith("s3://"):
        yield None
        return
    assert endpoint is not None
    with FaultProxy(endpoint) as store:
        proxy.location_map[endpoint] = store.url
        yield store


async def test_pull_checkpoint_downloads_every_file_following_presigned_redirects(
    proxy: FaultProxy,
    key: ApiKey,
    model: skytrain.TrainableModel,
    trained_step: int,
    store_proxy: FaultProxy | None,
    tmp_path: Path,
) -> None:
    target = tmp_path / "ckpt" / "step3"
    path = await model.pull_checkpoint(trained_step, target)
    assert path == target
    assert listing(target) == FILES
    assert listing(tmp_path / "ckpt") == {"step3": None}  # no staging directory left
    if store_proxy is None:  # a local store: the control plane streams the bytes itself
        assert len(proxy.seen("GET", f"/checkpoints/{trained_step}/files/")) == len(FILES)
    else:  # S3: every file comes from a presigned URL, which never gets the API key
        fetched = store_proxy.seen("GET")
        assert sorted(s.path.rpartition("/")[2] for s in fetched) == sorted(FILES)
        for request in fetched:
            assert {"Signature", "X-Amz-Signature"} & request.query.keys()  # presigned
            assert "authorization" not in request.headers
            assert key.key not in str(request.headers)


async def test_a_cut_short_download_leaves_the_target_untouched(
    proxy: FaultProxy,
    model: skytrain.TrainableModel,
    trained_step: int,
    store_proxy: FaultProxy | None,
    tmp_path: Path,
) -> None:
    """The big file's bytes stop early, with nothing at the HTTP level saying so."""
    carrier = store_proxy or proxy  # whoever passes the file's bytes on
    carrier.fault("GET", "adapter_model.safetensors$", Truncate(keep_bytes=1000))
    target = tmp_path / "step3"
    target.mkdir()
    (target / "adapter_config.json").write_bytes(b"old")
    with pytest.raises(skytrain.APIConnectionError, match="received 1000 bytes of 9000"):
        await model.pull_checkpoint(trained_step, target)
    assert listing(tmp_path) == {"step3": None}
    assert listing(target) == {"adapter_config.json": b"old"}
    cut = carrier.seen("GET", "adapter_model.safetensors$")
    assert len(cut) == 4  # retried: a GET is safe to repeat
    assert all(isinstance(s.fault, Truncate) for s in cut)


async def test_pull_checkpoint_refuses_file_names_that_escape_the_directory(
    proxy: FaultProxy, model: skytrain.TrainableModel, trained_step: int, tmp_path: Path
) -> None:
    """A server (or something posing as one) listing a file outside the directory."""

    def climb(listing: dict[str, Any]) -> dict[str, Any]:
        return {"data": [*listing["data"], {"name": "../evil", "size": 1}]}

    proxy.fault("GET", f"/checkpoints/{trained_step}/files$", RewriteJson(climb))
    with pytest.raises(ValueError, match=r"'\.\./evil', which is not a plain file name"):
        await model.pull_checkpoint(trained_step, tmp_path / "step3")
    assert listing(tmp_path) == {}
    assert proxy.seen("GET", "/files/") == []  # nothing was downloaded


async def test_pull_checkpoint_of_the_base_step_says_it_has_no_files(
    model: skytrain.TrainableModel, tmp_path: Path
) -> None:
    with pytest.raises(ValueError, match=f"step 0 is the base model itself \\({BASE_MODEL}\\)"):
        await model.pull_checkpoint(0, tmp_path / "step0")
    assert listing(tmp_path) == {}


async def test_pull_checkpoint_of_an_unknown_step_is_not_found(
    model: skytrain.TrainableModel, tmp_path: Path
) -> None:
    with pytest.raises(skytrain.NotFoundError, match="has no checkpoint at step 9"):
        await model.pull_checkpoint(9, tmp_path / "step9")
    assert listing(tmp_path) == {}

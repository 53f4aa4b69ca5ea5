"""Every SDK call end to end: a real ``skytrain serve`` (PostgreSQL + S3 through a SeaweedFS
server, the production setup) whose local provider starts a real worker (CPU engine + GRPO
trainer) serving the tiny random model. Rollouts are sampled through the model's endpoint, so
trajectories hold the real ``Choice`` objects with their token ids.

One service serves the whole module; each test registers its own model. The same service
also answers ART's ``ServerlessBackend`` protocol under ``/v1/preview``, checked at the end.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
import sys
from collections.abc import AsyncIterator, Iterable, Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from openai.pagination import AsyncCursorPage
from openai.types.chat.chat_completion import Choice

import skytrain
from tests.fixtures.art import (
    ArtCheckpoint,
    ArtDeleted,
    ArtEvent,
    ArtJob,
    ArtModel,
    art_train_request,
)
from tests.fixtures.rollouts import PROMPTS, letter_share, rollout, sample_groups
from tests.fixtures.service import (
    Service,
    logs_printed_on_failure,
    start_service,
    stop_service,
)

pytestmark = [pytest.mark.e2e, pytest.mark.postgres, pytest.mark.s3]

PROJECT = "sdk-e2e"
TENANT = "sdk"
# The tiny random model needs a push for a single step to change its outputs visibly.
TRAIN = skytrain.TrainConfig(learning_rate=5e-3)
WAIT_S = 300.0  # register() and train() on two shared CPU cores


@pytest.fixture(scope="module")
def sdk_service(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Service]:
    """``skytrain serve`` on PostgreSQL + S3 (SeaweedFS), with the local provider.

    Leases get lengths that survive a worker loading the trainer on two busy cores; the
    e2e suite's short ones are for noticing killed workers, which these tests do not do. One
    worker holds every model the tests register (all of one tenant: its placement quota is
    raised to match), so none waits for a second to start.
    """
    overrides = {
        "SKYTRAIN_DATABASE_URL": request.getfixturevalue("make_postgres_url")(),
        "SKYTRAIN_OBJECT_STORE_URL": request.getfixturevalue("make_bucket")(),
        "SKYTRAIN_S3_ENDPOINT_URL": request.getfixturevalue("s3_endpoint"),
        "SKYTRAIN_JOB_LEASE_S": "60",
        "SKYTRAIN_WORKER_HEARTBEAT_TIMEOUT_S": "45",
        "SKYTRAIN_WORKER_MAX_MODELS": "16",
        "SKYTRAIN_TENANT_MAX_PLACED_MODELS": "16",
    }
    subprocess.run(
        [sys.executable, "-m", "skytrain_backend", "db", "upgrade"],
        env={**os.environ, **overrides},
        check=True,
        capture_output=True,
    )
    service = start_service(overrides, tmp_path_factory.mktemp("sdk-e2e") / "home")
    yield service
    stop_service(service)


@pytest.fixture(autouse=True)
def logs_on_failure(request: pytest.FixtureRequest, sdk_service: Service) -> Iterator[None]:
    with logs_printed_on_failure(request, sdk_service):
        yield


@pytest.fixture(autouse=True)
def no_retry_wait() -> None:
    """Unlike the unit tests, these keep the SDK's real retry backoff."""


@pytest.fixture
def sdk_key(sdk_service: Service) -> str:
    """An API key of the tenant every test here works in."""
    return sdk_service.key(TENANT)


@pytest_asyncio.fixture(loop_scope="function")  # the test's loop owns the connections
async def backend(sdk_service: Service, sdk_key: str) -> AsyncIterator[skytrain.Backend]:
    async with skytrain.Backend(sdk_service.url, sdk_key, timeout=60.0) as backend:
        yield backend


async def registered(
    backend: skytrain.Backend, name: str, base_model: Path
) -> skytrain.TrainableModel:
    model = skytrain.TrainableModel(name=name, project=PROJECT, base_model=str(base_model))
    await model.register(backend, timeout=WAIT_S, poll_interval=0.5, progress=False)
    return model


# --- rollouts and rewards ---------------------------------------------------------------------


async def greedy_logprobs(model: skytrain.Model, *, step: int | None = None) -> list[float]:
    """The logprobs of a greedy answer: they tell two checkpoints apart even when text agrees."""
    completion = await model.openai_client().chat.completions.create(
        model=model.get_inference_name(step),
        messages=[{"role": "user", "content": "Name a fruit."}],
        max_tokens=8,
        temperature=0.0,
        logprobs=True,
    )
    content = completion.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content
    return [entry.logprob for entry in content]


def same_policy(a: list[float], b: list[float]) -> bool:
    return len(a) == len(b) and all(abs(x - y) <= 1e-3 for x, y in zip(a, b, strict=True))


async def served_step(model: skytrain.Model, *, step: int | None = None) -> str:
    """The step the gateway says answered a request for ``model`` (``step`` pins one).

    A pinned older step may have been unloaded from the worker: the gateway answers 503 with
    a Retry-After while it is loaded again, which the openai client waits out when it may
    retry long enough.
    """
    client = model.openai_client().with_options(max_retries=30)
    raw = await client.chat.completions.with_raw_response.create(
        model=model.get_inference_name(step),
        messages=[{"role": "user", "content": "Say hello."}],
        max_tokens=2,
    )
    return raw.headers["x-skytrain-step"]


def terminal_lines(err: str) -> list[str]:
    """What a terminal shows over time: tqdm rewrites its line with carriage returns."""
    return [line.strip() for line in err.replace("\r", "\n").splitlines() if line.strip()]


def sampled_token_ids(choice: Choice) -> list[str]:
    assert choice.logprobs is not None and choice.logprobs.content
    return [entry.token for entry in choice.logprobs.content]


# --- Backend and registration -----------------------------------------------------------------


@pytest.mark.slow
async def test_backend_from_the_environment_registers_as_the_keys_tenant(
    sdk_service: Service, sdk_key: str, tiny_model_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SKYTRAIN_BASE_URL", f"{sdk_service.url}/v1")  # as OpenAI clients write it
    monkeypatch.setenv("SKYTRAIN_API_KEY", sdk_key)
    async with skytrain.Backend() as backend:
        assert backend.base_url == sdk_service.url
        model = skytrain.TrainableModel(
            name="from-env", project=PROJECT, base_model=str(tiny_model_path)
        )
        await model.register(backend, wait=False)
    assert model.entity == TENANT
    assert model.get_inference_name() == f"{TENANT}/{PROJECT}/from-env"
    assert model.id is not None


@pytest.fixture
def revoked_key(sdk_service: Service) -> str:
    """A key of its own tenant, revoked with `skytrain keys revoke <prefix>`."""
    key = sdk_service.key("sdk-revoked")
    subprocess.run(
        [sys.executable, "-m", "skytrain_backend", "keys", "revoke", key[:12]],
        env=sdk_service.env,
        check=True,
        capture_output=True,
    )
    return key


@pytest.mark.slow
async def test_unknown_and_revoked_keys_are_refused_with_the_servers_reason(
    sdk_service: Service, revoked_key: str, tiny_model_path: Path
) -> None:
    model = skytrain.TrainableModel(name="denied", project=PROJECT, base_model=str(tiny_model_path))
    async with skytrain.Backend(sdk_service.url, "sk-st-not-a-key", timeout=30.0) as stranger:
        with pytest.raises(skytrain.AuthenticationError, match="API key is not valid") as denied:
            await model.register(stranger)
    assert denied.value.status_code == 401
    assert model.id is None

    async with skytrain.Backend(base_url=sdk_service.url, api_key=revoked_key) as former:
        with pytest.raises(skytrain.AuthenticationError, match="was revoked"):
            await model.register(former)


@pytest.mark.slow
async def test_register_waits_until_served_showing_what_it_waits_for(
    backend: skytrain.Backend, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    base = str(tiny_model_path)
    model = skytrain.TrainableModel(name="registered", project=PROJECT, base_model=base)
    await model.register(backend, timeout=WAIT_S, poll_interval=0.5)

    name = f"{TENANT}/{PROJECT}/registered"
    statuses = [
        line.removeprefix(f"serving {name}: ").rpartition(" [")[0]
        for line in terminal_lines(capsys.readouterr().err)
        if line.startswith(f"serving {name}: ")
    ]
    assert statuses[-1] == "ready"
    waits = [status for status in statuses if status != "ready"]
    # A new model is never served at once: the scheduler has yet to place it on a worker.
    assert waits, statuses
    server_phrases = (
        f"waiting for a worker for {base} to be placed on",
        f"starting a worker for {base} (local)",
        f"is starting its engine for {base}",
        f"is loading step 0 of {name}",
        f"placing {name} on worker",
    )
    for status in waits:
        assert any(phrase in status for phrase in server_phrases), status
    # Served now: the next request is answered by the base model (step 0).
    assert await served_step(model) == "0"

    # Registering the same name again returns the same model, without waiting.
    again = skytrain.TrainableModel(name="registered", project=PROJECT, base_model=base)
    await again.register(backend, timeout=WAIT_S)
    assert again.id == model.id
    shown = {
        line.removeprefix(f"serving {name}: ").rpartition(" [")[0]
        for line in terminal_lines(capsys.readouterr().err)
        if line.startswith(f"serving {name}: ")
    }
    assert shown == {"ready"}
    other = skytrain.TrainableModel(name="registered", project=PROJECT, base_model="other/base")
    with pytest.raises(skytrain.ConflictError, match="exists with base model"):
        await other.register(backend)


# --- sampling -------------------------------------------------------------------------------


@pytest.mark.slow
async def test_openai_client_samples_token_ids_from_latest_and_pinned_steps(
    backend: skytrain.Backend, tiny_model_path: Path
) -> None:
    model = await registered(backend, "sampler", tiny_model_path)
    assert model.get_inference_name() == f"{TENANT}/{PROJECT}/sampler"
    assert model.get_inference_name(step=0) == f"{TENANT}/{PROJECT}/sampler:step0"

    trajectory = await rollout(model, "Say hello.", step=0)
    (choice,) = [item for item in trajectory.messages_and_choices if isinstance(item, Choice)]
    tokens = sampled_token_ids(choice)
    assert tokens and all(re.fullmatch(r"token_id:\d+", token) for token in tokens)
    assert trajectory.messages() == [
        {"role": "user", "content": "Say hello."},
        {"role": "assistant", "content": choice.message.content},
    ]
    # What the server parses is what the SDK sends: the choice survives the JSON round trip.
    sent = skytrain.Trajectory.model_validate(json.loads(trajectory.model_dump_json()))
    assert sent.messages_and_choices[1] == choice

    assert await served_step(model) == await served_step(model, step=0) == "0"
    with pytest.raises(openai.NotFoundError, match="has no step 3: its latest step is 0"):
        await rollout(model, "Say hello.", step=3)


# --- gathering ------------------------------------------------------------------------------


async def test_gather_runs_every_rollout_behind_a_bar_with_the_mean_reward(
    backend: skytrain.Backend, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = await registered(backend, "gatherer", tiny_model_path)

    async def awaited_inside() -> skytrain.TrajectoryGroup:
        return await skytrain.TrajectoryGroup(rollout(model, "Count to three.") for _ in range(2))

    finished = await rollout(model, "Say hello.")
    groups = await skytrain.gather_trajectory_groups(
        [
            skytrain.TrajectoryGroup(rollout(model, "Name a fruit.") for _ in range(3)),
            # A rollout asking for a step that does not exist fails with the gateway's 404.
            skytrain.TrajectoryGroup([finished, rollout(model, "Say hello.", step=99)]),
            awaited_inside(),
        ],
        pbar_desc="sdk gather",
        max_exceptions=1,
    )

    assert [len(group) for group in groups] == [3, 1, 2]
    assert groups[1].trajectories == [finished]
    (failure,) = groups[1].exceptions
    assert failure.type == "openai.NotFoundError"
    assert "has no step 99" in failure.message
    trajectories = [t for group in groups for t in group.trajectories]
    assert {t.metadata["prompt"] for t in groups[0].trajectories} == {"Name a fruit."}
    for trajectory in trajectories:
        choice = trajectory.messages_and_choices[-1]
        assert isinstance(choice, Choice) and sampled_token_ids(choice)
        assert trajectory.reward == letter_share(choice.message.content or "")
    mean = sum(t.reward for t in trajectories) / len(trajectories)
    final = terminal_lines(capsys.readouterr().err)[-1]
    assert final.startswith("sdk gather: 100%") and "7/7" in final, final
    assert f"reward={mean:.4g}" in final and "exceptions=1" in final, final

    with pytest.raises(openai.NotFoundError, match="has no step 99"):
        await skytrain.gather_trajectory_groups(
            [skytrain.TrajectoryGroup([rollout(model, "Hi.", step=99), rollout(model, "Hi.")])],
            pbar_desc=None,
            max_exceptions=0,
        )


# --- training -------------------------------------------------------------------------------


async def test_train_returns_the_new_step_and_the_endpoint_serves_it(
    backend: skytrain.Backend, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    model = await registered(backend, "trainee", tiny_model_path)
    before = await greedy_logprobs(model)
    groups = await sample_groups(model)
    capsys.readouterr()

    result = await model.train(groups, config=TRAIN, poll_interval=0.5, timeout=WAIT_S)

    assert result.step == 1 == await model.get_step()
    num_steps = int(result.metrics["train/num_gradient_steps"])
    assert num_steps >= 1
    for key in ("loss/policy", "grad_norm", "time/training_s"):
        assert key in result.metrics, sorted(result.metrics)
    # Measured by the worker before its first update: the trainer saw what the engine saw.
    assert result.metrics["logprob_agreement/max_abs_diff"] < 1e-4
    assert result.metrics["logprob_agreement/num_tokens"] > 0
    assert result.metrics["tokens/without_sampling_logprob"] == 0
    final = terminal_lines(capsys.readouterr().err)[-1]
    assert final.startswith("train: 100%") and f"{num_steps}/{num_steps}" in final, final
    assert "loss/policy=" in final, final

    # The next request gets the new step; step 0 stays addressable and unchanged.
    assert await served_step(model) == "1"
    assert await served_step(model, step=0) == "0"
    assert not same_policy(await greedy_logprobs(model), before)
    assert same_policy(await greedy_logprobs(model, step=0), before)


async def test_a_job_the_trainer_fails_raises_the_servers_message(
    backend: skytrain.Backend, tiny_model_path: Path
) -> None:
    model = await registered(backend, "failing", tiny_model_path)
    groups = await sample_groups(model, groups=1)
    # Rows of 16 tokens end inside SmolLM2's chat-template preamble, before any sampled token.
    too_short = TRAIN.model_copy(update={"packed_sequence_length": 16})

    with pytest.raises(skytrain.TrainingFailedError) as failed:
        await model.train(groups, config=too_short, poll_interval=0.5, timeout=WAIT_S)

    assert "every trained token lies beyond 16 tokens" in failed.value.error_message
    assert failed.value.job_id in str(failed.value)
    assert await model.get_step() == 0
    assert [c.step for c in await model.list_checkpoints()] == [0]

    # The refusal that the server can make up front never becomes a job.
    with pytest.raises(skytrain.InvalidRequestError, match="packed_sequence_length"):
        await model.train(groups, config=TRAIN.model_copy(update={"packed_sequence_length": 8}))


@pytest.mark.slow
async def test_train_warns_of_trajectories_its_rows_cut_at_submission_and_at_start(
    backend: skytrain.Backend, tiny_model_path: Path
) -> None:
    """Before, only the job's ``tokens/truncated`` metric said that rollouts were cut."""
    model = await registered(backend, "short-rows", tiny_model_path)
    groups = await sample_groups(model, groups=1)
    choices = [t.messages_and_choices[-1] for g in groups for t in g.trajectories]
    assert all(isinstance(c, Choice) and c.model_extra for c in choices)
    prompts = [len(c.model_extra["prompt_token_ids"]) for c in choices]  # type: ignore[union-attr, index]
    lengths = [p + len(sampled_token_ids(c)) for p, c in zip(prompts, choices, strict=True)]  # type: ignore[arg-type]
    row = max(prompts) + 1  # each keeps its first sampled token
    longer = [n for n in lengths if n > row]
    assert longer, lengths

    with pytest.warns(RuntimeWarning) as caught:
        config = TRAIN.model_copy(update={"packed_sequence_length": row})
        result = await model.train(
            groups, config=config, poll_interval=0.5, timeout=WAIT_S, progress=False
        )

    said = [str(warning.message) for warning in caught]
    submitted = (
        f"{len(longer)} of its trajectories are longer than its rows of {row} tokens "
        f"(the longest: {max(longer)})"
    )
    assert any(submitted in words for words in said), said
    assert any(f"sequences were cut to its rows of {row} tokens" in words for words in said), said
    assert result.step == 1


async def test_train_sft_fine_tunes_on_the_assistant_turns(
    backend: skytrain.Backend, tiny_model_path: Path
) -> None:
    model = await registered(backend, "sft", tiny_model_path)
    before = await greedy_logprobs(model)
    examples = [
        skytrain.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": "A pear."},
            ],
            reward=1.0,
        )
        for prompt in PROMPTS
    ]

    result = await model.train_sft(
        examples,
        config=skytrain.SFTConfig(learning_rate=5e-3, batch_size=2, num_epochs=2),
        poll_interval=0.5,
        timeout=WAIT_S,
        progress=False,
    )

    assert result.step == 1 == await model.get_step()
    assert result.metrics["train/num_gradient_steps"] == 4  # 2 epochs of batches of 2 and 1
    assert result.metrics["loss/sft"] > 0
    assert not same_policy(await greedy_logprobs(model), before)


# --- logs, checkpoints ------------------------------------------------------------------------


@pytest.mark.slow
async def test_delete_checkpoints_keeps_the_latest_and_the_best_and_pull_loads_in_peft(
    backend: skytrain.Backend, tiny_model_path: Path, tmp_path: Path, s3_endpoint: str
) -> None:
    model = await registered(backend, "keeper", tiny_model_path)
    val_rewards = {1: 0.9, 2: 0.1, 3: 0.4}  # step 1 is the best, step 3 the latest
    for step, reward in val_rewards.items():
        result = await model.train(
            await sample_groups(model), config=TRAIN, poll_interval=0.5, timeout=WAIT_S
        )
        assert result.step == step
        val = await rollout(model, "Name a fruit.")
        await model.log([skytrain.TrajectoryGroup([val.model_copy(update={"reward": reward})])])

    checkpoints = await model.list_checkpoints()
    assert [c.step for c in checkpoints] == [0, 1, 2, 3]
    for checkpoint in checkpoints[1:]:
        assert checkpoint.metrics["val/reward"] == pytest.approx(val_rewards[checkpoint.step])
        assert checkpoint.metrics["train/num_gradient_steps"] >= 1
    assert await model.get_step() == 3

    assert await model.delete_checkpoints(best_checkpoint_metric="val/reward") == [2]
    assert [c.step for c in await model.list_checkpoints()] == [0, 1, 3]
    assert await model.delete_checkpoints(best_checkpoint_metric="val/reward") == []
    with pytest.raises(openai.NotFoundError, match=r"step 2 of model \S+ was deleted"):
        await rollout(model, "Say hello.", step=2)
    assert await served_step(model, step=1) == "1"
    with pytest.raises(skytrain.NotFoundError):
        await model.pull_checkpoint(2, tmp_path / "deleted")
    assert not (tmp_path / "deleted").exists()

    # The best step's adapter comes from S3 through a presigned URL (the API key stays with
    # skytrain), loads in peft and changes the base model's outputs.
    files_url = f"{backend.base_url}/v1/models/{model.id}/checkpoints/1/files"
    async with httpx.AsyncClient(headers={"Authorization": f"Bearer {backend.api_key}"}) as http:
        redirect = await http.get(f"{files_url}/adapter_model.safetensors")
    assert redirect.status_code == 307
    assert redirect.headers["location"].startswith(s3_endpoint)
    pulled = await model.pull_checkpoint(1, tmp_path / "step1")
    names = sorted(p.name for p in pulled.iterdir())
    assert names == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "optimizer.pt",
        "trainer_state.json",
    ]
    assert json.loads((pulled / "trainer_state.json").read_text())["step"] == 1
    assert not _same_logits(tiny_model_path, pulled)


def _same_logits(base_model: Path, adapter: Path) -> bool:
    """Whether the adapter leaves the base model's next-token logits as they were."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(base_model)
    input_ids = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        expected = base(input_ids).logits
        tuned = PeftModel.from_pretrained(base, adapter)
        got = tuned(input_ids).logits
    return bool(torch.allclose(expected, got, atol=1e-4))


# --- a prompted model -------------------------------------------------------------------------


async def test_a_prompted_model_samples_from_any_openai_endpoint(
    sdk_service: Service, sdk_key: str, backend: skytrain.Backend, tiny_model_path: Path
) -> None:
    trainable = await registered(backend, "baseline-of", tiny_model_path)
    baseline = skytrain.Model(
        name="baseline",
        project=PROJECT,
        inference_base_url=f"{sdk_service.url}/v1",
        inference_api_key=sdk_key,
        inference_model_name=trainable.get_inference_name(step=0),
    )
    assert baseline.get_inference_name() == f"{TENANT}/{PROJECT}/baseline-of:step0"
    with pytest.raises(ValueError, match="prompted model"):
        baseline.get_inference_name(step=1)

    trajectory = await rollout(baseline, "Say hello.")
    assert same_policy(await greedy_logprobs(baseline), await greedy_logprobs(trainable, step=0))
    assert trajectory.messages()[-1]["role"] == "assistant"
    assert await served_step(baseline) == "0"


# --- ART's ServerlessBackend protocol -------------------------------------------------------


async def _art_checkpoints(
    client: AsyncOpenAI, model_id: str, **params: Any
) -> list[ArtCheckpoint]:
    page = client.get_api_list(
        f"/preview/models/{model_id}/checkpoints",
        model=ArtCheckpoint,
        page=AsyncCursorPage[ArtCheckpoint],
        options={"params": params},
    )
    return [checkpoint async for checkpoint in page]


async def _art_events(client: AsyncOpenAI, job_id: str) -> list[ArtEvent]:
    """Follow a job as ART's client does: pages after the last seen event until it ends."""
    events: list[ArtEvent] = []
    for _ in range(int(WAIT_S / 0.5)):
        params = {"after": events[-1].id} if events else {}
        page = client.get_api_list(
            f"/preview/training-jobs/{job_id}/events",
            model=ArtEvent,
            page=AsyncCursorPage[ArtEvent],
            options={"params": params},
        )
        events += [event async for event in page]
        if events and events[-1].type in ("training_ended", "training_failed"):
            return events
        await asyncio.sleep(0.5)
    raise AssertionError(f"job {job_id} did not end: {events[-3:]}")


def _art_group(
    prompt: str, choices: Iterable[Choice], *, reward: float | None = None
) -> dict[str, Any]:
    """ART's TrajectoryGroup JSON: the prompt, the sampled choice, its reward (or ``reward``)."""
    return {
        "trajectories": [
            {
                "messages_and_choices": [
                    {"role": "user", "content": prompt},
                    choice.model_dump(mode="json"),
                ],
                "reward": letter_share(choice.message.content or "") if reward is None else reward,
            }
            for choice in choices
        ]
    }


@pytest.mark.slow
async def test_art_serverless_client_flow_against_the_preview_routes(
    sdk_service: Service, sdk_key: str, tiny_model_path: Path
) -> None:
    async with AsyncOpenAI(
        base_url=f"{sdk_service.url}/v1", api_key=sdk_key, max_retries=0, timeout=120
    ) as art:
        body = {
            "entity": None,
            "project": PROJECT,
            "name": "art-agent",
            "base_model": str(tiny_model_path),
            "return_existing": True,
        }
        model = await art.post("/preview/models", cast_to=ArtModel, body=body)
        assert model.entity == TENANT
        assert (await art.post("/preview/models", cast_to=ArtModel, body=body)).id == model.id
        artifact = f"wandb-artifact:///{model.entity}/{model.project}/{model.name}"

        async def sample(step: int, prompt: str, n: int) -> tuple[list[Choice], str]:
            # Until a worker serves the new model its endpoint answers 503 with Retry-After.
            for _ in range(int(WAIT_S)):
                try:
                    raw = await art.chat.completions.with_raw_response.create(
                        model=f"{artifact}:step{step}",
                        messages=[{"role": "user", "content": prompt}],
                        n=n,
                        max_tokens=8,
                        temperature=1.0,
                    )
                except openai.InternalServerError as exc:
                    assert exc.status_code == 503, exc
                    await asyncio.sleep(1.0)
                    continue
                return list(raw.parse().choices), raw.headers["x-skytrain-step"]
            raise AssertionError(f"{artifact} was not served within {WAIT_S} s")

        async def log_val(group: dict[str, Any]) -> None:
            # ART's log(model, groups, split="val"): the validation reward a checkpoint keeps.
            await art.post(
                f"/preview/models/{model.id}/log",
                cast_to=type(None),
                body={"model_id": model.id, "trajectory_groups": [group], "split": "val"},
            )

        # ART's _get_step: the newest checkpoint.
        newest = await _art_checkpoints(art, model.id, limit=1, order="desc")
        assert newest[0].step == 0
        groups = []
        for prompt in PROMPTS[:2]:
            choices, served = await sample(0, prompt, n=3)
            assert served == "0"
            groups.append(_art_group(prompt, choices))
        await log_val(_art_group(PROMPTS[0], choices, reward=0.2))

        job = await art.post(
            "/preview/training-jobs",
            cast_to=ArtJob,
            # What ServerlessBackend.train(model, groups, learning_rate=5e-3) sends.
            body=art_train_request(model.id, groups, learning_rate=5e-3),
        )
        events = await _art_events(art, job.id)
        types = [event.type for event in events]
        assert types[0] == "training_started" and types[-1] == "training_ended", types
        # ART sizes its progress bar with num_sequences: one gradient_step event each.
        assert types.count("gradient_step") == events[0].data["num_sequences"] >= 1
        assert events[0].data["logprob_agreement/max_abs_diff"] < 1e-4
        assert "warning" not in events[0].data
        assert events[-1].data["step"] == 1

        choices, served = await sample(1, PROMPTS[0], n=1)
        assert served == "1" and choices[0].logprobs is not None
        await log_val(_art_group(PROMPTS[0], choices, reward=0.7))

        # ART's delete_checkpoints: list every checkpoint (a page at a time), keep the latest
        # and the best by val/reward, delete the rest.
        listed = await _art_checkpoints(art, model.id, limit=1)
        assert [c.step for c in listed] == [0, 1]
        assert [c.metrics["val/reward"] for c in listed] == pytest.approx([0.2, 0.7])
        best = max(listed, key=lambda c: c.metrics["val/reward"]).step
        latest = max(c.step for c in listed)
        doomed = [c.step for c in listed if c.step not in (best, latest)]
        assert doomed == [0]
        deleted = await art.delete(
            f"/preview/models/{model.id}/checkpoints",
            cast_to=ArtDeleted,
            body={"steps": [*doomed, 7]},
        )
        assert (deleted.deleted_count, deleted.not_found_steps) == (1, [7])
        assert [c.step for c in await _art_checkpoints(art, model.id)] == [1]
        with pytest.raises(openai.NotFoundError, match="was deleted"):
            await art.chat.completions.create(
                model=f"{artifact}:step0", messages=[{"role": "user", "content": "Hi."}]
            )
        assert (await sample(1, PROMPTS[1], n=1))[1] == "1"

        await art.delete(f"/preview/models/{model.id}", cast_to=type(None))
        with pytest.raises(openai.NotFoundError):
            await art.chat.completions.create(
                model=f"{artifact}:step1", messages=[{"role": "user", "content": "Hi."}]
            )

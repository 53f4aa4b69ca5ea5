"""Each example end to end: rollouts through a real ``skytrain serve`` + local worker serving
the tiny model, one training step, the step advanced, and every reward recomputed from the
trajectory's own record of the game."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from openai.types.chat.chat_completion import Choice

import skytrain
from examples.common.training import SmokeRun
from examples.email_search import rollout as email_search
from examples.email_search.agent import ANSWER_CALL_REWARD, CITED_REWARD, CORRECT_REWARD
from examples.game_2048 import rollout as game_2048
from examples.temporal_clue import rollout as temporal_clue
from examples.tic_tac_toe import rollout as tic_tac_toe
from examples.tic_tac_toe.train import main as tic_tac_toe_main
from skytrain_backend.games.game_2048.env import INVALID_MOVE_REWARD as GAME_INVALID
from skytrain_backend.games.game_2048.env import WIN_REWARD as GAME_WIN
from skytrain_backend.games.tic_tac_toe.env import score_outcome
from tests.fixtures.service import Service, start_service, stop_service

pytestmark = [pytest.mark.e2e]


@pytest.fixture(scope="module")
def examples_service(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Service]:
    """One embedded ``skytrain serve`` for all the examples (they share the base model).

    The e2e suite's short leases are for noticing killed workers; here a worker busy loading
    the trainer on two shared cores must keep its job, so leases get their default lengths.
    """
    overrides = {"SKYTRAIN_JOB_LEASE_S": "60", "SKYTRAIN_WORKER_HEARTBEAT_TIMEOUT_S": "45"}
    service = start_service(overrides, tmp_path_factory.mktemp("examples") / "home")
    yield service
    stop_service(service)


async def _smoke(
    service: Service,
    smoke: Callable[[skytrain.Backend, str], Awaitable[SmokeRun]],
    base_model: Path,
) -> SmokeRun:
    async with skytrain.Backend(base_url=service.url, api_key=service.key("examples")) as backend:
        try:
            return await smoke(backend, str(base_model))
        except Exception as exc:
            logs = f"{service.log()[-4000:]}\n{service.worker_logs()}"
            raise AssertionError(f"smoke run failed: {exc!r}\n{logs}") from exc


def _check_run(run: SmokeRun) -> list[skytrain.Trajectory]:
    """The step advanced by one, and every rollout came back with sampled token ids."""
    assert run.step_after == run.step_before + 1 == run.result.step
    assert [len(group.trajectories) for group in run.groups] == [2, 2]
    trajectories = [t for group in run.groups for t in group.trajectories]
    for trajectory in trajectories:
        choices = [item for item in trajectory.messages_and_choices if isinstance(item, Choice)]
        assert 1 <= len(choices) == trajectory.metrics["turns"]
        for choice in choices:
            assert choice.logprobs is not None and choice.logprobs.content
            assert all(entry.token.startswith("token_id:") for entry in choice.logprobs.content)
    return trajectories


@pytest.mark.slow
async def test_2048_smoke_step(examples_service: Service, tiny_model_path: Path) -> None:
    run = await _smoke(examples_service, game_2048.smoke, tiny_model_path)
    for trajectory in _check_run(run):
        outcome = trajectory.metadata["outcome"]
        assert outcome in {"invalid_move", "won", "game_over", "turn_limit"}
        if outcome == "invalid_move":
            assert trajectory.reward == GAME_INVALID
        elif outcome == "won":
            assert trajectory.reward == GAME_WIN
        else:
            assert 0 < trajectory.reward < GAME_WIN


@pytest.mark.slow
async def test_tic_tac_toe_smoke_step(examples_service: Service, tiny_model_path: Path) -> None:
    run = await _smoke(examples_service, tic_tac_toe.smoke, tiny_model_path)
    for trajectory in _check_run(run):
        assert trajectory.reward == score_outcome(trajectory.metadata["outcome"])


async def test_temporal_clue_smoke_step(examples_service: Service, tiny_model_path: Path) -> None:
    run = await _smoke(examples_service, temporal_clue.smoke, tiny_model_path)
    for trajectory in _check_run(run):
        right = [trajectory.metrics[f"correct_{q}"] for q in ("suspect", "weapon", "room", "time")]
        assert trajectory.reward == sum(right) / 4


async def test_email_search_smoke_step(examples_service: Service, tiny_model_path: Path) -> None:
    run = await _smoke(examples_service, email_search.smoke, tiny_model_path)
    for trajectory in _check_run(run):
        assert trajectory.tools is not None
        metrics = trajectory.metrics
        if trajectory.metadata["outcome"] == "answered":  # two turns: no extra-turn penalty
            assert trajectory.reward == pytest.approx(
                ANSWER_CALL_REWARD
                + CORRECT_REWARD * metrics["correct"]
                + CITED_REWARD * metrics["cited"]
            )
        else:
            assert trajectory.reward == 0.0


def test_training_script_trains_evaluates_and_logs(
    examples_service: Service, tiny_model_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    argv = ["--base-model", str(tiny_model_path), "--name", "script", "--steps", "1"]
    argv += ["--groups", "2", "--rollouts-per-group", "2", "--eval-n", "2", "--max-tokens", "8"]
    argv += ["--base-url", examples_service.url, "--api-key", examples_service.key("examples")]

    tic_tac_toe_main(argv)

    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert [row[:2] for row in rows] == [["step", "0"], ["step", "1"]]
    assert "val/reward" in rows[0] and "train/reward" not in rows[0]
    assert {"train/reward", "val/reward"} <= set(rows[1])
    with examples_service.http("examples") as http:
        models = http.get("/v1/models", params={"project": "tic-tac-toe", "name": "script"})
        (model,) = models.json()["data"]
        assert model["latest_step"] == 1
        logs = http.get(f"/v1/models/{model['id']}/logs", params={"split": "val"}).json()["data"]
        assert sorted(batch["step"] for batch in logs) == [0, 1]


@pytest.mark.slow
def test_the_readme_quickstart_runs_twice_on_one_model_and_is_what_the_readme_shows(
    examples_service: Service,
    tiny_model_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    """The issue's newcomer: a second run of the quickstart met a ConflictError on the model
    the first made. Now the second run trains the same model on from its last step."""
    from examples import quickstart

    source = Path(quickstart.__file__).read_text()
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    assert source.split('"""', 2)[2].strip() in readme  # the README shows the code as it is

    monkeypatch.setenv("SKYTRAIN_BASE_URL", examples_service.url)
    monkeypatch.setenv("SKYTRAIN_API_KEY", examples_service.key("quickstart"))
    argv = ["--base-model", str(tiny_model_path), "--steps", "1"]
    asyncio.run(quickstart.main(quickstart.parse_args(argv)))
    assert capsys.readouterr().out.startswith("step 1: mean reward ")
    asyncio.run(quickstart.main(quickstart.parse_args(argv)))
    assert capsys.readouterr().out.startswith("step 2: mean reward ")
    with examples_service.http("quickstart") as http:
        listed = http.get("/v1/models", params={"project": "quickstart"}).json()["data"]
    assert [model["name"] for model in listed] == [f"brief-{tiny_model_path.name.lower()}"]


def test_every_example_takes_the_shared_flags() -> None:
    """The quickstart and the training scripts answer to the same options."""
    from examples import quickstart
    from examples.common.training import training_parser

    shared = ["--base-model", "m", "--name", "n", "--steps", "3", "--base-url", "u"]
    shared += ["--api-key", "k"]
    parsed = vars(quickstart.parse_args(shared))
    scripts = training_parser("x", None, project="p", base_model="b").parse_args(shared)
    for option in ("base_model", "name", "steps", "base_url", "api_key"):
        assert parsed[option] == getattr(scripts, option)


def test_the_tinker_examples_take_the_base_model_steps_and_base_url_flags() -> None:
    """The README says every example takes `--base-model` and `--steps`; the cookbook's took
    `--model` and `--max-steps`. The Tinker SDK takes its key from TINKER_API_KEY and names no
    model, so these three are the ones they share with the others."""
    from examples.tinker import cookbook_sl_basic, rl_loop, sl_loop

    shared = ["--base-model", "m", "--steps", "3", "--base-url", "u"]
    for parse in (rl_loop.parse_args, sl_loop.parse_args):
        config = parse(shared)
        assert (config.base_model, config.num_steps, config.base_url) == ("m", 3, "u")
    cookbook = cookbook_sl_basic.parse_args([*shared, "--log-path", "/tmp/sl_basic"])
    assert (cookbook.base_model, cookbook.steps, cookbook.base_url) == ("m", 3, "u")

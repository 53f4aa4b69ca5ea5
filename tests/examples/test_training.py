"""The shared pieces of the examples' training loop that run without a server."""

from __future__ import annotations

import pytest

import skytrain
from examples.common import training
from examples.email_search.agent import EmailSearchEpisode
from examples.email_search.agent import Scenario as EmailScenario
from examples.game_2048.rollout import task as game_task
from examples.game_2048.train import main as game_main
from examples.temporal_clue.train import main as clue_main
from skytrain_backend.games.game_2048.play import Game2048Episode
from skytrain_backend.games.game_2048.play import Game2048Scenario as GameScenario
from skytrain_backend.protocol import Choice as WireChoice
from skytrain_backend.protocol import TrajectoryGroup as WireGroup
from tests.examples.choices import text_choice, tool_choice


def test_episode_trajectories_are_what_the_server_parses():
    game = Game2048Episode(GameScenario(seed=1, target=64), max_turns=1)
    game.step(text_choice("<move>sideways</move>"))
    email = EmailSearchEpisode(EmailScenario(seed=2))
    email.step(tool_choice(("search_emails", {"keywords": ["invoice"]})))
    email.step(tool_choice(("answer", {"text": "?", "source_id": "m000"})))
    group = skytrain.TrajectoryGroup(
        [training.episode_trajectory(game), training.episode_trajectory(email)]
    )

    parsed = WireGroup.model_validate(group.model_dump(mode="json"))

    game_wire, email_wire = parsed.trajectories
    assert game_wire.reward == -1.0
    assert game_wire.metrics["invalid_move"] is True
    assert isinstance(game_wire.messages_and_choices[2], WireChoice)
    assert email_wire.tools is not None and len(email_wire.tools) == 3
    kinds = [type(item).__name__ for item in email_wire.messages_and_choices]
    assert kinds == ["Message", "Message", "Choice", "Message", "Choice"]
    tool_reply = email_wire.messages_and_choices[3]
    assert tool_reply.role == "tool" and tool_reply.tool_call_id == "call_0"


def _trajectory(reward: float, **metrics: float | bool) -> skytrain.Trajectory:
    return skytrain.Trajectory(
        messages_and_choices=[{"role": "user", "content": "hi"}, text_choice("ok")],
        reward=reward,
        metrics=metrics,
    )


def test_summarize_means_reward_and_every_metric_under_the_split():
    groups = [
        skytrain.TrajectoryGroup(
            [_trajectory(1.0, won=True, moves=4), _trajectory(0.0, won=False)]
        ),
        skytrain.TrajectoryGroup([_trajectory(0.5, moves=2)]),
    ]
    assert training.summarize(groups, "val") == {
        "val/reward": pytest.approx(0.5),
        "val/moves": pytest.approx(3.0),
        "val/won": pytest.approx(0.5),
    }
    assert training.summarize([], "val") == {}


def test_eval_seeds_never_overlap_training_seeds():
    assert min(training.eval_seeds(16)) == training.EVAL_SEED_OFFSET
    assert len(training.eval_seeds(16)) == 16


def test_task_builds_scenarios_from_seeds_with_its_options():
    task = game_task(target=64)
    assert task.project == "2048"
    assert task.scenario(7) == GameScenario(seed=7, target=64)


@pytest.mark.parametrize(
    ("main", "argv", "message"),
    [
        (game_main, ["--target", "100"], "target must be a power of two"),
        (game_main, ["--steps", "0"], "--steps: must be at least 1"),
        (game_main, ["--learning-rate=-1e-5"], "must be a positive number"),
        (game_main, ["--learning-rate", "nan"], "must be a positive number"),
        (clue_main, ["--rooms", "9"], "rooms must be between 3 and 6"),
    ],
)
def test_training_scripts_refuse_bad_options_before_connecting(main, argv, message, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(argv)
    assert exit_info.value.code == 2
    assert message in capsys.readouterr().err


def test_training_script_help_names_the_default_base_model(capsys):
    with pytest.raises(SystemExit):
        game_main(["--help"])
    out = capsys.readouterr().out
    assert "python -m examples.game_2048.train" in out
    assert "Qwen/Qwen2.5-3B-Instruct" in out

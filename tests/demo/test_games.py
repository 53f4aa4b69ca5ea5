"""``skytrain demo --task``: the seed's games with shaped rewards, run as the one-word task is.

The shaped rewards are pure functions of the examples' episodes, tested with plain ``Choice``
objects; one short run of each game on the tiny random model checks the whole command (table,
CSV, PNG, nothing left running), and an unknown task is refused before anything starts.
"""

from __future__ import annotations

import csv
import os
import re
import subprocess
import sys
from pathlib import Path

import matplotlib.image
import pytest

from skytrain_backend.cli.demo import Task
from skytrain_backend.demo import report
from skytrain_backend.demo.tasks import (
    GAME_2048_TURNS,
    REFUSED_MOVE_WEIGHT,
    TASKS,
    Shaped2048Episode,
    ShapedTemporalClueEpisode,
    ShapedTicTacToeEpisode,
    format_credit,
)
from skytrain_backend.games.game_2048.env import DIRECTIONS, slide
from skytrain_backend.games.game_2048.play import Game2048Scenario as GameScenario
from skytrain_backend.games.temporal_clue.play import TemporalClueScenario as ClueScenario
from skytrain_backend.games.tic_tac_toe.env import EMPTY_BOARD, cell_name, winning_moves
from skytrain_backend.games.tic_tac_toe.play import TicTacToeScenario
from tests.demo.support import assert_nothing_left, start_demo
from tests.examples.choices import text_choice


def test_the_command_offers_every_task() -> None:
    assert [task.value for task in Task] == list(TASKS)


def test_an_unknown_task_is_refused_naming_the_choices(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "skytrain_backend", "demo", "--task", "chess"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    for name in TASKS:
        assert f"'{name}'" in result.stderr
    assert "Traceback" not in result.stderr


def test_a_temperature_of_zero_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # Greedy sampling makes a group's rollouts identical: GRPO would have nothing to compare.
    command = [sys.executable, "-m", "skytrain_backend", "demo", "--task", "tic-tac-toe"]
    result = subprocess.run(
        [*command, "--temperature", "0"],
        capture_output=True,
        text=True,
        env={**os.environ, "COLUMNS": "200", "HOME": str(tmp_path)},
        timeout=120,
    )
    assert result.returncode == 2, result.stderr
    assert "--temperature" in result.stderr and "not positive" in result.stderr
    assert "Traceback" not in result.stderr
    assert not (tmp_path / ".skytrain").exists()


def test_winning_moves_names_the_cells_that_complete_a_line() -> None:
    board = ("X", "X", " ", "O", "O", " ", " ", " ", " ")
    assert winning_moves(board, "X") == [2]
    assert winning_moves(board, "O") == [5]
    assert winning_moves(EMPTY_BOARD, "X") == []


def _tic_tac_toe(seed: int = 0) -> ShapedTicTacToeEpisode:
    return ShapedTicTacToeEpisode(TicTacToeScenario(seed=seed, agent_first=True))


def test_format_credit_counts_the_tags_an_accepted_word_and_brevity() -> None:
    cell = re.compile(r"\b[A-C][1-3]\b")
    assert format_credit("<move>B2</move>", "move", cell) == 1.0
    assert format_credit("<move>Z9</move>", "move", cell) == 0.75
    assert format_credit("I take B2 now, the centre", "move", cell) == 0.25
    assert format_credit("B2", "move", cell) == 0.5
    assert format_credit("", "move", cell) == 0.0
    assert format_credit("I will play a long and thoughtful game", "move", cell) == 0.0


def test_format_credit_with_tag_first_gives_nothing_for_a_bare_word() -> None:
    cell = re.compile(r"\b[A-C][1-3]\b")
    assert format_credit("B2", "move", cell, tag_first=True) == 0.0
    assert format_credit("I take B2 now", "move", cell, tag_first=True) == 0.0
    assert format_credit("B2 </move>", "move", cell, tag_first=True) == 0.25
    assert format_credit("<move>B2", "move", cell, tag_first=True) == 0.75
    assert format_credit("<move>Z9</move>", "move", cell, tag_first=True) == 0.75
    assert format_credit("<move>B2</move>", "move", cell, tag_first=True) == 1.0


def test_tic_tac_toe_an_unreadable_move_ends_the_game_with_its_format_credit() -> None:
    episode = _tic_tac_toe()
    episode.step(text_choice("B2"))  # a free cell, but without the tags: refused, no credit
    assert episode.done and episode.outcome == "invalid_move"
    assert episode.move_quality == [0.0]
    assert episode.reward() == 0.0
    assert episode.metrics()["legal"] == 0.0 and episode.metrics()["score"] == -1.0

    nearly = _tic_tac_toe()
    nearly.step(text_choice("<move>B2"))  # the opening tag, a cell, short: still refused
    assert nearly.outcome == "invalid_move"
    assert nearly.move_quality == [pytest.approx(REFUSED_MOVE_WEIGHT * 0.75)]


def test_tic_tac_toe_each_board_is_followed_by_its_free_cells() -> None:
    episode = _tic_tac_toe(seed=0)
    first = episode.messages()[-1]["content"]
    assert isinstance(first, str)
    assert first.endswith(
        "Free cells: A1, B1, C1, A2, B2, C2, A3, B3, C3. Answer with one of them, like "
        "<move>A1</move>."
    )
    episode.step(text_choice("<move>B2</move>"))
    taken = [i for i, mark in enumerate(episode.game.board) if mark != " "]
    assert len(taken) == 2  # the agent's B2 and the opponent's reply
    second = episode.messages()[-1]["content"]
    assert isinstance(second, str)
    free = [cell_name(i) for i in range(9) if i not in taken]
    assert second.endswith(
        f"Free cells: {', '.join(free)}. Answer with one of them, like <move>{free[0]}</move>."
    )


def test_tic_tac_toe_a_legal_move_then_an_illegal_one_earns_half_the_move_part() -> None:
    episode = _tic_tac_toe()
    episode.step(text_choice("<move>B2</move>"))
    assert not episode.done
    episode.step(text_choice("<move>B2</move>"))  # taken now: in format, but refused
    assert episode.outcome == "invalid_move"
    assert episode.move_quality == [1.0, REFUSED_MOVE_WEIGHT]
    assert episode.reward() == pytest.approx(0.5 * (1.0 + REFUSED_MOVE_WEIGHT) / 2)
    assert episode.metrics()["legal"] == 0.5


def test_tic_tac_toe_missing_a_block_earns_less_than_blocking() -> None:
    # X at A1 and C3; O (the opponent) threatens a line: the next move is judged on blocking.
    def with_board(board: tuple[str, ...]) -> ShapedTicTacToeEpisode:
        episode = _tic_tac_toe()
        episode.game.board = board
        return episode

    board = ("X", "O", " ", " ", "O", " ", " ", " ", "X")
    blocking, missing = with_board(board), with_board(board)
    blocking.step(text_choice("<move>B3</move>"))
    missing.step(text_choice("<move>A3</move>"))
    assert blocking.move_quality == [1.0]
    assert missing.move_quality == [0.5]


def test_tic_tac_toe_a_win_earns_the_most() -> None:
    episode = _tic_tac_toe()
    episode.game.board = ("X", "X", " ", "O", "O", " ", " ", " ", " ")
    episode.step(text_choice("<move>C1</move>"))
    assert episode.outcome == "win"
    assert episode.reward() == 1.0 and episode.metrics()["score"] == 1.0


def test_2048_rewards_valid_moves_and_more_for_merges() -> None:
    episode = Shaped2048Episode(GameScenario(seed=0))
    episode.game.board = ((2, 2, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 4))
    episode.step(text_choice("<move>left</move>"))  # merges the two 2s
    assert episode.move_quality == [1.0]
    episode.game.board = ((4, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 2))
    episode.step(text_choice("<move>up</move>"))  # moves the 2, merges nothing
    assert episode.move_quality == [1.0, 0.5]
    episode.step(text_choice("<move>sideways</move>"))  # both tags, short, no direction
    assert episode.outcome == "invalid_move"
    assert episode.move_quality == [1.0, 0.5, pytest.approx(REFUSED_MOVE_WEIGHT * 0.75)]
    assert episode.reward() == pytest.approx((1.5 + REFUSED_MOVE_WEIGHT * 0.75) / GAME_2048_TURNS)
    metrics = episode.metrics()
    assert metrics["valid"] == pytest.approx(2 / GAME_2048_TURNS)
    assert metrics["merged"] == pytest.approx(1 / GAME_2048_TURNS)
    assert metrics["score"] == -1.0  # the game's own reward: an invalid move


def test_2048_a_game_stops_at_the_demo_turn_limit() -> None:
    episode = Shaped2048Episode(GameScenario(seed=0))
    while not episode.done:
        board = episode.game.board
        direction = next(d for d in DIRECTIONS if slide(board, d)[0] != board)
        episode.step(text_choice(f"<move>{direction}</move>"))
    assert episode.outcome == "turn_limit" and episode.turns == GAME_2048_TURNS
    assert episode.metrics()["valid"] == 1.0


def test_2048_each_board_is_followed_by_the_directions_that_move_a_tile() -> None:
    episode = Shaped2048Episode(GameScenario(seed=0))
    episode.game.board = ((2, 0, 0, 0), (4, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))
    assert episode._prompt().endswith(
        "Moves that change the board: right, down. Answer with one of them, like "
        "<move>right</move>."
    )
    episode.step(text_choice("left"))  # no tags: refused, and a bare direction earns nothing
    assert episode.outcome == "invalid_move" and episode.move_quality == [0.0]

    played = Shaped2048Episode(GameScenario(seed=0))
    played.step(text_choice("<move>down</move>"))
    board, shown = played.game.board, played.messages()[-1]["content"]
    moving = [d for d in DIRECTIONS if slide(board, d)[0] != board]
    assert isinstance(shown, str) and shown.startswith(played.game.render())
    assert shown.endswith(
        f"{', '.join(moving)}. Answer with one of them, like <move>{moving[0]}</move>."
    )


def test_2048_a_direction_that_moves_nothing_earns_only_its_format_credit() -> None:
    episode = Shaped2048Episode(GameScenario(seed=0))
    episode.game.board = ((2, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))
    episode.step(text_choice("<move>left</move>"))
    assert episode.outcome == "invalid_move"
    assert episode.move_quality == [REFUSED_MOVE_WEIGHT]
    assert episode.metrics()["valid"] == 0.0


def test_temporal_clue_rewards_the_format_and_the_right_answers() -> None:
    episode = ShapedTemporalClueEpisode(ClueScenario(seed=0))
    solution = episode.puzzle.solution
    episode.step(
        text_choice(
            f"<answer>\nsuspect: {solution.suspect}\nweapon: nothing\nroom: nowhere\n</answer>"
        )
    )
    # Both tags and three of four lines given, one of four right.
    assert episode.reward() == pytest.approx(0.5 * (0.5 + 0.5 * 3 / 4) + 0.5 * 1 / 4)
    metrics = episode.metrics()
    assert metrics["given"] == 0.75 and metrics["format"] == pytest.approx(0.875)
    assert metrics["score"] == 0.25


def test_temporal_clue_lines_outside_the_answer_tags_earn_format_but_score_nothing() -> None:
    episode = ShapedTemporalClueEpisode(ClueScenario(seed=0))
    solution = episode.puzzle.solution
    episode.step(text_choice(f"suspect: {solution.suspect}\nweapon: {solution.weapon}"))
    assert episode.outcome == "no_answer"
    assert episode.reward() == pytest.approx(0.5 * 0.5 * 2 / 4)
    metrics = episode.metrics()
    assert metrics["given"] == 0.0 and metrics["format"] == 0.25 and metrics["score"] == 0.0


SUMMARIES = {
    "tic-tac-toe": "Task: tic-tac-toe against a random opponent",
    "2048": f"Task: 2048, {GAME_2048_TURNS} moves a game",
    "temporal-clue": "Task: Temporal Clue puzzles",
}


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.parametrize("task", list(SUMMARIES))
def test_a_game_runs_like_the_one_word_task(
    task: str, tmp_path: Path, tiny_model_path: Path
) -> None:
    home, out = tmp_path / "home", tmp_path / "out"
    process = start_demo(
        home,
        "--task", task,
        "--steps", "1",
        "--groups-per-step", "2",
        "--rollouts-per-group", "2",
        "--eval-questions", "2",
        "--base-model", str(tiny_model_path),
        "--output-dir", str(out),
    )  # fmt: skip
    output, _ = process.communicate(timeout=600)
    assert process.returncode == 0, output[-6000:]
    columns = TASKS[task].columns
    assert SUMMARIES[task] in output
    lines = output.splitlines()
    last_header = len(lines) - 1 - lines[::-1].index(report.header(columns))
    table = lines[last_header + 1 :][:2]
    assert [line.split()[0] for line in table] == ["0", "1"]
    with open(out / "rewards.csv") as handle:
        rows = list(csv.DictReader(handle))
    assert [int(row["step"]) for row in rows] == [0, 1]
    # The game's own score is a column beside the shaped reward.
    assert {f"eval_{column.key}" for column in columns} | {"eval_score"} <= set(rows[0])
    for row, line in zip(rows, table, strict=True):
        assert abs(float(line.split()[2]) - float(row["eval_reward"])) <= 0.0006, line
        assert abs(float(line.split()[-2]) - float(row["eval_score"])) <= 0.0006, line
    height, width, _ = matplotlib.image.imread(out / "rewards.png").shape
    assert width > 400 and height > 300
    assert_nothing_left(home)

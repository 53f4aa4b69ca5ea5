"""2048: board rules, the reward, and the conversation driven by model answers."""

from __future__ import annotations

import pytest

from skytrain_backend.games.episode import choice_message
from skytrain_backend.games.game_2048.env import (
    INVALID_MOVE_REWARD,
    WIN_REWARD,
    Game2048,
    score_game,
    slide,
    slide_row_left,
)
from skytrain_backend.games.game_2048.play import (
    Game2048Episode,
    parse_move,
)
from skytrain_backend.games.game_2048.play import (
    Game2048Scenario as Scenario,
)
from tests.examples.choices import text_choice


@pytest.mark.parametrize(
    ("row", "expected", "gained"),
    [
        ((2, 2, 0, 0), (4, 0, 0, 0), 4),
        ((2, 2, 2, 2), (4, 4, 0, 0), 8),
        ((2, 2, 2, 0), (4, 2, 0, 0), 4),
        ((4, 0, 4, 8), (8, 8, 0, 0), 8),  # a merged tile does not merge again in the same move
        ((2, 4, 8, 16), (2, 4, 8, 16), 0),
        ((0, 0, 0, 2), (2, 0, 0, 0), 0),
    ],
)
def test_slide_row_left_merges_each_pair_once(row, expected, gained):
    assert slide_row_left(row) == (expected, gained)


def test_slide_moves_tiles_in_each_direction():
    board = ((2, 0, 0, 2), (0, 4, 0, 0), (0, 4, 0, 0), (8, 0, 0, 0))
    assert slide(board, "left")[0] == ((4, 0, 0, 0), (4, 0, 0, 0), (4, 0, 0, 0), (8, 0, 0, 0))
    assert slide(board, "right")[0] == ((0, 0, 0, 4), (0, 0, 0, 4), (0, 0, 0, 4), (0, 0, 0, 8))
    assert slide(board, "up")[0] == ((2, 8, 0, 2), (8, 0, 0, 0), (0, 0, 0, 0), (0, 0, 0, 0))
    assert slide(board, "down")[0] == ((0, 0, 0, 0), (0, 0, 0, 0), (2, 0, 0, 0), (8, 8, 0, 2))


def test_slide_rejects_unknown_direction_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="left, right, up, down"):
        slide(((0, 0), (0, 0)), "diagonal")


def test_new_game_is_determined_by_its_seed():
    first, again, other = Game2048.new(7), Game2048.new(7), Game2048.new(8)
    assert first.board == again.board
    assert sum(value > 0 for row in first.board for value in row) == 2
    for direction in ("left", "up", "right", "down", "left"):
        first.move(direction)
        again.move(direction)
    assert first.board == again.board
    assert any(Game2048.new(seed).board != other.board for seed in range(5))


def test_move_that_changes_nothing_is_refused_and_spawns_nothing():
    game = Game2048.from_rows([[2, 4], [0, 0]])
    assert game.move("up") is False
    assert game.board == ((2, 4), (0, 0))
    assert game.moves == 0


def test_valid_move_merges_scores_and_spawns_one_tile():
    game = Game2048.from_rows([[2, 2, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    assert game.move("left") is True
    assert game.score == 4
    assert game.board[0][0] == 4
    assert game.total in (4 + 2, 4 + 4)  # the merged 4 and one spawned 2 or 4
    assert sum(value > 0 for row in game.board for value in row) == 2


def test_game_is_won_at_the_target_and_over_when_nothing_moves():
    assert Game2048.from_rows([[64, 0], [0, 0]], target=64).won
    assert not Game2048.from_rows([[32, 0], [0, 0]], target=64).won
    stuck = Game2048.from_rows([[2, 4], [4, 2]])
    assert stuck.over
    assert not Game2048.from_rows([[2, 2], [4, 8]]).over


def test_target_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        Game2048.new(0, target=100)


def test_reward_orders_invalid_below_progress_below_a_win():
    small = Game2048.from_rows([[2, 2], [0, 0]], target=64)
    bigger = Game2048.from_rows([[32, 4], [2, 0]], target=64)
    won = Game2048.from_rows([[64, 0], [0, 0]], target=64)
    assert score_game(bigger, invalid_move=True) == INVALID_MOVE_REWARD
    assert score_game(won) == WIN_REWARD
    assert INVALID_MOVE_REWARD < 0 < score_game(small) < score_game(bigger) < 1.2 < WIN_REWARD


@pytest.mark.parametrize(
    ("text", "move"),
    [
        ("<move>left</move>", "left"),
        ("I think up is best. <move> UP </move>", "up"),
        ("<move>left</move> no wait <move>down</move>", "down"),
        ("left", None),
        ("<move>diagonal</move>", None),
        ("<move>left", None),
    ],
)
def test_parse_move_reads_the_last_move_tag(text, move):
    assert parse_move(text) == move


def _first_valid_move(episode: Game2048Episode) -> str:
    return next(
        d
        for d in ("left", "right", "up", "down")
        if slide(episode.game.board, d)[0] != episode.game.board
    )


def test_episode_continues_with_the_new_board_after_a_valid_move():
    episode = Game2048Episode(Scenario(seed=3, target=64))
    move = _first_valid_move(episode)
    choice = text_choice(f"<move>{move}</move>")
    episode.step(choice)
    assert not episode.done
    assert episode.messages_and_choices[2] is choice
    assert episode.messages_and_choices[3] == {"role": "user", "content": episode.game.render()}
    assert episode.messages()[2] == {"role": "assistant", "content": f"<move>{move}</move>"}
    assert episode.metrics()["moves"] == 1
    assert 0 < episode.reward() < 1.2


@pytest.mark.parametrize("answer", ["I move left", "<move>sideways</move>"])
def test_episode_ends_with_the_penalty_on_an_unparseable_move(answer):
    episode = Game2048Episode(Scenario(seed=3))
    episode.step(text_choice(answer))
    assert episode.outcome == "invalid_move"
    assert episode.reward() == INVALID_MOVE_REWARD
    assert episode.metrics()["invalid_move"] is True
    assert len(episode.messages_and_choices) == 3  # no board after the last answer


def test_episode_ends_with_the_penalty_on_a_move_that_changes_nothing():
    episode = Game2048Episode(Scenario(seed=0))
    episode.game = Game2048.from_rows([[2, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4])
    episode.step(text_choice("<move>up</move>"))
    assert episode.outcome == "invalid_move"
    assert episode.reward() == INVALID_MOVE_REWARD


def test_episode_is_won_when_a_merge_reaches_the_target():
    episode = Game2048Episode(Scenario(seed=0, target=8))
    episode.game = Game2048.from_rows([[4, 4, 0, 0], [0] * 4, [0] * 4, [0] * 4], target=8)
    episode.step(text_choice("<move>left</move>"))
    assert episode.outcome == "won"
    assert episode.reward() == WIN_REWARD
    assert episode.metrics()["won"] is True


def test_episode_stops_at_the_turn_limit_and_refuses_further_turns():
    episode = Game2048Episode(Scenario(seed=5, target=2048), max_turns=2)
    for _ in range(2):
        episode.step(text_choice(f"<move>{_first_valid_move(episode)}</move>"))
    assert episode.outcome == "turn_limit"
    assert episode.metrics()["turn_limit"] is True
    assert isinstance(episode.messages_and_choices[-1], type(text_choice("")))
    assert episode.reward() > 0
    with pytest.raises(RuntimeError, match="already ended"):
        episode.step(text_choice("<move>left</move>"))


def test_choice_message_round_trips_the_answer_text():
    assert choice_message(text_choice("<move>up</move>")) == {
        "role": "assistant",
        "content": "<move>up</move>",
    }

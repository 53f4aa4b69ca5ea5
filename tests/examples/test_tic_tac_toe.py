"""Tic-tac-toe: rules, opponents, the reward, and the conversation driven by model answers."""

from __future__ import annotations

import random

import pytest

from skytrain_backend.games.tic_tac_toe.env import (
    DRAW_REWARD,
    INVALID_MOVE_REWARD,
    LOSS_REWARD,
    WIN_REWARD,
    TicTacToe,
    best_moves,
    cell_name,
    is_draw,
    legal_moves,
    parse_cell,
    score_outcome,
    winner,
)
from skytrain_backend.games.tic_tac_toe.play import (
    TicTacToeEpisode,
    parse_move,
)
from skytrain_backend.games.tic_tac_toe.play import (
    TicTacToeScenario as Scenario,
)
from tests.examples.choices import text_choice


def board(rows: str) -> tuple[str, ...]:
    """'XO.|.X.|..O' -> a board tuple ('.' is empty)."""
    return tuple(" " if c == "." else c for c in rows.replace("|", ""))


def _answered(rows: str, answer: str, scenario: Scenario | None = None) -> TicTacToeEpisode:
    """An episode (``Scenario(seed=0)`` unless given) on the board ``rows`` after the agent's
    ``answer``."""
    episode = TicTacToeEpisode(scenario or Scenario(seed=0))
    episode.game.board = board(rows)
    episode.step(text_choice(answer))
    return episode


@pytest.mark.parametrize(("text", "index"), [("A1", 0), ("b2", 4), (" C3 ", 8), ("C1", 2)])
def test_parse_cell_reads_column_then_row(text, index):
    assert parse_cell(text) == index
    assert cell_name(index) == text.strip().upper()


@pytest.mark.parametrize("text", ["D1", "A4", "B", "22", "centre", ""])
def test_parse_cell_refuses_cells_off_the_board(text):
    assert parse_cell(text) is None


def test_winner_finds_rows_columns_and_diagonals():
    assert winner(board("XXX|OO.|...")) == "X"
    assert winner(board("OX.|OX.|O..")) == "O"
    assert winner(board("X.O|.XO|..X")) == "X"
    assert winner(board("X.O|.OX|O..")) == "O"
    assert winner(board("XOX|XOO|OXX")) is None


def test_draw_is_a_full_board_without_a_line():
    full = board("XOX|XOO|OXX")
    assert is_draw(full)
    assert legal_moves(full) == []
    assert not is_draw(board("XXX|OOX|OXO"))  # full but won
    assert legal_moves(board("XXX|OO.|...")) == []  # no moves once someone has won


def test_minimax_takes_a_win_and_blocks_a_loss():
    assert best_moves(board("OO.|XX.|X.."), "O") == [2]
    assert best_moves(board("XX.|.O.|..."), "O") == [2]


def test_minimax_opponent_never_loses_to_a_random_agent():
    for seed in range(20):
        game = TicTacToe.new(seed, agent_first=True, opponent="minimax")
        agent_rng = random.Random(1000 + seed)
        while legal_moves(game.board):
            game.play(agent_rng.choice(legal_moves(game.board)), game.agent_mark)
            if legal_moves(game.board):
                game.opponent_move()
        assert winner(game.board) != game.agent_mark


def test_opponent_choices_are_fixed_by_the_seed():
    first = [TicTacToe.new(seed, agent_first=False).board for seed in range(10)]
    again = [TicTacToe.new(seed, agent_first=False).board for seed in range(10)]
    assert first == again
    assert len(set(first)) > 1
    assert all(b.count("X") == 1 and b.count("O") == 0 for b in first)


def test_unknown_opponent_is_refused_naming_the_allowed_ones():
    with pytest.raises(ValueError, match="random, minimax"):
        TicTacToe.new(0, opponent="genius")


def test_playing_a_taken_cell_raises():
    game = TicTacToe(board=board("X..|...|..."))
    with pytest.raises(ValueError, match="A1 is not a legal move"):
        game.play(0, "O")


def test_rewards_rank_win_draw_loss_invalid():
    assert score_outcome("win") == WIN_REWARD == 1.0
    assert score_outcome("draw") == DRAW_REWARD == 0.5
    assert score_outcome("loss") == LOSS_REWARD == 0.0
    assert score_outcome("invalid_move") == INVALID_MOVE_REWARD < 0


@pytest.mark.parametrize(
    ("text", "index"),
    [("<move>B2</move>", 4), ("Centre is strong. <move>b2</move>", 4), ("B2", None)],
)
def test_parse_move_needs_the_move_tag(text, index):
    assert parse_move(text) == index


def test_winning_move_ends_the_episode_with_a_win():
    episode = _answered("XX.|OO.|...", "<move>C1</move>")
    assert episode.outcome == "win"
    assert episode.reward() == WIN_REWARD
    assert episode.metrics()["win"] is True


def test_missing_the_block_loses_to_minimax():
    minimax = Scenario(seed=0, opponent="minimax")
    episode = _answered("X..|OO.|X..", "<move>B1</move>", minimax)  # leaves C2 open for O
    assert episode.outcome == "loss"
    assert episode.reward() == LOSS_REWARD


def test_last_free_cell_ends_in_a_draw():
    episode = _answered("XOX|XOO|OX.", "<move>C3</move>")
    assert episode.outcome == "draw"
    assert episode.reward() == DRAW_REWARD


@pytest.mark.parametrize("answer", ["<move>A1</move>", "<move>Z9</move>", "I pick the centre"])
def test_taken_unknown_or_missing_cell_is_invalid(answer):
    episode = _answered("X..|.O.|...", answer)
    assert episode.outcome == "invalid_move"
    assert episode.reward() == INVALID_MOVE_REWARD
    assert len(episode.messages_and_choices) == 3


def test_episode_shows_the_board_after_the_opponent_replies():
    episode = TicTacToeEpisode(Scenario(seed=4, agent_first=False))
    assert "You play tic-tac-toe as O" in str(episode.messages()[0]["content"])
    first_move = next(i for i in range(9) if episode.game.board[i] == " ")
    episode.step(text_choice(f"<move>{cell_name(first_move)}</move>"))
    assert not episode.done
    assert episode.game.board.count("X") == 2 and episode.game.board.count("O") == 1
    assert episode.messages()[-1]["content"] == f"{episode.game.render()}\nYour move."

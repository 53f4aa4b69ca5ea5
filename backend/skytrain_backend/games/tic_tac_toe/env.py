"""Tic-tac-toe rules, and opponents whose choices are fixed by a seed.

Cells are named by column letter and row number, ``A1`` (top left) to ``C3`` (bottom right),
``B2`` the centre. The board is a tuple of nine marks (``"X"``, ``"O"`` or ``" "``) read row
by row.
"""

from __future__ import annotations

import functools
import random
import re
from dataclasses import dataclass, field

Board = tuple[str, ...]
EMPTY = " "
EMPTY_BOARD: Board = (EMPTY,) * 9
COLUMNS = "ABC"
OPPONENTS = ("random", "minimax")
LINES = (
    (0, 1, 2),
    (3, 4, 5),
    (6, 7, 8),
    (0, 3, 6),
    (1, 4, 7),
    (2, 5, 8),
    (0, 4, 8),
    (2, 4, 6),
)
_CELL_RE = re.compile(r"^\s*([A-Ca-c])\s*([1-3])\s*$")


def check_opponent(opponent: str) -> None:
    if opponent not in OPPONENTS:
        raise ValueError(f"unknown opponent {opponent!r}; use one of {', '.join(OPPONENTS)}")


def cell_name(index: int) -> str:
    return f"{COLUMNS[index % 3]}{index // 3 + 1}"


def parse_cell(text: str) -> int | None:
    """The index of a cell written like ``B2`` (case and spaces ignored), or None."""
    match = _CELL_RE.match(text)
    if match is None:
        return None
    return (int(match.group(2)) - 1) * 3 + COLUMNS.index(match.group(1).upper())


def other(mark: str) -> str:
    return "O" if mark == "X" else "X"


def winner(board: Board) -> str | None:
    for a, b, c in LINES:
        if board[a] != EMPTY and board[a] == board[b] == board[c]:
            return board[a]
    return None


def legal_moves(board: Board) -> list[int]:
    if winner(board) is not None:
        return []
    return [i for i, mark in enumerate(board) if mark == EMPTY]


def is_draw(board: Board) -> bool:
    return winner(board) is None and EMPTY not in board


@functools.cache
def minimax_value(board: Board, to_move: str) -> int:
    """The game's value for ``to_move`` with perfect play from here: 1 win, 0 draw, -1 loss."""
    won = winner(board)
    if won is not None:
        return 1 if won == to_move else -1
    moves = legal_moves(board)
    if not moves:
        return 0
    return max(-minimax_value(_play(board, move, to_move), other(to_move)) for move in moves)


def _play(board: Board, index: int, mark: str) -> Board:
    return (*board[:index], mark, *board[index + 1 :])


def winning_moves(board: Board, mark: str) -> list[int]:
    """The free cells where ``mark`` would complete a line now."""
    return [move for move in legal_moves(board) if winner(_play(board, move, mark)) == mark]


def best_moves(board: Board, mark: str) -> list[int]:
    """Every move that keeps the best value minimax can reach for ``mark``."""
    values = {
        move: -minimax_value(_play(board, move, mark), other(mark)) for move in legal_moves(board)
    }
    best = max(values.values())
    return [move for move, value in values.items() if value == best]


@dataclass
class TicTacToe:
    """A game between the agent and an opponent; the seed fixes the opponent's choices."""

    agent_mark: str = "X"
    opponent: str = "random"
    board: Board = EMPTY_BOARD
    rng: random.Random = field(default_factory=random.Random)

    def __post_init__(self) -> None:
        check_opponent(self.opponent)
        if self.agent_mark not in ("X", "O"):
            raise ValueError(f"agent_mark must be 'X' or 'O', got {self.agent_mark!r}")

    @classmethod
    def new(cls, seed: int, *, agent_first: bool = True, opponent: str = "random") -> TicTacToe:
        """X moves first: the agent plays X when it starts, and O after the opponent's move."""
        game = cls(
            agent_mark="X" if agent_first else "O", opponent=opponent, rng=random.Random(seed)
        )
        if not agent_first:
            game.opponent_move()
        return game

    @property
    def opponent_mark(self) -> str:
        return other(self.agent_mark)

    def play(self, index: int, mark: str) -> None:
        if index not in legal_moves(self.board):
            raise ValueError(f"{cell_name(index)} is not a legal move on this board")
        self.board = _play(self.board, index, mark)

    def opponent_move(self) -> int:
        """Play and return the opponent's move: uniform over the legal moves, or minimax with
        ties broken at random."""
        if self.opponent == "minimax":
            candidates = best_moves(self.board, self.opponent_mark)
        else:
            candidates = legal_moves(self.board)
        move = self.rng.choice(candidates)
        self.play(move, self.opponent_mark)
        return move

    def render(self) -> str:
        rows = [
            f"{r + 1} "
            + " ".join(mark if mark != EMPTY else "." for mark in self.board[r * 3 : r * 3 + 3])
            for r in range(3)
        ]
        return "\n".join(["  " + " ".join(COLUMNS), *rows])


WIN_REWARD = 1.0
DRAW_REWARD = 0.5
LOSS_REWARD = 0.0
INVALID_MOVE_REWARD = -1.0
OUTCOME_REWARDS = {
    "win": WIN_REWARD,
    "draw": DRAW_REWARD,
    "loss": LOSS_REWARD,
    "invalid_move": INVALID_MOVE_REWARD,
}


def score_outcome(outcome: str | None) -> float:
    """Win 1, draw 0.5, loss 0, invalid move -1; an unfinished game scores like a loss."""
    return OUTCOME_REWARDS.get(outcome or "", LOSS_REWARD)

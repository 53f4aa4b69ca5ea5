"""The rules of 2048 on a square board, with a seeded random tile spawner.

Tiles slide as far as they go in the chosen direction; two equal tiles that meet merge into
one of twice the value, and a tile produced by a merge does not merge again in the same move.
After every move that changes the board a 2 (nine times in ten) or a 4 appears on a random
empty cell. The game is won when a tile reaches the target and over when no move changes the
board.
"""

from __future__ import annotations

import math
import random
from collections.abc import Sequence
from dataclasses import dataclass, field

Board = tuple[tuple[int, ...], ...]
DIRECTIONS = ("left", "right", "up", "down")


def slide_row_left(row: Sequence[int]) -> tuple[tuple[int, ...], int]:
    """Slide and merge one row towards its start; return the new row and the points gained."""
    tiles = [value for value in row if value]
    merged: list[int] = []
    gained = 0
    i = 0
    while i < len(tiles):
        if i + 1 < len(tiles) and tiles[i] == tiles[i + 1]:
            merged.append(tiles[i] * 2)
            gained += tiles[i] * 2
            i += 2
        else:
            merged.append(tiles[i])
            i += 1
    return tuple(merged + [0] * (len(row) - len(merged))), gained


def _transpose(board: Board) -> Board:
    return tuple(zip(*board, strict=True))


def slide(board: Board, direction: str) -> tuple[Board, int]:
    """The board after sliding it in ``direction`` (no spawn), and the points gained."""
    if direction not in DIRECTIONS:
        raise ValueError(f"unknown direction {direction!r}; use one of {', '.join(DIRECTIONS)}")
    # Every direction is "left" seen from another side: reverse rows for right, transpose for
    # up, both for down, then undo the same view.
    rows = _transpose(board) if direction in ("up", "down") else board
    reverse = direction in ("right", "down")
    new_rows = []
    gained = 0
    for row in rows:
        new_row, points = slide_row_left(row[::-1] if reverse else row)
        new_rows.append(new_row[::-1] if reverse else new_row)
        gained += points
    result = tuple(new_rows)
    return (_transpose(result) if direction in ("up", "down") else result), gained


def check_target(target: int) -> None:
    if target < 4 or target & (target - 1):
        raise ValueError(f"target must be a power of two of at least 4, got {target}")


def check_size(size: int) -> None:
    if size < 2:
        raise ValueError(f"size must be at least 2, got {size}")


@dataclass
class Game2048:
    """A game in progress. Build one with ``new`` (seeded start) or ``from_rows`` (any board)."""

    board: Board
    target: int = 2048
    rng: random.Random = field(default_factory=random.Random)
    score: int = 0
    moves: int = 0

    @classmethod
    def new(cls, seed: int, *, size: int = 4, target: int = 2048) -> Game2048:
        """A fresh game with two spawned tiles; the same seed always gives the same game."""
        check_size(size)
        check_target(target)
        game = cls(board=((0,) * size,) * size, target=target, rng=random.Random(seed))
        game.spawn()
        game.spawn()
        return game

    @classmethod
    def from_rows(
        cls, rows: Sequence[Sequence[int]], *, seed: int = 0, target: int = 2048
    ) -> Game2048:
        """A game starting from the given board (for tests and hand-made positions)."""
        check_target(target)
        board = tuple(tuple(row) for row in rows)
        if any(len(row) != len(board) for row in board):
            raise ValueError("the board must be square")
        return cls(board=board, target=target, rng=random.Random(seed))

    def spawn(self) -> None:
        empty = [
            (r, c) for r, row in enumerate(self.board) for c, value in enumerate(row) if not value
        ]
        if not empty:
            return
        r, c = self.rng.choice(empty)
        value = 4 if self.rng.random() < 0.1 else 2
        rows = [list(row) for row in self.board]
        rows[r][c] = value
        self.board = tuple(tuple(row) for row in rows)

    def move(self, direction: str) -> bool:
        """Play a move; False (and nothing changes) when it would not move any tile."""
        new_board, gained = slide(self.board, direction)
        if new_board == self.board:
            return False
        self.board = new_board
        self.score += gained
        self.moves += 1
        self.spawn()
        return True

    @property
    def max_tile(self) -> int:
        return max(max(row) for row in self.board)

    @property
    def total(self) -> int:
        return sum(sum(row) for row in self.board)

    @property
    def won(self) -> bool:
        return self.max_tile >= self.target

    @property
    def over(self) -> bool:
        """No move changes the board any more."""
        return all(slide(self.board, direction)[0] == self.board for direction in DIRECTIONS)

    def render(self) -> str:
        width = len(str(self.max_tile))
        return "\n".join(
            " ".join((str(value) if value else "_").rjust(width) for value in row)
            for row in self.board
        )


INVALID_MOVE_REWARD = -1.0
WIN_REWARD = 2.0


def score_game(game: Game2048, *, invalid_move: bool = False) -> float:
    """The reward of a finished (or stopped) game.

    An invalid move scores -1 and a win 2. Otherwise the reward grows with the log of the
    largest tile (most of it, since reaching bigger tiles is the goal) and of the board's total
    value (a small part, which rewards keeping tiles alive): both are in [0, 1), so any game
    short of the target scores between 0 and 1.2, below a win and above an invalid move.
    """
    if invalid_move:
        return INVALID_MOVE_REWARD
    if game.won:
        return WIN_REWARD
    cells = len(game.board) ** 2
    max_tile_part = math.log2(game.max_tile) / math.log2(game.target)
    board_part = math.log2(game.total) / math.log2(game.target * cells)
    return max_tile_part + 0.2 * board_part

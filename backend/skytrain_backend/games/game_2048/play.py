"""The 2048 conversation: the board each turn, ``<move>direction</move>`` back."""

from __future__ import annotations

from dataclasses import dataclass

from openai.types.chat.chat_completion import Choice

from skytrain_backend.games.episode import Episode, Message, Metadata, Scalar, last_tag
from skytrain_backend.games.game_2048.env import (
    DIRECTIONS,
    Game2048,
    check_size,
    check_target,
    score_game,
)

SYSTEM_PROMPT = (
    "You play 2048. A move slides every tile left, right, up or down; two equal tiles that "
    "meet merge into their sum. Reach a {target} tile. Answer with your move only, like "
    "<move>left</move>."
)


@dataclass(frozen=True)
class Game2048Scenario:
    """One game to play: the seed fixes the spawned tiles, ``target`` the winning tile."""

    seed: int
    target: int = 2048
    size: int = 4

    def __post_init__(self) -> None:
        check_target(self.target)
        check_size(self.size)


def parse_move(text: str) -> str | None:
    """The direction in the answer's last ``<move>`` tag, or None if there is no valid one."""
    move = last_tag(text, "move")
    if move is None or move.lower() not in DIRECTIONS:
        return None
    return move.lower()


class Game2048Episode(Episode):
    """A game of 2048 as a conversation.

    A missing or unknown move, or one that would not move any tile, is invalid and ends the
    game with the invalid-move penalty: a move that changes nothing would leave the model
    repeating itself until the turn limit.
    """

    def __init__(self, scenario: Game2048Scenario, *, max_turns: int = 40) -> None:
        self.scenario = scenario
        self.game = Game2048.new(scenario.seed, size=scenario.size, target=scenario.target)
        self.invalid_move = False
        super().__init__(
            system=SYSTEM_PROMPT.format(target=scenario.target),
            user=self._prompt(),
            max_turns=max_turns,
        )

    def react(self, choice: Choice) -> list[Message]:
        move = parse_move(choice.message.content or "")
        if move is None or not self.game.move(move):
            self.invalid_move = True
            self.finish("invalid_move")
            return []
        if self.game.won:
            self.finish("won")
        elif self.game.over:
            self.finish("game_over")
        return [] if self.done else [{"role": "user", "content": self._prompt()}]

    def _prompt(self) -> str:
        """What the model sees before each move: the board."""
        return self.game.render()

    def reward(self) -> float:
        return score_game(self.game, invalid_move=self.invalid_move)

    def metrics(self) -> dict[str, Scalar]:
        return {
            **super().metrics(),
            "max_tile": self.game.max_tile,
            "board_total": self.game.total,
            "moves": self.game.moves,
            "won": self.game.won,
            "invalid_move": self.invalid_move,
        }

    def metadata(self) -> Metadata:
        return {**super().metadata(), "seed": self.scenario.seed, "target": self.scenario.target}

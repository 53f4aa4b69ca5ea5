"""The tic-tac-toe conversation: the board each turn, ``<move>B2</move>`` back."""

from __future__ import annotations

from dataclasses import dataclass

from openai.types.chat.chat_completion import Choice

from skytrain_backend.games.episode import Episode, Message, Metadata, Scalar, last_tag
from skytrain_backend.games.tic_tac_toe.env import (
    TicTacToe,
    check_opponent,
    is_draw,
    legal_moves,
    parse_cell,
    score_outcome,
    winner,
)

SYSTEM_PROMPT = (
    "You play tic-tac-toe as {mark}. Get three in a row. Cells are a column A-C and a row 1-3; "
    "B2 is the centre. Answer with a free cell only, like <move>B2</move>."
)


@dataclass(frozen=True)
class TicTacToeScenario:
    """One game: the seed fixes the opponent's choices; the agent moves first or second."""

    seed: int
    agent_first: bool = True
    opponent: str = "random"

    def __post_init__(self) -> None:
        check_opponent(self.opponent)


def parse_move(text: str) -> int | None:
    """The cell index in the answer's last ``<move>`` tag, or None if it names no cell."""
    move = last_tag(text, "move")
    return None if move is None else parse_cell(move)


class TicTacToeEpisode(Episode):
    """A game of tic-tac-toe as a conversation; a missing, unknown or taken cell ends it."""

    def __init__(self, scenario: TicTacToeScenario, *, max_turns: int = 5) -> None:
        self.scenario = scenario
        self.game = TicTacToe.new(
            scenario.seed, agent_first=scenario.agent_first, opponent=scenario.opponent
        )
        super().__init__(
            system=SYSTEM_PROMPT.format(mark=self.game.agent_mark),
            user=self._prompt(),
            max_turns=max_turns,
        )

    def _prompt(self) -> str:
        return f"{self.game.render()}\nYour move."

    def react(self, choice: Choice) -> list[Message]:
        move = parse_move(choice.message.content or "")
        if move is None or move not in legal_moves(self.game.board):
            self.finish("invalid_move")
            return []
        self.game.play(move, self.game.agent_mark)
        if self._finished():
            return []
        self.game.opponent_move()
        if self._finished():
            return []
        return [{"role": "user", "content": self._prompt()}]

    def _finished(self) -> bool:
        won = winner(self.game.board)
        if won is not None:
            self.finish("win" if won == self.game.agent_mark else "loss")
        elif is_draw(self.game.board):
            self.finish("draw")
        return self.done

    def reward(self) -> float:
        return score_outcome(self.outcome)

    def metrics(self) -> dict[str, Scalar]:
        return {
            **super().metrics(),
            "win": self.outcome == "win",
            "draw": self.outcome == "draw",
            "loss": self.outcome == "loss",
            "invalid_move": self.outcome == "invalid_move",
        }

    def metadata(self) -> Metadata:
        return {
            **super().metadata(),
            "seed": self.scenario.seed,
            "agent_first": self.scenario.agent_first,
            "opponent": self.scenario.opponent,
            "final_board": self.game.render(),
        }

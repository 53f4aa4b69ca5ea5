"""The tasks ``skytrain demo --task`` trains on: the one-word answer, and the seed's games.

A task gives the training loop its scenarios (training and held-out), plays one rollout of a
scenario through the model's OpenAI endpoint with seeded sampling, and names the metrics the
table shows besides the reward. The games are the examples' own (``skytrain_backend.games``: the same
prompts, rules and answer formats: an answer the game cannot read still ends it); only the
reward the demo trains on is shaped, because the game's own reward is too sparse for a 135M
model to find in minutes (SmolLM2-135M never writes a ``<move>`` tag unprompted):

- Format credit (``format_credit``), for an answer the game refused: a quarter each for the
  opening tag, the closing tag, a word the game accepts (a cell, a direction) anywhere, and
  an answer of at most three words.
- ``tic-tac-toe``: half the mean quality of the agent's moves (a legal move 1, or 0.5 when it
  misses a win it could take or a block of the opponent's win; a refused one 0.4 x its format
  credit), half the outcome (win 1, draw 0.5, loss or invalid move 0). The game's own score
  (win 1, draw 0.5, loss 0, invalid move -1) is the ``score`` column. Each board is followed
  by its free cells and the answer format with the first of them (``FREE_CELLS``), where the
  example says "Your move."; a refused move's format credit counts the cell and the brevity
  only beside an opening ``<move>`` tag. The rules and the format the game accepts are
  unchanged.
- ``2048``: at most ``GAME_2048_TURNS`` moves; each scores 0.5 when it moves a tile, 1 when it
  also merges tiles, and 0.4 x its format credit otherwise (the direction and the brevity
  only beside an opening ``<move>`` tag), summed and divided by the turn limit. The game's own
  reward (log of the largest tile and of the board's total, -1 for an invalid move) is the
  ``score`` column. Each board is followed by the directions that move a tile and the answer
  format with the first of them (``MOVING_DIRECTIONS``), as tic-tac-toe shows its free cells.
- ``temporal-clue``: half the format (a quarter each for the opening and closing ``<answer>``
  tags, half the share of the four ``key: value`` lines written), half the share answered
  right (the game's own reward, the ``score`` column).

Each task has its ``Recipe``: what ``skytrain demo --task`` trains it with unless told
otherwise.

Training scenarios are seeds below ``EVAL_SEED_OFFSET``; the held-out ones start there, as in
the examples, so the eval plays games training never meets.
"""

from __future__ import annotations

import abc
import random
import re
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

from openai.types.chat.chat_completion import Choice

import skytrain
from skytrain_backend.demo import task as one_word
from skytrain_backend.games.episode import Episode, Message, Scalar
from skytrain_backend.games.game_2048 import play as game_2048
from skytrain_backend.games.game_2048.env import DIRECTIONS, slide
from skytrain_backend.games.temporal_clue import play as temporal_clue
from skytrain_backend.games.temporal_clue.puzzle import QUESTIONS
from skytrain_backend.games.tic_tac_toe import play as tic_tac_toe
from skytrain_backend.games.tic_tac_toe.env import (
    cell_name,
    legal_moves,
    score_outcome,
    winning_moves,
)

ScenarioT = TypeVar("ScenarioT")
EVAL_SEED_OFFSET = 1_000_000
TRAIN_SCENARIOS = 256
HELD_OUT_SCENARIOS = 16
GAME_2048_TURNS = 8
# The most a move the game refused earns, with a perfect format credit: below any legal move.
REFUSED_MOVE_WEIGHT = 0.4
# What the demo shows after each tic-tac-toe board instead of the example's "Your move.": the
# free cells, and the answer format with the first of them (a bare list of cells alone taught
# SmolLM2 to answer a bare cell, which the game refuses: bench/README.md).
FREE_CELLS = "Free cells: {free}. Answer with one of them, like <move>{first}</move>."
# After each 2048 board: the directions the game accepts there (one that moves no tile ends
# the game as an unreadable answer does).
MOVING_DIRECTIONS = (
    "Moves that change the board: {moving}. Answer with one of them, like <move>{first}</move>."
)
_CELL_WORD = re.compile(r"\b[A-C][1-3]\b", re.IGNORECASE)
_DIRECTION_WORD = re.compile(r"\b(left|right|up|down)\b", re.IGNORECASE)


def format_credit(text: str, tag: str, word: re.Pattern[str], *, tag_first: bool = False) -> float:
    """How near an answer came to ``<tag>WORD</tag>``, 0 to 1: a quarter each for the opening
    tag, the closing tag, a ``word`` anywhere, and at most three words in all.

    With ``tag_first`` the word and the brevity count only beside the opening tag, so that a
    bare word (``B2``), which the game refuses, earns nothing: otherwise it earns half, and
    SmolLM2, for which a bare word is far likelier than the tags, settles there (bench/README.md).
    """
    lowered = text.lower()
    opened = f"<{tag}>" in lowered
    parts = (
        opened,
        f"</{tag}>" in lowered,
        word.search(text) is not None and (opened or not tag_first),
        0 < len(text.split()) <= 3 and (opened or not tag_first),
    )
    return sum(parts) / len(parts)


def sampling_seed(*parts: object) -> int:
    """A seed for one sampled answer, the same in every run for the same ``parts`` (a string
    seeds ``random`` through SHA-512, whatever the interpreter's hash seed)."""
    return random.Random("/".join(map(str, parts))).getrandbits(31)


@dataclass(frozen=True)
class Column:
    """A metric the table shows: its key in the trajectories' metrics and its header."""

    key: str
    header: str
    percent: bool = True

    def format(self, value: float) -> str:
        return f"{value:.0%}" if self.percent else f"{value:.3f}"


@dataclass(frozen=True)
class Recipe:
    """What ``skytrain demo --task`` trains a task with unless told otherwise: measured on
    SmolLM2-135M on 2 CPU cores (bench/README.md)."""

    steps: int = 12
    groups_per_step: int = 8
    rollouts_per_group: int = 4
    learning_rate: float = 5e-4
    temperature: float = 1.0


class DemoTask(abc.ABC, Generic[ScenarioT]):
    """What the demo's loop needs of a task."""

    recipe: Recipe = Recipe()

    name: str
    # Shown in the "training:" line and the plot's title.
    summary: str
    # What one group is sampled for: "questions", "games", "puzzles".
    unit: str
    columns: tuple[Column, ...]
    max_tokens: int

    @abc.abstractmethod
    def split(self) -> tuple[list[ScenarioT], list[ScenarioT]]:
        """The training scenarios and the held-out ones (at least ``HELD_OUT_SCENARIOS``)."""

    @abc.abstractmethod
    def label(self, scenario: ScenarioT) -> str:
        """What names the scenario in the sampling seeds and the trajectory's metadata."""

    @abc.abstractmethod
    async def rollout(
        self, model: skytrain.Model, scenario: ScenarioT, *, temperature: float, seed: int
    ) -> skytrain.Trajectory:
        """One scored rollout of ``scenario``, every completion sampled from ``seed``."""


class OneWordTask(DemoTask[one_word.Question]):
    name = "one-word"
    summary = f"'{one_word.INSTRUCTION}'"
    unit = "questions"
    columns = (Column("one_word", "one-word"), Column("correct", "correct"))
    max_tokens = 16

    def split(self) -> tuple[list[one_word.Question], list[one_word.Question]]:
        return one_word.split_questions()

    def label(self, scenario: one_word.Question) -> str:
        return scenario.text

    async def rollout(
        self,
        model: skytrain.Model,
        scenario: one_word.Question,
        *,
        temperature: float,
        seed: int,
    ) -> skytrain.Trajectory:
        messages = scenario.messages()
        completion = await model.openai_client().chat.completions.create(
            model=model.get_inference_name(),
            messages=messages,  # type: ignore[arg-type]
            max_tokens=self.max_tokens,
            temperature=temperature,
            seed=seed,
        )
        choice = completion.choices[0]
        result = one_word.score(
            scenario, choice.message.content or "", finish_reason=choice.finish_reason
        )
        return skytrain.Trajectory(
            messages_and_choices=[*messages, choice],
            reward=result.reward,
            metrics=result.metrics(),
            metadata={"question": scenario.text},
        )


class GameTask(DemoTask[ScenarioT]):
    """A game played as a conversation of ``Episode`` turns, one completion per turn."""

    @abc.abstractmethod
    def scenario(self, seed: int) -> ScenarioT: ...

    @abc.abstractmethod
    def episode(self, scenario: ScenarioT) -> Episode: ...

    def split(self) -> tuple[list[ScenarioT], list[ScenarioT]]:
        train = [self.scenario(seed) for seed in range(TRAIN_SCENARIOS)]
        held_out = [self.scenario(EVAL_SEED_OFFSET + i) for i in range(HELD_OUT_SCENARIOS)]
        return train, held_out

    def label(self, scenario: ScenarioT) -> str:
        return f"seed {scenario.seed}"  # type: ignore[attr-defined]

    async def rollout(
        self, model: skytrain.Model, scenario: ScenarioT, *, temperature: float, seed: int
    ) -> skytrain.Trajectory:
        episode = self.episode(scenario)
        client = model.openai_client()
        while not episode.done:
            completion = await client.chat.completions.create(
                model=model.get_inference_name(),
                messages=episode.messages(),
                max_tokens=self.max_tokens,
                temperature=temperature,
                seed=sampling_seed(seed, episode.turns),
            )
            episode.step(completion.choices[0])
        return skytrain.Trajectory(
            messages_and_choices=episode.messages_and_choices,
            reward=episode.reward(),
            metrics=episode.metrics(),
            metadata=episode.metadata(),
        )


class ShapedTicTacToeEpisode(tic_tac_toe.TicTacToeEpisode):
    """The example's game, rewarded for each move's quality as well as for the outcome; each
    board is followed by its free cells (``FREE_CELLS``), so a legal move is one to copy."""

    def __init__(self, scenario: tic_tac_toe.TicTacToeScenario) -> None:
        super().__init__(scenario)
        self.move_quality: list[float] = []

    def _prompt(self) -> str:
        free = [cell_name(index) for index in legal_moves(self.game.board)]
        return f"{self.game.render()}\n{FREE_CELLS.format(free=', '.join(free), first=free[0])}"

    def react(self, choice: Choice) -> list[Message]:
        board, mark = self.game.board, self.game.agent_mark
        move = tic_tac_toe.parse_move(choice.message.content or "")
        wins = winning_moves(board, mark)
        blocks = winning_moves(board, self.game.opponent_mark)
        if move is None or move not in legal_moves(board):
            text = choice.message.content or ""
            quality = REFUSED_MOVE_WEIGHT * format_credit(text, "move", _CELL_WORD, tag_first=True)
        elif wins:
            quality = 1.0 if move in wins else 0.5
        elif blocks:
            quality = 1.0 if move in blocks else 0.5
        else:
            quality = 1.0
        self.move_quality.append(quality)
        return super().react(choice)

    def reward(self) -> float:
        moves = sum(self.move_quality) / len(self.move_quality) if self.move_quality else 0.0
        outcome = max(score_outcome(self.outcome), 0.0)
        return 0.5 * moves + 0.5 * outcome

    def metrics(self) -> dict[str, Scalar]:
        legal = [quality >= 0.5 for quality in self.move_quality]
        return {
            **super().metrics(),
            "legal": sum(legal) / len(legal) if legal else 0.0,
            "score": score_outcome(self.outcome),
        }


class TicTacToeTask(GameTask[tic_tac_toe.TicTacToeScenario]):
    name = "tic-tac-toe"
    summary = "tic-tac-toe against a random opponent"
    unit = "games"
    # Measured on 3 seeds (bench/README.md, "The seed's games").
    recipe = Recipe(steps=8, learning_rate=2e-3)
    columns = (Column("legal", "legal"), Column("win", "won"), Column("score", "score", False))
    max_tokens = 24

    def scenario(self, seed: int) -> tic_tac_toe.TicTacToeScenario:
        # As in the example: on even seeds the agent moves first.
        return tic_tac_toe.TicTacToeScenario(seed=seed, agent_first=seed % 2 == 0)

    def episode(self, scenario: tic_tac_toe.TicTacToeScenario) -> Episode:
        return ShapedTicTacToeEpisode(scenario)


class Shaped2048Episode(game_2048.Game2048Episode):
    """The example's game, cut to ``GAME_2048_TURNS`` moves, rewarded for each valid move and
    more for each that merges tiles; each board is followed by the directions that move a tile
    (``MOVING_DIRECTIONS``)."""

    def __init__(self, scenario: game_2048.Game2048Scenario) -> None:
        super().__init__(scenario, max_turns=GAME_2048_TURNS)
        self.move_quality: list[float] = []

    def _prompt(self) -> str:
        board = self.game.board
        moving = [direction for direction in DIRECTIONS if slide(board, direction)[0] != board]
        shown = MOVING_DIRECTIONS.format(moving=", ".join(moving), first=moving[0])
        return f"{self.game.render()}\n{shown}"

    def react(self, choice: Choice) -> list[Message]:
        board, text = self.game.board, choice.message.content or ""
        move = game_2048.parse_move(text)
        credit = format_credit(text, "move", _DIRECTION_WORD, tag_first=True)
        quality = REFUSED_MOVE_WEIGHT * credit
        if move is not None and (after := slide(board, move)[0]) != board:
            tiles = sum(1 for row in board for value in row if value)
            merged = sum(1 for row in after for value in row if value) < tiles
            quality = 1.0 if merged else 0.5
        self.move_quality.append(quality)
        return super().react(choice)

    def reward(self) -> float:
        return sum(self.move_quality) / self.max_turns

    def metrics(self) -> dict[str, Scalar]:
        turns = self.max_turns
        return {
            **super().metrics(),
            "valid": sum(quality >= 0.5 for quality in self.move_quality) / turns,
            "merged": sum(quality == 1.0 for quality in self.move_quality) / turns,
            "score": super().reward(),
        }


class Game2048Task(GameTask[game_2048.Game2048Scenario]):
    name = "2048"
    summary = f"2048, {GAME_2048_TURNS} moves a game"
    unit = "games"
    # Tic-tac-toe's, measured on SmolLM2 (bench/README.md, "The seed's games").
    recipe = Recipe(steps=8, learning_rate=2e-3)
    columns = (
        Column("valid", "valid"),
        Column("merged", "merged"),
        Column("score", "score", False),
    )
    max_tokens = 16

    def scenario(self, seed: int) -> game_2048.Game2048Scenario:
        return game_2048.Game2048Scenario(seed=seed)

    def episode(self, scenario: game_2048.Game2048Scenario) -> Episode:
        return Shaped2048Episode(scenario)


class ShapedTemporalClueEpisode(temporal_clue.TemporalClueEpisode):
    """The example's puzzle, rewarded for answering in the format as well as for being right."""

    def __init__(self, scenario: temporal_clue.TemporalClueScenario) -> None:
        super().__init__(scenario)
        self.given = 0
        self.format = 0.0

    def react(self, choice: Choice) -> list[Message]:
        text = choice.message.content or ""
        answer = temporal_clue.parse_answer(text)
        self.given = sum(1 for question in QUESTIONS if question in answer)
        lowered = text.lower()
        lines = sum(
            1
            for question in QUESTIONS
            if re.search(rf"^\s*{question}\s*:\s*\S", text, re.IGNORECASE | re.MULTILINE)
        )
        self.format = (
            0.25 * ("<answer>" in lowered)
            + 0.25 * ("</answer>" in lowered)
            + 0.5 * lines / len(QUESTIONS)
        )
        return super().react(choice)

    def reward(self) -> float:
        return 0.5 * self.format + 0.5 * super().reward()

    def metrics(self) -> dict[str, Scalar]:
        return {
            **super().metrics(),
            "given": self.given / len(QUESTIONS),
            "format": self.format,
            "score": super().reward(),
        }


class TemporalClueTask(GameTask[temporal_clue.TemporalClueScenario]):
    name = "temporal-clue"
    summary = "Temporal Clue puzzles (3 suspects, weapons, rooms; 4 hours)"
    unit = "puzzles"
    columns = (Column("format", "format"), Column("score", "score", False))
    max_tokens = 128

    def scenario(self, seed: int) -> temporal_clue.TemporalClueScenario:
        return temporal_clue.TemporalClueScenario(seed=seed)

    def episode(self, scenario: temporal_clue.TemporalClueScenario) -> Episode:
        return ShapedTemporalClueEpisode(scenario)


TASKS: dict[str, DemoTask[Any]] = {
    task.name: task for task in (OneWordTask(), TicTacToeTask(), Game2048Task(), TemporalClueTask())
}


def get_task(name: str) -> DemoTask[Any]:
    """The task named ``name``; a ValueError naming the choices otherwise."""
    try:
        return TASKS[name]
    except KeyError:
        raise ValueError(f"unknown task {name!r}; use one of {', '.join(TASKS)}") from None

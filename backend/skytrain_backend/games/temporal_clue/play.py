"""The Temporal Clue prompt, the answer format, and the reward."""

from __future__ import annotations

import re
from dataclasses import dataclass

from openai.types.chat.chat_completion import Choice

from skytrain_backend.games.episode import Episode, Message, Metadata, Scalar, last_tag
from skytrain_backend.games.temporal_clue.puzzle import (
    QUESTIONS,
    Puzzle,
    Solution,
    check_sizes,
    generate_puzzle,
)

SYSTEM_PROMPT = (
    "Solve the murder mystery from the clues. Reason briefly, then answer exactly in this "
    "format:\n<answer>\nsuspect: <name>\nweapon: <weapon>\nroom: <room>\ntime: <time>\n</answer>"
)
_ANSWER_LINE = re.compile(r"^\s*(suspect|weapon|room|time)\s*:\s*(.+?)\s*$", re.IGNORECASE)


@dataclass(frozen=True)
class TemporalClueScenario:
    """One puzzle: its seed and its size."""

    seed: int
    suspects: int = 3
    weapons: int = 3
    rooms: int = 3
    hours: int = 4

    def __post_init__(self) -> None:
        check_sizes(
            suspects=self.suspects, weapons=self.weapons, rooms=self.rooms, hours=self.hours
        )

    def puzzle(self) -> Puzzle:
        return generate_puzzle(
            self.seed,
            suspects=self.suspects,
            weapons=self.weapons,
            rooms=self.rooms,
            hours=self.hours,
        )


def _normalize(value: str) -> str:
    words = value.lower().replace(".", " ").split()
    if words and words[0] == "the":
        words = words[1:]
    return " ".join(words)


def parse_answer(text: str) -> dict[str, str]:
    """The ``key: value`` lines of the last ``<answer>`` block; empty when there is none.

    Only the four known keys are read; a key given twice keeps its last value.
    """
    block = last_tag(text, "answer")
    if block is None:
        return {}
    answer: dict[str, str] = {}
    for line in block.splitlines():
        match = _ANSWER_LINE.match(line)
        if match is not None:
            answer[match.group(1).lower()] = match.group(2)
    return answer


def score_answer(answer: dict[str, str], solution: Solution) -> dict[str, bool]:
    """Which of the four questions the answer gets right (case, "the" and dots ignored)."""
    return {
        question: _normalize(answer.get(question, "")) == _normalize(getattr(solution, question))
        for question in QUESTIONS
    }


class TemporalClueEpisode(Episode):
    """One puzzle, one answer: the reward is the fraction of the four questions answered right."""

    def __init__(self, scenario: TemporalClueScenario, *, max_turns: int = 1) -> None:
        self.scenario = scenario
        self.puzzle = scenario.puzzle()
        self.correct = dict.fromkeys(QUESTIONS, False)
        self.answered = False
        super().__init__(system=SYSTEM_PROMPT, user=self.puzzle.text(), max_turns=max_turns)

    def react(self, choice: Choice) -> list[Message]:
        answer = parse_answer(choice.message.content or "")
        self.answered = bool(answer)
        self.correct = score_answer(answer, self.puzzle.solution)
        self.finish("answered" if answer else "no_answer")
        return []

    def reward(self) -> float:
        return sum(self.correct.values()) / len(self.correct)

    def metrics(self) -> dict[str, Scalar]:
        return {
            **super().metrics(),
            "answered": self.answered,
            "solved": all(self.correct.values()),
            **{f"correct_{question}": ok for question, ok in self.correct.items()},
        }

    def metadata(self) -> Metadata:
        return {
            **super().metadata(),
            "seed": self.scenario.seed,
            "solution": vars(self.puzzle.solution),
        }

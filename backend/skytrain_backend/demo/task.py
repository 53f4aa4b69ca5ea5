"""The demo's task: answer a simple question with one word.

SmolLM2-135M-Instruct knows the answer to most of these questions but wraps it in a sentence
("The capital of France is Paris.") or rambles past the token limit, and now and then it does
answer with the bare word. That spread is what GRPO needs: within a group of answers to the
same question some score better than others, and the model learns to be brief (and, where it
knows, right) in a few minutes of CPU training.

The reward gives partial credit so that almost every group has variance:

- an answer cut off by the token limit (``finish_reason == "length"``) scores 0;
- otherwise ``BREVITY_WEIGHT / number of words``, so one word earns it all, two words half;
- plus ``CORRECTNESS_WEIGHT`` when one of the accepted answers is among the words.

The two weigh the same, so a right answer in a sentence still beats a wrong single word: the
top reward needs both, and dropping what the model knows to be brief does not pay.

The questions are a fixed local list; every fourth one is held out for evaluation, so the
eval reward measures a habit learned on other questions, not memorised answers.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

INSTRUCTION = "Answer with one word."
BREVITY_WEIGHT = 0.5
CORRECTNESS_WEIGHT = 0.5
HELD_OUT_EVERY = 4

_WORD_RE = re.compile(r"[a-z0-9]+(?:'[a-z]+)?")


@dataclass(frozen=True)
class Question:
    text: str
    answers: frozenset[str]

    def messages(self) -> list[dict[str, str]]:
        """The chat the model answers: the question and the one-word instruction."""
        return [{"role": "user", "content": f"{self.text} {INSTRUCTION}"}]


def _q(text: str, *answers: str) -> Question:
    return Question(text, frozenset(answers))


QUESTIONS: tuple[Question, ...] = (
    _q("What is the capital of France?", "paris"),
    _q("What color is the sky on a clear day?", "blue"),
    _q("Which animal says moo?", "cow", "cows"),
    _q("What do bees make?", "honey"),
    _q("What is frozen water called?", "ice"),
    _q("Which planet do we live on?", "earth"),
    _q("What is the opposite of hot?", "cold"),
    _q("What fruit is yellow and curved?", "banana", "bananas"),
    _q("What color is grass?", "green"),
    _q("Which animal barks?", "dog", "dogs"),
    _q("What do you call a baby cat?", "kitten"),
    _q("What is the largest ocean on Earth?", "pacific"),
    _q("What star is at the center of our solar system?", "sun"),
    _q("What is the opposite of day?", "night"),
    _q("Which season comes after winter?", "spring"),
    _q("What do cows drink?", "water"),
    _q("What color is snow?", "white"),
    _q("What is the capital of Italy?", "rome"),
    _q("Which bird is a symbol of peace?", "dove", "doves"),
    _q("What gas do humans breathe in to live?", "oxygen"),
    _q("What is the opposite of up?", "down"),
    _q("Which animal has a trunk?", "elephant", "elephants"),
    _q("What do you use to write on a blackboard?", "chalk"),
    _q("What is the capital of Japan?", "tokyo"),
    _q("What color is a ripe tomato?", "red"),
    _q("Which animal is known as the king of the jungle?", "lion", "lions"),
    _q("What falls from clouds when it rains?", "water", "rain", "raindrops"),
    _q("What is the opposite of big?", "small", "little", "tiny"),
    _q("What do you call a baby dog?", "puppy", "pup"),
    _q("Which meal do people eat in the morning?", "breakfast"),
    _q("What is the capital of England?", "london"),
    _q("What color are most leaves in summer?", "green"),
    _q("Which animal hops and carries its baby in a pouch?", "kangaroo", "kangaroos"),
    _q("What is the opposite of wet?", "dry"),
    _q("What do spiders spin?", "webs", "web", "silk"),
    _q("What is the capital of Germany?", "berlin"),
    _q("Which month comes after January?", "february"),
    _q("What do you call the home of a bee?", "hive", "beehive"),
    _q("What is the opposite of fast?", "slow"),
    _q("What color is a banana?", "yellow"),
    _q("Which sense do you use your nose for?", "smell", "smelling"),
    _q("What is the capital of Spain?", "madrid"),
    _q("What do you call a baby sheep?", "lamb"),
    _q("Which day comes after Monday?", "tuesday"),
    _q("What is the opposite of open?", "closed", "close", "shut"),
    _q("Which animal is the largest mammal?", "whale", "whales"),
    _q("What shines in the sky at night?", "moon", "stars", "star"),
    _q("What is the opposite of happy?", "sad", "unhappy"),
    _q("What color is coal?", "black"),
    _q("What do you call a baby horse?", "foal", "pony", "colt"),
    _q("What is the capital of Russia?", "moscow"),
    _q("Which insect makes honey?", "bee", "bees", "honeybee"),
    _q("What is the opposite of light?", "dark", "darkness", "heavy"),
    _q("What do fish live in?", "water"),
    _q("Which organ pumps blood through the body?", "heart"),
    _q("What is the capital of Egypt?", "cairo"),
    _q("What color is an orange?", "orange"),
    _q("Which animal has black and white stripes?", "zebra", "zebras"),
    _q("What is the opposite of old?", "young", "new"),
    _q("What do plants need from the sun?", "light", "sunlight", "energy"),
    _q("What is the capital of China?", "beijing"),
    _q("Which animal lays eggs and says cluck?", "chicken", "hen", "chickens", "hens"),
    _q("What is the opposite of full?", "empty"),
    _q("What do you drink when you are thirsty?", "water"),
)


def split_questions(
    questions: tuple[Question, ...] = QUESTIONS,
) -> tuple[list[Question], list[Question]]:
    """Training and held-out questions: every ``HELD_OUT_EVERY``-th one is held out."""
    train = [q for i, q in enumerate(questions) if i % HELD_OUT_EVERY != HELD_OUT_EVERY - 1]
    held_out = [q for i, q in enumerate(questions) if i % HELD_OUT_EVERY == HELD_OUT_EVERY - 1]
    return train, held_out


def words(text: str) -> list[str]:
    """The words of an answer, lowercased, without punctuation or markup."""
    return _WORD_RE.findall(text.lower())


@dataclass(frozen=True)
class Score:
    """An answer's reward and the parts it is made of (logged as trajectory metrics)."""

    reward: float
    num_words: int
    correct: bool
    truncated: bool

    def metrics(self) -> dict[str, float]:
        return {
            "num_words": float(self.num_words),
            "correct": float(self.correct),
            "one_word": float(self.num_words == 1 and not self.truncated),
            "truncated": float(self.truncated),
        }


def score(question: Question, answer: str, *, finish_reason: str | None) -> Score:
    """Reward one answer: brevity (if it finished) plus correctness, between 0 and 1."""
    found = words(answer)
    correct = any(word in question.answers for word in found)
    truncated = finish_reason == "length"
    if truncated or not found:
        return Score(0.0, len(found), correct, truncated)
    reward = BREVITY_WEIGHT / len(found) + CORRECTNESS_WEIGHT * correct
    return Score(reward, len(found), correct, truncated)

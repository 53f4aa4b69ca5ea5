"""The email agent's tools, its tool-calling conversation, and the reward.

The model gets three OpenAI tools: ``search_emails(keywords)``, ``read_email(id)`` and
``answer(text, source_id)``. Each sampled turn is kept as its ``Choice``; each tool result
goes back as a ``role: "tool"`` message answering its call id. The episode ends at the first
``answer`` call, at a turn without any tool call, at a malformed call, or at the turn limit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass
from typing import Any

from openai.types.chat import ChatCompletionToolParam
from openai.types.chat.chat_completion import Choice

from examples.email_search.inbox import (
    EmailScenario,
    Question,
    check_inbox_size,
    generate_scenario,
)
from skytrain_backend.games.episode import Episode, Message, Scalar

SYSTEM_PROMPT = (
    "You answer questions about the user's inbox. Find the email with search_emails, read it "
    "with read_email, then call answer with the answer and the id of the email it comes from."
)

TOOLS: list[ChatCompletionToolParam] = [
    {
        "type": "function",
        "function": {
            "name": "search_emails",
            "description": "Find emails containing any of the keywords; returns ids and snippets.",
            "parameters": {
                "type": "object",
                "properties": {
                    "keywords": {"type": "array", "items": {"type": "string"}, "minItems": 1}
                },
                "required": ["keywords"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "read_email",
            "description": "Read the full email with this id.",
            "parameters": {
                "type": "object",
                "properties": {"id": {"type": "string"}},
                "required": ["id"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "answer",
            "description": "Give the final answer and the id of the email it comes from.",
            "parameters": {
                "type": "object",
                "properties": {"text": {"type": "string"}, "source_id": {"type": "string"}},
                "required": ["text", "source_id"],
            },
        },
    },
]

ANSWER_CALL_REWARD = 0.1
CORRECT_REWARD = 0.6
CITED_REWARD = 0.3
EXTRA_TURN_PENALTY = 0.02
# search, read, answer: the turns a direct solution takes.
EXPECTED_TURNS = 3


class MalformedCall(ValueError):
    """A tool call the environment cannot run: unknown tool, bad JSON, wrong arguments."""


@dataclass(frozen=True)
class Scenario:
    """One inbox and question, fixed by the seed."""

    seed: int
    inbox_size: int = 20

    def __post_init__(self) -> None:
        check_inbox_size(self.inbox_size)

    def generate(self) -> EmailScenario:
        return generate_scenario(self.seed, size=self.inbox_size)


def _squash(text: str) -> str:
    """Lowercase without spaces or thousands separators: "8:30PM" matches "8:30 pm"."""
    return "".join(text.lower().replace(",", "").split())


def check_answer(question: Question, *, text: str, source_id: str) -> tuple[bool, bool]:
    """Whether the answer contains the expected value, and whether it cites its email."""
    return _squash(question.answer) in _squash(text), source_id.strip() == question.source_id


def score_answer(question: Question, *, text: str, source_id: str, turns: int) -> float:
    """Reward of an ``answer`` call.

    Calling ``answer`` well-formed earns 0.1, an answer containing the expected value 0.6 more
    and citing the email it is in 0.3 more; every turn beyond search-read-answer costs 0.02,
    and the total never drops below 0 (what a malformed call or no answer earns).
    """
    correct, cited = check_answer(question, text=text, source_id=source_id)
    reward = ANSWER_CALL_REWARD + CORRECT_REWARD * correct + CITED_REWARD * cited
    return max(0.0, reward - EXTRA_TURN_PENALTY * max(0, turns - EXPECTED_TURNS))


def _arguments(raw: str, required: dict[str, type]) -> dict[str, Any]:
    try:
        arguments = json.loads(raw or "{}")
    except json.JSONDecodeError as exc:
        raise MalformedCall(f"arguments are not valid JSON: {exc.msg}") from exc
    if not isinstance(arguments, dict):
        raise MalformedCall("arguments must be a JSON object")
    for name, kind in required.items():
        if not isinstance(arguments.get(name), kind):
            raise MalformedCall(f"argument {name!r} must be a {kind.__name__}")
    return arguments


class EmailSearchEpisode(Episode):
    tools = TOOLS

    def __init__(self, scenario: Scenario, *, max_turns: int = 6) -> None:
        self.scenario = scenario
        generated = scenario.generate()
        self.inbox = generated.inbox
        self.question = generated.question
        self.answer: dict[str, str] | None = None
        self.malformed: str | None = None
        self.searches = 0
        self.reads = 0
        super().__init__(
            system=SYSTEM_PROMPT, user=f"Question: {self.question.text}", max_turns=max_turns
        )

    def react(self, choice: Choice) -> list[Message]:
        calls = choice.message.tool_calls or []
        if not calls:
            self.finish("no_tool_call")
            return []
        replies: list[Message] = []
        for call in calls:
            try:
                if call.type != "function":
                    raise MalformedCall(f"tool call of type {call.type!r}")
                result = self._run(call.function.name, call.function.arguments)
            except MalformedCall as exc:
                self.malformed = str(exc)
                self.finish("malformed_call")
                return []
            if self.done:
                return []
            replies.append({"role": "tool", "tool_call_id": call.id, "content": result})
        return replies

    def _run(self, name: str, raw_arguments: str) -> str:
        """Run one tool; the result is the JSON text the model reads next."""
        if name == "search_emails":
            keywords = _arguments(raw_arguments, {"keywords": list})["keywords"]
            if not keywords or not all(isinstance(k, str) for k in keywords):
                raise MalformedCall("argument 'keywords' must be a non-empty list of strings")
            self.searches += 1
            hits = self.inbox.search(keywords)
            return json.dumps([dataclasses.asdict(hit) for hit in hits])
        if name == "read_email":
            email_id = _arguments(raw_arguments, {"id": str})["id"]
            self.reads += 1
            email = self.inbox.read(email_id.strip())
            if email is None:
                return json.dumps({"error": f"no email with id {email_id!r}"})
            return json.dumps({"id": email.id, "email": email.text()})
        if name == "answer":
            arguments = _arguments(raw_arguments, {"text": str, "source_id": str})
            self.answer = {"text": arguments["text"], "source_id": arguments["source_id"]}
            self.finish("answered")
            return ""
        raise MalformedCall(f"unknown tool {name!r}")

    def reward(self) -> float:
        if self.answer is None:
            return 0.0
        return score_answer(self.question, turns=self.turns, **self.answer)

    def metrics(self) -> dict[str, Scalar]:
        correct, cited = (
            check_answer(self.question, **self.answer) if self.answer else (False, False)
        )
        return {
            **super().metrics(),
            "answered": self.answer is not None,
            "correct": correct,
            "cited": cited,
            "malformed_call": self.malformed is not None,
            "searches": self.searches,
            "reads": self.reads,
        }

    def metadata(self) -> dict[str, Any]:
        return {
            **super().metadata(),
            "seed": self.scenario.seed,
            "question": self.question.text,
            "expected_answer": self.question.answer,
            "source_id": self.question.source_id,
            "malformed": self.malformed,
        }

"""The conversation of one rollout, advanced one sampled turn at a time.

A rollout alternates between the model (one chat completion) and the environment (a game,
a puzzle, an inbox). ``Episode`` holds the environment's side: it records every sampled
``Choice`` as it came back from the endpoint (the trainer needs their logprobs and token ids),
turns the model's answer into the next observation, and knows when and why the rollout ended
and what it earned. Keeping it free of any client means the rules, the parsing of model
outputs and the rewards are tested with plain ``Choice`` objects, without a server.
"""

from __future__ import annotations

import abc
import re
from typing import Any, cast

from openai.types.chat import ChatCompletionMessageParam, ChatCompletionToolParam
from openai.types.chat.chat_completion import Choice

Message = dict[str, Any]
MessageOrChoice = Message | Choice
Scalar = float | int | bool
JSONValue = str | int | float | bool | None | list["JSONValue"] | dict[str, "JSONValue"]
# What a trajectory keeps of its rollout (the SDK's ``Trajectory.metadata``): JSON.
Metadata = dict[str, JSONValue]

TURN_LIMIT = "turn_limit"


def choice_message(choice: Choice) -> Message:
    """The chat message a sampled choice becomes when the conversation is sent back."""
    message: Message = {"role": "assistant", "content": choice.message.content or ""}
    if choice.message.tool_calls:
        message["tool_calls"] = [
            call.model_dump(include={"id", "type", "function"})
            for call in choice.message.tool_calls
        ]
    return message


def last_tag(text: str, tag: str) -> str | None:
    """The content of the last ``<tag>...</tag>`` in ``text``, stripped; None if there is none.

    The last one counts so a model may think aloud (even quoting the format) before answering.
    """
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", text, flags=re.DOTALL | re.IGNORECASE)
    return matches[-1].strip() if matches else None


class Episode(abc.ABC):
    """One rollout: the messages so far, the environment behind them, and how it ended.

    Subclasses implement ``react`` (apply the model's turn to the environment and return what
    the model sees next), ``reward`` and ``metrics``. ``outcome`` is None while the episode
    runs and names why it ended afterwards (``"won"``, ``"invalid_move"``, ``"turn_limit"``...).
    """

    tools: list[ChatCompletionToolParam] | None = None

    def __init__(self, *, system: str, user: str, max_turns: int) -> None:
        if max_turns < 1:
            raise ValueError(f"max_turns must be at least 1, got {max_turns}")
        self.messages_and_choices: list[MessageOrChoice] = [
            {"role": "system", "content": system},
            {"role": "user", "content": user},
        ]
        self.max_turns = max_turns
        self.turns = 0
        self.outcome: str | None = None

    @property
    def done(self) -> bool:
        return self.outcome is not None

    def finish(self, outcome: str) -> None:
        self.outcome = outcome

    def messages(self) -> list[ChatCompletionMessageParam]:
        """The conversation as chat messages, ready for the next completion request."""
        messages = [
            choice_message(item) if isinstance(item, Choice) else item
            for item in self.messages_and_choices
        ]
        return cast("list[ChatCompletionMessageParam]", messages)

    def step(self, choice: Choice) -> None:
        """Record the model's turn and let the environment answer it."""
        if self.done:
            raise RuntimeError(f"the episode has already ended ({self.outcome})")
        self.messages_and_choices.append(choice)
        self.turns += 1
        replies = self.react(choice)
        if self.done:
            return
        if self.turns >= self.max_turns:
            self.finish(TURN_LIMIT)
            return
        self.messages_and_choices.extend(replies)

    @abc.abstractmethod
    def react(self, choice: Choice) -> list[Message]:
        """Apply the model's turn; return the messages it sees next (or call ``finish``)."""

    @abc.abstractmethod
    def reward(self) -> float:
        """The reward of the episode so far (final once ``done``)."""

    def metrics(self) -> dict[str, Scalar]:
        """Numbers worth averaging over rollouts; subclasses add their own."""
        return {"turns": self.turns, "turn_limit": self.outcome == TURN_LIMIT}

    def metadata(self) -> Metadata:
        """What identifies the rollout (scenario seed, outcome), kept with the trajectory."""
        return {"outcome": self.outcome}

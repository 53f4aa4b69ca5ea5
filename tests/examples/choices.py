"""Build the ``Choice`` objects an OpenAI-compatible endpoint returns, to drive episodes."""

from __future__ import annotations

import json
from typing import Any

from openai.types.chat import ChatCompletionMessage
from openai.types.chat.chat_completion import Choice
from openai.types.chat.chat_completion_message_function_tool_call import (
    ChatCompletionMessageFunctionToolCall,
    Function,
)


def text_choice(content: str, *, finish_reason: str = "stop") -> Choice:
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": finish_reason,
            "message": ChatCompletionMessage(role="assistant", content=content),
        }
    )


def tool_choice(*calls: tuple[str, dict[str, Any] | str]) -> Choice:
    """A turn with one tool call per (name, arguments); string arguments are sent verbatim."""
    tool_calls = [
        ChatCompletionMessageFunctionToolCall(
            id=f"call_{i}",
            type="function",
            function=Function(
                name=name,
                arguments=arguments if isinstance(arguments, str) else json.dumps(arguments),
            ),
        )
        for i, (name, arguments) in enumerate(calls)
    ]
    return Choice.model_validate(
        {
            "index": 0,
            "finish_reason": "tool_calls",
            "message": ChatCompletionMessage(role="assistant", content=None, tool_calls=tool_calls),
        }
    )

"""Conversations the engine tests send to SmolLM2 (the CPU engine and vLLM alike)."""

from __future__ import annotations

import json
from typing import Any

TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Get the current weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}},
                "required": ["city"],
            },
        },
    }
]
# SmolLM2-135M calls a tool reliably once it has seen one call in the conversation.
WEATHER_CONVERSATION: list[Any] = [
    {
        "role": "system",
        "content": "You are a weather assistant. Always call get_weather to answer.",
    },
    {"role": "user", "content": "What's the weather in London?"},
    {
        "role": "assistant",
        "content": None,
        "tool_calls": [
            {
                "id": "call_1",
                "type": "function",
                "function": {"name": "get_weather", "arguments": json.dumps({"city": "London"})},
            }
        ],
    },
    {"role": "tool", "tool_call_id": "call_1", "content": "rainy, 12 C"},
    {"role": "assistant", "content": "It is rainy in London, 12 C."},
    {"role": "user", "content": "What's the weather in Paris?"},
]

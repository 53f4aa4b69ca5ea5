"""Conversations as chat templates take them: the engine's and the trainer's one rendering.

The CPU engine renders a chat request's messages and tools with these functions before
applying the tokenizer's chat template, and the trainer renders the conversations it has no
prompt ids for with the same ones, so both see the same text. No torch, no tokenizer here.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from skytrain_backend.json_types import JSONObject
from skytrain_backend.protocol import Message


class FunctionSpec(BaseModel):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: JSONObject | None = None


class ToolSpec(BaseModel):
    type: Literal["function"] = "function"
    function: FunctionSpec


def template_tools(tools: list[ToolSpec] | None) -> list[Any] | None:
    """Tools as the engine hands them to the chat template."""
    return [tool.model_dump(exclude_none=True) for tool in tools] if tools else None


def template_message(message: Message) -> dict[str, Any]:
    """A message as the engine hands it to the chat template: content as one string (text
    parts joined), tool calls as plain dicts. The trainer renders conversations it has no
    prompt ids for with this same function."""
    rendered: dict[str, Any] = {"role": message.role, "content": message.text()}
    if message.role == "assistant" and message.content is None:
        rendered["content"] = None
    if message.tool_calls:
        rendered["tool_calls"] = [call.model_dump() for call in message.tool_calls]
    if message.tool_call_id:
        rendered["tool_call_id"] = message.tool_call_id
    if message.name:
        rendered["name"] = message.name
    return rendered

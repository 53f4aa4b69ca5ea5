"""Tool calls in the Hermes format: ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>``.

This is what the chat templates skytrain serves ask the model to write (SmolLM2's, Qwen's) and
what vLLM's ``hermes`` tool-call parser reads, so both engines turn the same text into the same
OpenAI ``tool_calls``. As in vLLM, text before the first call is the message content, and an
output whose calls do not parse as JSON is returned as plain content: the agent sees exactly
what the model wrote.
"""

from __future__ import annotations

import json
import re

from skytrain_backend.engine.wire import random_id
from skytrain_backend.protocol import FunctionCall, ToolCall

TOOL_CALL_START = "<tool_call>"
# A call runs to its closing tag, or to the end of the output when generation stopped first.
_TOOL_CALL_RE = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*)\Z", re.DOTALL)


def parse_tool_calls(text: str) -> tuple[str | None, list[ToolCall]]:
    """Split a model output into (content, tool calls); no calls when any call is malformed."""
    start = text.find(TOOL_CALL_START)
    if start < 0:
        return text, []
    calls = []
    for match in _TOOL_CALL_RE.finditer(text):
        body = (match.group(1) if match.group(1) is not None else match.group(2)).strip()
        call = _parse_call(body)
        if call is None:
            return text, []
        calls.append(call)
    content = text[:start]
    return (content if content.strip() else None), calls


def _parse_call(body: str) -> ToolCall | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not isinstance(payload, dict) or not isinstance(payload.get("name"), str):
        return None
    if not payload["name"]:
        return None  # a call must name its function
    arguments = payload.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return ToolCall(
        id=random_id("chatcmpl-tool"),
        function=FunctionCall(name=payload["name"], arguments=arguments),
    )


def streamable_prefix(text: str) -> int:
    """How much of a partial output can be streamed as content before a tool call may begin.

    Everything from ``<tool_call>`` on is held back (it becomes ``tool_calls`` at the end), and
    so is a trailing fragment that could still grow into ``<tool_call>``.
    """
    start = text.find(TOOL_CALL_START)
    if start >= 0:
        return start
    for size in range(min(len(TOOL_CALL_START) - 1, len(text)), 0, -1):
        if text.endswith(TOOL_CALL_START[:size]):
            return len(text) - size
    return len(text)

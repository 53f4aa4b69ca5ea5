"""Hermes tool-call parsing: the same text gives the same OpenAI tool_calls as vLLM's parser."""

from __future__ import annotations

import json

from skytrain_backend.engine.hf.toolcalls import parse_tool_calls, streamable_prefix


def test_a_single_call_becomes_a_tool_call_with_json_arguments() -> None:
    text = '<tool_call>{"name": "get_weather", "arguments": {"city": "Paris"}}</tool_call>'
    content, calls = parse_tool_calls(text)
    assert content is None
    assert [c.function.name for c in calls] == ["get_weather"]
    assert json.loads(calls[0].function.arguments) == {"city": "Paris"}
    assert calls[0].id.startswith("chatcmpl-tool-")


def test_text_before_the_calls_is_the_content_and_several_calls_keep_their_order() -> None:
    text = (
        "Let me check both.\n"
        '<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
        '<tool_call>{"name": "b", "arguments": "{\\"y\\": 2}"}</tool_call>'
    )
    content, calls = parse_tool_calls(text)
    assert content == "Let me check both.\n"
    assert [c.function.name for c in calls] == ["a", "b"]
    assert json.loads(calls[1].function.arguments) == {"y": 2}
    assert len({c.id for c in calls}) == 2


def test_a_call_cut_off_before_its_closing_tag_still_parses() -> None:
    content, calls = parse_tool_calls('<tool_call>{"name": "f", "arguments": {}}')
    assert content is None
    assert [c.function.name for c in calls] == ["f"]


def test_malformed_calls_are_returned_as_plain_content() -> None:
    for text in (
        "<tool_call>{not json}</tool_call>",
        '<tool_call>{"arguments": {}}</tool_call>',
        '<tool_call>["f"]</tool_call>',
        '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    ):
        assert parse_tool_calls(text) == (text, [])


def test_text_without_calls_is_untouched() -> None:
    assert parse_tool_calls("just words") == ("just words", [])


def test_streaming_holds_back_a_possible_tool_call_start() -> None:
    assert streamable_prefix("Hello") == 5
    assert streamable_prefix("Hello <tool") == len("Hello ")
    assert streamable_prefix("Hello <") == len("Hello ")
    assert streamable_prefix('Hi <tool_call>{"name"') == len("Hi ")
    assert streamable_prefix("a < b") == len("a < b")

"""Anthropic's Messages API to and from the endpoint's OpenAI chat shape (openppo/agents/anthropic_wire.py), by
hand; tests/agents/test_endpoint.py serves it to the `anthropic` package over a real engine."""

from __future__ import annotations

import pytest

from openppo.agents.anthropic_wire import error_body, stream_events, to_chat_body, to_reply


def test_a_conversation_with_a_tool_becomes_chat_messages():
    body = {
        "model": "m",
        "max_tokens": 32,
        "temperature": 0.5,
        "system": [{"type": "text", "text": "Be "}, {"type": "text", "text": "brief."}],
        "metadata": {"user_id": "ep-1"},
        "tools": [{"name": "add", "description": "adds", "input_schema": {"type": "object", "properties": {}}}],
        "stop_sequences": ["\n\n"],
        "messages": [
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": [
                    {"type": "text", "text": "Let me add."},
                    {"type": "tool_use", "id": "toolu_1", "name": "add", "input": {"a": 2, "b": 3}},
                ],
            },
            {
                "role": "user",
                "content": [
                    {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "5"}]},
                    {"type": "text", "text": "Go on."},
                ],
            },
        ],
    }
    assert to_chat_body(body) == {
        "model": "m",
        "max_tokens": 32,
        "temperature": 0.5,
        "user": "ep-1",
        "stop": ["\n\n"],
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "user", "content": "What is 2 + 3?"},
            {
                "role": "assistant",
                "content": "Let me add.",
                "tool_calls": [
                    {"id": "toolu_1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2, "b": 3}'}}
                ],
            },
            {"role": "tool", "tool_call_id": "toolu_1", "content": "5"},
            {"role": "user", "content": "Go on."},
        ],
        "tools": [
            {
                "type": "function",
                "function": {"name": "add", "parameters": {"type": "object", "properties": {}}, "description": "adds"},
            }
        ],
    }
    # a turn of tool results alone is no user message
    only = to_chat_body({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t"}]}]})
    assert only["messages"] == [{"role": "tool", "tool_call_id": "t", "content": ""}]


@pytest.mark.parametrize(
    "messages, match",
    [
        ([], "'messages' must be a non-empty list"),
        ([{"role": "system", "content": "x"}], r"messages\[0\] must be an object with role 'user' or 'assistant'"),
        ([{"role": "user", "content": 3}], r"messages\[0\]: content must be a string or a list"),
        (
            [{"role": "user", "content": [{"type": "image", "source": {}}]}],
            r"messages\[0\]: image blocks are not served by this endpoint",
        ),
        ([{"role": "user", "content": [{"type": "thinking", "thinking": "hm"}]}], "only text blocks may appear"),
    ],
)
def test_what_cannot_be_served_is_named(messages, match):
    with pytest.raises(ValueError, match=match):
        to_chat_body({"messages": messages})


def test_replies_in_anthropics_shape():
    text = to_reply({"role": "assistant", "content": "5"}, "stop", 12, 2, {"model": "m"})
    assert text["type"] == "message" and text["id"].startswith("msg_") and text["model"] == "m"
    assert text["content"] == [{"type": "text", "text": "5"}] and text["stop_reason"] == "end_turn"
    assert text["usage"] == {"input_tokens": 12, "output_tokens": 2}
    assert (
        to_reply({"role": "assistant", "content": "55"}, "length", 12, 8, {"model": "m"})["stop_reason"] == "max_tokens"
    )
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    bad = {"id": "c2", "type": "function", "function": {"name": "add", "arguments": "{a"}}
    used = to_reply({"role": "assistant", "content": None, "tool_calls": [call, bad]}, "stop", 1, 1, {"model": "m"})
    assert used["stop_reason"] == "tool_use"
    assert used["content"] == [
        {"type": "tool_use", "id": "c1", "name": "add", "input": {"a": 2}},
        {"type": "tool_use", "id": "c2", "name": "add", "input": {"arguments": "{a"}},
    ]
    assert error_body("no such model", 404) == {
        "type": "error",
        "error": {"type": "not_found_error", "message": "no such model"},
    }
    assert error_body("boom", 500)["error"]["type"] == "api_error"


def test_a_streamed_message_is_its_events_in_anthropics_order():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    message = to_reply({"role": "assistant", "content": "Adding.", "tool_calls": [call]}, "stop", 9, 4, {"model": "m"})
    events = stream_events(message)
    assert [name for name, _ in events] == [
        "message_start",
        *["content_block_start", "content_block_delta", "content_block_stop"] * 2,
        "message_delta",
        "message_stop",
    ]
    assert all(data["type"] == name for name, data in events)
    start = events[0][1]["message"]
    assert (
        start["content"] == []
        and start["stop_reason"] is None
        and start["usage"] == {"input_tokens": 9, "output_tokens": 0}
    )
    assert events[1][1] == {"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}
    assert events[2][1]["delta"] == {"type": "text_delta", "text": "Adding."}
    assert events[4][1]["content_block"] == {"type": "tool_use", "id": "c1", "name": "add", "input": {}}
    assert events[5][1] == {
        "type": "content_block_delta",
        "index": 1,
        "delta": {"type": "input_json_delta", "partial_json": '{"a": 2}'},
    }
    assert events[-2][1] == {
        "type": "message_delta",
        "delta": {"stop_reason": "tool_use", "stop_sequence": None},
        "usage": {"output_tokens": 4},
    }

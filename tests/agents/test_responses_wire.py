"""OpenAI's Responses API to and from the endpoint's chat shape (openppo/agents/responses_wire.py), by hand;
tests/agents/test_endpoint.py serves it to the `openai` package's `responses` client over a real engine."""

from __future__ import annotations

import pytest

from openppo.agents.responses_wire import stream_events, to_chat_body, to_reply


def test_a_conversation_with_a_function_call_becomes_chat_messages():
    body = {
        "model": "m",
        "instructions": "Be brief.",
        "max_output_tokens": 32,
        "temperature": 0.5,
        "store": True,
        "tools": [{"type": "function", "name": "add", "description": "adds", "parameters": {"type": "object"}}],
        "input": [
            {"role": "developer", "content": "Use tools."},
            {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "What is 2 + 3?"}]},
            {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Adding."}]},
            {"type": "function_call", "call_id": "c1", "name": "add", "arguments": '{"a": 2}'},
            {"type": "function_call", "call_id": "c2", "name": "add", "arguments": '{"b": 3}'},
            {"type": "function_call_output", "call_id": "c1", "output": "2"},
            {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "3"}]},
        ],
    }
    call = lambda i, args: {"id": i, "type": "function", "function": {"name": "add", "arguments": args}}  # noqa: E731
    assert to_chat_body(body) == {
        "model": "m",
        "temperature": 0.5,
        "max_tokens": 32,
        "messages": [
            {"role": "system", "content": "Be brief."},
            {"role": "system", "content": "Use tools."},
            {"role": "user", "content": "What is 2 + 3?"},
            {"role": "assistant", "content": "Adding.", "tool_calls": [call("c1", '{"a": 2}'), call("c2", '{"b": 3}')]},
            {"role": "tool", "tool_call_id": "c1", "content": "2"},
            {"role": "tool", "tool_call_id": "c2", "content": "3"},
        ],
        "tools": [
            {"type": "function", "function": {"name": "add", "parameters": {"type": "object"}, "description": "adds"}}
        ],
    }
    # a string input is one user message; a call with no assistant message before it gets one
    assert to_chat_body({"input": "hi"})["messages"] == [{"role": "user", "content": "hi"}]
    only = to_chat_body({"input": [{"type": "function_call", "call_id": "c", "name": "add", "arguments": "{}"}]})
    assert only["messages"] == [{"role": "assistant", "content": "", "tool_calls": [call("c", "{}")]}]


@pytest.mark.parametrize(
    "body, match",
    [
        ({"input": "hi", "previous_response_id": "resp_1"}, "keeps no responses: send the whole conversation"),
        ({"input": []}, "'input' must be a string or a non-empty list"),
        ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]}, "input_image parts"),
        ({"input": [{"type": "reasoning", "summary": []}]}, r"input\[0\]: 'reasoning' items are not served"),
        ({"input": [{"role": "tool", "content": "x"}]}, "role must be user, assistant, system or developer"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, "only function tools .* not 'web_search'"),
    ],
)
def test_what_cannot_be_served_is_named(body, match):
    with pytest.raises(ValueError, match=match):
        to_chat_body(body)


def test_replies_in_the_responses_shape():
    request = {"model": "m", "max_output_tokens": 8, "tools": [], "instructions": "Be brief."}
    text = to_reply({"role": "assistant", "content": "5"}, "stop", 12, 2, request)
    assert text["object"] == "response" and text["id"].startswith("resp_") and text["status"] == "completed"
    [item] = text["output"]
    assert item["type"] == "message" and item["role"] == "assistant" and item["status"] == "completed"
    assert item["content"] == [{"type": "output_text", "text": "5", "annotations": [], "logprobs": []}]
    assert text["usage"]["input_tokens"] == 12 and text["usage"]["output_tokens"] == 2
    assert text["usage"]["total_tokens"] == 14 and text["instructions"] == "Be brief." and text["model"] == "m"
    cut = to_reply({"role": "assistant", "content": "55"}, "length", 12, 8, request)
    assert cut["status"] == "incomplete" and cut["incomplete_details"] == {"reason": "max_output_tokens"}
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": '{"a": 2}'}}
    used = to_reply({"role": "assistant", "content": None, "tool_calls": [call]}, "stop", 1, 1, request)
    [fc] = used["output"]
    assert {k: fc[k] for k in ("type", "call_id", "name", "arguments", "status")} == {
        "type": "function_call",
        "call_id": "c1",
        "name": "add",
        "arguments": '{"a": 2}',
        "status": "completed",
    }


def test_a_streamed_response_is_its_events_in_order():
    call = {"id": "c1", "type": "function", "function": {"name": "add", "arguments": "{}"}}
    response = to_reply({"role": "assistant", "content": "Adding.", "tool_calls": [call]}, "stop", 3, 2, {})
    events = stream_events(response)
    assert [name for name, _ in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        "response.output_text.delta",
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [data["sequence_number"] for _, data in events] == list(range(13))
    assert all(data["type"] == name for name, data in events)
    assert events[0][1]["response"]["status"] == "in_progress" and events[0][1]["response"]["output"] == []
    assert events[4][1]["delta"] == "Adding." and events[4][1]["item_id"] == response["output"][0]["id"]
    assert events[9][1]["delta"] == "{}" and events[11][1]["item"] == response["output"][1]
    assert events[-1][1]["response"] == response

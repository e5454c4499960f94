"""Anthropic's Messages API on the agent endpoint: requests translated to the OpenAI chat shape the endpoint renders,
replies translated back (pure functions; `endpoint.create_app` serves them at `POST .../v1/messages`).

An agent that speaks the Anthropic SDK points it at the session's URL without `/v1` (the SDK appends
`/v1/messages`), as Molt's ChatAgents do with `ctx.session_url`. What maps:

    request                                       OpenAI chat shape
    system (a string or text blocks)              a first "system" message
    user text / text blocks                       a "user" message (texts joined)
    user tool_result blocks                       one "tool" message each (tool_call_id: its tool_use_id), before
                                                  the user's text
    assistant text + tool_use blocks              an "assistant" message with `tool_calls` (arguments: the input)
    tools [{name, description, input_schema}]     tools [{type: function, function: {name, description, parameters}}]
    max_tokens, temperature, top_p                the same; metadata.user_id is the session's `user`
    stop_sequences                                `stop`

    reply                                         from
    content: a text block, then tool_use blocks   the message's text and its tool calls (with a tool parser)
    stop_reason                                   tool_use when it called a tool, max_tokens at the length limit,
                                                  else end_turn
    usage                                         input_tokens, output_tokens: the prompt's and the reply's tokens

`stream: true` gets the reply as Anthropic's server-sent events (`stream_events`), all sent once it is generated.
Images are not served (a 400 says so); stop sequences are not applied (as the OpenAI route's `stop` is not: the
endpoint logs it once), nor are `top_k` and `tool_choice`. Malformed requests raise ValueError, which the endpoint
answers with a 400 in Anthropic's error shape.
"""

from __future__ import annotations

import json
import uuid
from typing import Any


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """An Anthropic Messages request as the OpenAI chat request the endpoint serves (the table above)."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("'messages' must be a non-empty list")
    chat: list[dict[str, Any]] = []
    if body.get("system"):
        chat.append({"role": "system", "content": _text(body["system"], "system")})
    for i, message in enumerate(messages):
        if not isinstance(message, dict) or message.get("role") not in ("user", "assistant"):
            raise ValueError(f"messages[{i}] must be an object with role 'user' or 'assistant'")
        chat += _assistant(message, i) if message["role"] == "assistant" else _user(message, i)
    out = {k: body[k] for k in ("model", "max_tokens", "temperature", "top_p", "stream") if k in body}
    out["messages"] = chat
    if body.get("stop_sequences"):
        out["stop"] = body["stop_sequences"]  # (not applied; the endpoint says so once)
    user = (body.get("metadata") or {}).get("user_id")
    if user:
        out["user"] = user
    if body.get("tools"):
        out["tools"] = [_tool(tool, i) for i, tool in enumerate(body["tools"])]
    return out


def to_reply(
    assistant: dict[str, Any], finish_reason: str, prompt_tokens: int, output_tokens: int, body: dict[str, Any]
) -> dict[str, Any]:
    """The Anthropic Message of a chat reply's assistant message (`endpoint.assistant_message`'s); `body` is the
    request (its model is named)."""
    calls = assistant.get("tool_calls") or []
    content: list[dict[str, Any]] = []
    if assistant.get("content") or not calls:
        content.append({"type": "text", "text": assistant.get("content") or ""})
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        try:
            arguments = json.loads(arguments) if isinstance(arguments, str) else arguments
        except ValueError:
            arguments = {"arguments": function["arguments"]}  # not JSON: kept, under a name, for the agent to see
        content.append(
            {"type": "tool_use", "id": call.get("id") or _id("toolu"), "name": function["name"], "input": arguments}
        )
    stop = "tool_use" if calls else "max_tokens" if finish_reason == "length" else "end_turn"
    return {
        "id": _id("msg"),
        "type": "message",
        "role": "assistant",
        "model": body.get("model"),
        "content": content,
        "stop_reason": stop,
        "stop_sequence": None,
        "usage": {"input_tokens": prompt_tokens, "output_tokens": output_tokens},
    }


def stream_events(message: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A Message (`to_reply`'s) as the (event, data) pairs of a streamed reply, in Anthropic's order: message_start,
    then per content block its start, one delta (the reply is generated whole: all its text, or a tool_use's input as
    JSON) and its stop, then message_delta (stop reason, output tokens) and message_stop."""
    start = {**message, "content": [], "stop_reason": None, "usage": {**message["usage"], "output_tokens": 0}}
    events = [("message_start", {"type": "message_start", "message": start})]
    for i, block in enumerate(message["content"]):
        if block["type"] == "text":
            opened, delta = {"type": "text", "text": ""}, {"type": "text_delta", "text": block["text"]}
        else:
            opened, delta = (
                {**block, "input": {}},
                {"type": "input_json_delta", "partial_json": json.dumps(block["input"])},
            )
        events += [
            ("content_block_start", {"type": "content_block_start", "index": i, "content_block": opened}),
            ("content_block_delta", {"type": "content_block_delta", "index": i, "delta": delta}),
            ("content_block_stop", {"type": "content_block_stop", "index": i}),
        ]
    finish = {"stop_reason": message["stop_reason"], "stop_sequence": None}
    usage = {"output_tokens": message["usage"]["output_tokens"]}
    events += [
        ("message_delta", {"type": "message_delta", "delta": finish, "usage": usage}),
        ("message_stop", {"type": "message_stop"}),
    ]
    return events


def error_body(message: str, status: int) -> dict[str, Any]:
    """Anthropic's error shape, which its SDK raises with the message."""
    kind = "api_error" if status >= 500 else "not_found_error" if status == 404 else "invalid_request_error"
    return {"type": "error", "error": {"type": kind, "message": message}}


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _blocks(content: Any, where: str) -> list[dict[str, Any]]:
    if isinstance(content, str):
        return [{"type": "text", "text": content}]
    if not isinstance(content, list) or not all(isinstance(b, dict) for b in content):
        raise ValueError(f"{where}: content must be a string or a list of content blocks")
    for block in content:
        if block.get("type") in ("image", "document"):
            raise ValueError(f"{where}: {block['type']} blocks are not served by this endpoint (text and tools only)")
    return content


def _text(content: Any, where: str) -> str:
    blocks = _blocks(content, where)
    unknown = sorted({str(b.get("type")) for b in blocks} - {"text"})
    if unknown:
        raise ValueError(f"{where}: only text blocks may appear here, not {', '.join(unknown)}")
    return "".join(b.get("text") or "" for b in blocks)


def _user(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    blocks = _blocks(message.get("content"), f"messages[{i}]")
    results = [b for b in blocks if b.get("type") == "tool_result"]
    rest = [b for b in blocks if b.get("type") != "tool_result"]
    out = [
        {
            "role": "tool",
            "tool_call_id": str(b.get("tool_use_id", "")),
            "content": _text(b.get("content") or "", f"messages[{i}] tool_result"),
        }
        for b in results
    ]
    if rest or not results:
        out.append({"role": "user", "content": _text(rest, f"messages[{i}]")})
    return out


def _assistant(message: dict[str, Any], i: int) -> list[dict[str, Any]]:
    blocks = _blocks(message.get("content"), f"messages[{i}]")
    uses = [b for b in blocks if b.get("type") == "tool_use"]
    text = _text([b for b in blocks if b.get("type") != "tool_use"], f"messages[{i}]")
    out: dict[str, Any] = {"role": "assistant", "content": text}
    if uses:
        out["tool_calls"] = [
            {
                "id": str(b.get("id", "")),
                "type": "function",
                "function": {"name": b.get("name"), "arguments": json.dumps(b.get("input") or {})},
            }
            for b in uses
        ]
    return [out]


def _tool(tool: Any, i: int) -> dict[str, Any]:
    if not isinstance(tool, dict) or not tool.get("name"):
        raise ValueError(f"tools[{i}] must be an object with a name (and an input_schema)")
    function = {"name": tool["name"], "parameters": tool.get("input_schema") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}

"""OpenAI's Responses API on the agent endpoint (`POST .../v1/responses`): requests translated to the chat shape the
endpoint renders, replies translated back (pure functions). The OpenAI Agents SDK calls it by default, and agent
servers such as NeMo Gym's speak it.

    request                                         chat shape
    instructions                                    a first "system" message
    input: a string                                 one "user" message
    input items: {role, content} messages           messages (developer is system; input_text / output_text parts
                                                    joined)
    function_call items (call_id, name, arguments)  `tool_calls` of the assistant message before them (or of a new
                                                    one)
    function_call_output items (call_id, output)    "tool" messages
    tools [{type: function, name, parameters}]      tools [{type: function, function: {...}}]
    max_output_tokens, temperature, top_p           max_tokens, temperature, top_p

    reply: `output` holds a message item (its output_text) unless the reply is only tool calls, then one
    function_call item per call (with a tool parser); status "incomplete" (reason max_output_tokens) at the length
    limit; usage in tokens. `stream: true` gets the reply as the Responses events (`stream_events`), all sent once
    it is generated.

The endpoint keeps no responses: `previous_response_id` is refused (send the whole conversation as `input`), as are
images, files and tools other than functions (a 400 names them). `tool_choice`, `text.format` and `store` are not
applied. Malformed requests raise ValueError, which the endpoint answers with a 400.
"""

from __future__ import annotations

import json
import time
import uuid
from typing import Any


def to_chat_body(body: dict[str, Any]) -> dict[str, Any]:
    """A Responses request as the OpenAI chat request the endpoint serves (the table above)."""
    if body.get("previous_response_id") or body.get("conversation"):
        raise ValueError(
            "this endpoint keeps no responses: send the whole conversation as 'input' (no previous_response_id)"
        )
    chat: list[dict[str, Any]] = []
    if body.get("instructions"):
        chat.append({"role": "system", "content": _text(body["instructions"], "instructions")})
    items = body.get("input")
    if isinstance(items, str):
        items = [{"role": "user", "content": items}]
    if not isinstance(items, list) or not items:
        raise ValueError("'input' must be a string or a non-empty list of items")
    for i, item in enumerate(items):
        if not isinstance(item, dict):
            raise ValueError(f"input[{i}] must be an object")
        _add_item(chat, item, f"input[{i}]")
    out = {k: body[k] for k in ("model", "temperature", "top_p", "stream", "user") if body.get(k) is not None}
    if body.get("max_output_tokens") is not None:
        out["max_tokens"] = body["max_output_tokens"]
    out["messages"] = chat
    if body.get("tools"):
        out["tools"] = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(body["tools"])]
    return out


def to_reply(
    assistant: dict[str, Any], finish_reason: str, prompt_tokens: int, output_tokens: int, body: dict[str, Any]
) -> dict[str, Any]:
    """The Responses object of a chat reply's assistant message; `body` is the request (echoed fields)."""
    calls = assistant.get("tool_calls") or []
    output: list[dict[str, Any]] = []
    if assistant.get("content") or not calls:
        part = {"type": "output_text", "text": assistant.get("content") or "", "annotations": [], "logprobs": []}
        output.append(
            {"type": "message", "id": _id("msg"), "status": "completed", "role": "assistant", "content": [part]}
        )
    for call in calls:
        function = call["function"]
        arguments = function["arguments"]
        output.append(
            {
                "type": "function_call",
                "id": _id("fc"),
                "call_id": call.get("id") or _id("call"),
                "name": function["name"],
                "arguments": arguments if isinstance(arguments, str) else json.dumps(arguments),
                "status": "completed",
            }
        )
    incomplete = finish_reason == "length" and not calls
    return {
        "id": _id("resp"),
        "object": "response",
        "created_at": int(time.time()),
        "status": "incomplete" if incomplete else "completed",
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "error": None,
        "model": body.get("model"),
        "instructions": body.get("instructions"),
        "output": output,
        "tools": body.get("tools") or [],
        "tool_choice": body.get("tool_choice") or "auto",
        "parallel_tool_calls": True,
        "temperature": body.get("temperature"),
        "top_p": body.get("top_p"),
        "max_output_tokens": body.get("max_output_tokens"),
        "previous_response_id": None,
        "store": False,
        "text": {"format": {"type": "text"}},
        "truncation": "disabled",
        "metadata": body.get("metadata") or {},
        "usage": {
            "input_tokens": prompt_tokens,
            "input_tokens_details": {"cached_tokens": 0},
            "output_tokens": output_tokens,
            "output_tokens_details": {"reasoning_tokens": 0},
            "total_tokens": prompt_tokens + output_tokens,
        },
    }


def stream_events(response: dict[str, Any]) -> list[tuple[str, dict[str, Any]]]:
    """A Responses object (`to_reply`'s) as the (event, data) pairs of a streamed reply, in the API's order:
    created, in_progress, per output item its added / delta / done events, then completed (or incomplete). Each
    carries its sequence number."""
    opening = {**response, "status": "in_progress", "incomplete_details": None, "output": [], "usage": None}
    events: list[dict[str, Any]] = [
        {"type": "response.created", "response": opening},
        {"type": "response.in_progress", "response": opening},
    ]
    for i, item in enumerate(response["output"]):
        where = {"item_id": item["id"], "output_index": i}
        if item["type"] == "message":
            part = item["content"][0]
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "content": []},
                },
                {"type": "response.content_part.added", **where, "content_index": 0, "part": {**part, "text": ""}},
                {
                    "type": "response.output_text.delta",
                    **where,
                    "content_index": 0,
                    "delta": part["text"],
                    "logprobs": [],
                },
                {
                    "type": "response.output_text.done",
                    **where,
                    "content_index": 0,
                    "text": part["text"],
                    "logprobs": [],
                },
                {"type": "response.content_part.done", **where, "content_index": 0, "part": part},
            ]
        else:
            events += [
                {
                    "type": "response.output_item.added",
                    "output_index": i,
                    "item": {**item, "status": "in_progress", "arguments": ""},
                },
                {"type": "response.function_call_arguments.delta", **where, "delta": item["arguments"]},
                {
                    "type": "response.function_call_arguments.done",
                    **where,
                    "arguments": item["arguments"],
                    "name": item["name"],
                },
            ]
        events.append({"type": "response.output_item.done", "output_index": i, "item": item})
    events.append({"type": f"response.{response['status']}", "response": response})
    return [(event["type"], {**event, "sequence_number": n}) for n, event in enumerate(events)]


def _id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:24]}"


def _text(content: Any, where: str) -> str:
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ValueError(f"{where}: content must be a string or a list of content parts")
    kinds = sorted({str(p.get("type")) for p in content} - {"input_text", "output_text", "text"})
    if kinds:
        raise ValueError(f"{where}: {', '.join(kinds)} parts are not served by this endpoint (text and tools only)")
    return "".join(p.get("text") or "" for p in content)


def _add_item(chat: list[dict[str, Any]], item: dict[str, Any], where: str) -> None:
    kind = item.get("type", "message")
    if kind == "message":
        role = {"developer": "system"}.get(item.get("role"), item.get("role"))
        if role not in ("system", "user", "assistant"):
            raise ValueError(f"{where}: role must be user, assistant, system or developer, got {item.get('role')!r}")
        chat.append({"role": role, "content": _text(item.get("content"), where)})
    elif kind == "function_call":
        call = {
            "id": str(item.get("call_id", "")),
            "type": "function",
            "function": {"name": item.get("name"), "arguments": item.get("arguments") or "{}"},
        }
        last = chat[-1] if chat else None
        if last is not None and last["role"] == "assistant":
            last.setdefault("tool_calls", []).append(call)
        else:
            chat.append({"role": "assistant", "content": "", "tool_calls": [call]})
    elif kind == "function_call_output":
        output = item.get("output")
        chat.append(
            {"role": "tool", "tool_call_id": str(item.get("call_id", "")), "content": _text(output or "", where)}
        )
    else:
        raise ValueError(f"{where}: {kind!r} items are not served by this endpoint (messages and function calls only)")


def _tool(tool: Any, where: str) -> dict[str, Any]:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not tool.get("name"):
        kind = tool.get("type") if isinstance(tool, dict) else type(tool).__name__
        raise ValueError(f"{where}: only function tools (with a name) are served here, not {kind!r}")
    function = {"name": tool["name"], "parameters": tool.get("parameters") or {"type": "object"}}
    if tool.get("description"):
        function["description"] = tool["description"]
    return {"type": "function", "function": function}

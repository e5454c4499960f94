"""An agent written against the OpenAI API only, for --agent_program (examples/scripts/train_agent_openai.sh): it
gives the policy a `calculate` tool, runs the calls the policy makes (at most 3 rounds), and returns 1.0 when the
final answer contains the label, else 0.0. Nothing here knows about openppo: point `base_url` at any
OpenAI-compatible server and it runs the same way.

    --agent_program examples/agents/openai_calculator.py   (the callable `agent`)
"""

from __future__ import annotations

import ast
import json
import operator

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "calculate",
            "description": "evaluate an arithmetic expression of integers with + - * and parentheses",
            "parameters": {
                "type": "object",
                "properties": {"expression": {"type": "string"}},
                "required": ["expression"],
            },
        },
    }
]
_OPS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.USub: operator.neg}


def calculate(expression: str) -> str:
    """The tool: integer arithmetic only (no eval of arbitrary code)."""

    def value(node):
        if isinstance(node, ast.Constant) and isinstance(node.value, int):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPS:
            return _OPS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression: {expression!r}")

    try:
        return str(value(ast.parse(expression, mode="eval").body))
    except (SyntaxError, ValueError, RecursionError) as exc:
        return f"error: {exc}"


def agent(base_url: str, task: dict) -> float:
    client = OpenAI(base_url=base_url, api_key="unused")
    model = client.models.list().data[0].id
    messages = [
        {"role": "system", "content": "Use the calculate tool, then give the final number."},
        {"role": "user", "content": task["prompt"]},
    ]
    for _ in range(3):
        reply = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=512)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            try:
                result = calculate(json.loads(call.function.arguments)["expression"])
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
    answer = messages[-1].get("content") or ""
    return 1.0 if str(task["label"]) in answer else 0.0

"""The agent of the --agent_program run (tests/agents/test_served_agents.py), written against the `openai` package
only, as any agent outside openppo would be: it asks the policy, runs the `add` tool when the reply calls it, sends
the result back (the fourth episode of each prompt compacts its history first, as agents that summarise do, so its
next prompt does not extend the last; the third has a slow tool), and returns 1.0 when the policy called the tool
(0.0 when it did not) plus a hundredth of the last answer's length in characters, or None on odd prompt indexes to
leave the score to the run's reward function. The length term gives each group's episodes different rewards even when
all of them call the tool (the SFT-ed model nearly always does), so step 1's update is never zero.

Two episodes of the run misbehave on purpose, the first two to start on step 1: one raises (its traceback must reach
the log and its group must not be trained on), one never ends (--agent_timeout must stop waiting for it).
"""

from __future__ import annotations

import json
import threading
import time

from openai import OpenAI

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "add",
            "description": "add two integers",
            "parameters": {
                "type": "object",
                "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}},
                "required": ["a", "b"],
            },
        },
    }
]
HANG_S = 180  # longer than the run's --agent_timeout (60 s)
# the third episode of each prompt has a slow tool: on step 2 (generated while step 1 trains, --async_train) its
# answer after the tool comes from the weights that step 1's sync brought, its tool call from the older ones
SLOW_TOOL_S = 8  # (step 1's update and sync took 3 s on a 2-core CPU)

_lock = threading.Lock()
_started = 0


def _misbehave() -> None:
    global _started
    with _lock:
        _started += 1
        mine = _started
    if mine == 1:
        raise RuntimeError("the agent's tool server is down")
    if mine == 2:
        time.sleep(HANG_S)


def agent(base_url: str, task: dict) -> float | None:
    _misbehave()
    client = OpenAI(base_url=base_url, api_key="unused", max_retries=0, timeout=300)
    model = client.models.list().data[0].id
    messages = [{"role": "user", "content": task["prompt"]}]
    first = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=32)
    message = first.choices[0].message
    called = bool(message.tool_calls)
    if called:
        messages.append(message.model_dump(exclude_none=True))
        for call in message.tool_calls:
            try:
                args = json.loads(call.function.arguments)
                result = str(int(args["a"]) + int(args["b"]))
            except (ValueError, KeyError, TypeError) as exc:
                result = f"error: {exc}"
            messages.append({"role": "tool", "tool_call_id": call.id, "content": result})
        if task["sample"] == 2:
            time.sleep(SLOW_TOOL_S)
        if task["sample"] == 3:  # an agent that compacts its history: the next prompt does not extend the last
            messages = [{"role": "user", "content": f"{task['prompt']} The add tool said {result}."}]
        last = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
        message = last.choices[0].message
    if task["index"] % 2:
        return None
    return (1.0 if called else 0.0) + len(message.content or "") / 100

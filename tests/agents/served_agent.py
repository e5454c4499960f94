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
# One HTTP client for every episode, and the model's name asked once, as an agent that plays many sessions keeps them:
# a client of its own costs each episode 35 ms of CPU (its SSL context), and 32 episodes that start together in one
# process then sent their first calls over ~1 s; on step 2 those must go out before step 1's update and sync end
# (2.3 s after the episodes start on an AMD EPYC, 2 cores), or no episode's calls straddle that sync.
_client = OpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0, timeout=300)
_model: str | None = None


def _misbehave() -> None:
    global _started
    with _lock:
        _started += 1
        mine = _started
    if mine == 1:
        raise RuntimeError("the agent's tool server is down")
    if mine == 2:
        time.sleep(HANG_S)


def _model_name(client: OpenAI) -> str:
    global _model
    with _lock:
        if _model is None:
            _model = client.models.list().data[0].id
        return _model


def agent(base_url: str, task: dict) -> float | None:
    _misbehave()
    client = _client.with_options(base_url=base_url)  # (shares `_client`'s connection pool)
    model = _model_name(client)
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

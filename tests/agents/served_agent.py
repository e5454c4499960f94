"""The agent of the --agent_program run (tests/agents/test_served_agents.py), written against the `openai` package
only, as any agent outside openppo would be: it asks the policy, runs the `add` tool when the reply calls it, sends
the result back (the fourth episode of each prompt compacts its history first, as agents that summarise do, so its
next prompt does not extend the last; the third has a slow tool on step 2), and returns 1.0 when the policy called the
tool (0.0 when it did not) plus a hundredth of the last answer's length in characters, or None on odd prompt indexes
to leave the score to the run's reward function. The length term gives each group's episodes different rewards even
when all of them call the tool (the SFT-ed model nearly always does), so step 1's update is never zero.

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
# The third episode of each prompt has a slow tool on step 2 (generated while step 1 trains, --async_train): it returns
# once the engines hold newer weights than its first call's (`weight_version` of /v1/models), so the answer after the
# tool comes from the weights step 1's sync brought and the tool call from the older ones. A fixed 8 s tool raced the
# update: on a loaded box (AMD EPYC, 2 cores, two busy processes beside) step 1's update and sync took 11.5 s.
STEP_2_ROUND = 2  # the rounds of the run: step 1's, the refill of the misbehaving episodes' group, step 2's
NEW_WEIGHTS_WAIT_S = 45  # at most (the run's --agent_timeout is 60 s); the test then finds no straddling episode
_lock = threading.Lock()
_started = 0
# One HTTP client for every episode, and the model's name asked once, as an agent that plays many sessions keeps them:
# a client of its own costs each episode 35 ms of CPU (its SSL context), and 32 episodes that start together in one
# process then sent their first calls over ~1 s; on step 2 those must go out before step 1's update and sync end
# (2.3 s after the episodes start on an AMD EPYC, 2 cores), or no episode's calls straddle that sync.
_client = OpenAI(base_url="http://unused/v1", api_key="unused", max_retries=0, timeout=300)
_model: str | None = None
_rounds: list[str] = []  # the rounds' session prefixes (<round>-<episode>), in the order their episodes started


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


def _round(task: dict) -> int:
    prefix = task["session"].rpartition("-")[0]
    with _lock:
        if prefix not in _rounds:
            _rounds.append(prefix)
        return _rounds.index(prefix)


def _await_newer_weights(client: OpenAI, fingerprint: str) -> None:
    """Until the engines hold weights newer than those that replied with `fingerprint` ("openppo-weights-v<N>")."""
    version = int(fingerprint.rpartition("-v")[2])
    deadline = time.monotonic() + NEW_WEIGHTS_WAIT_S
    while time.monotonic() < deadline and client.models.list().data[0].weight_version <= version:
        time.sleep(0.2)


def agent(base_url: str, task: dict) -> float | None:
    step_2 = _round(task) == STEP_2_ROUND
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
        if task["sample"] == 2 and step_2:
            _await_newer_weights(client, first.system_fingerprint)
        if task["sample"] == 3:  # an agent that compacts its history: the next prompt does not extend the last
            messages = [{"role": "user", "content": f"{task['prompt']} The add tool said {result}."}]
        last = client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=8)
        message = last.choices[0].message
    if task["index"] % 2:
        return None
    return (1.0 if called else 0.0) + len(message.content or "") / 100

"""The agent a user brings with --agent_program, and one episode of it.

An agent is written against the OpenAI API only. It gets the base URL of its episode's session on the run's endpoint
(`http://127.0.0.1:PORT/sessions/<id>/v1`: every call made through it belongs to the episode) and the task, plays the
episode, and returns its reward, or None to leave the scoring to the run's reward function:

- `FILE.py[:NAME]`: a Python callable `NAME(base_url, task)` (default name `agent`), run on a thread of the driver;
  `task` is a dict: prompt (the data set's text), label, index (the prompt's), sample (0..n-1), session;
- anything else is a command, run once per episode through the shell with OPENAI_BASE_URL, OPENAI_API_KEY (unused by
  the endpoint), ANTHROPIC_BASE_URL (the session's URL without /v1, for an agent on the Anthropic SDK),
  ANTHROPIC_API_KEY and OPENPPO_TASK (the task as JSON) in its environment; the last line it prints is the reward, a
  number or "none".

An episode that raises, exits non-zero, returns something else or outlives --agent_timeout is dropped (`Outcome.error`
says why: the traceback, the command's stderr, the time limit); the caller logs it and trains on none of it.
"""

from __future__ import annotations

import json
import math
import os
import shlex
import signal
import subprocess
import threading
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from openppo.errors import UserError
from openppo.utils.imports import import_file

FLAG = "--agent_program"
STDERR_TAIL = 2000  # characters of a failed command's stderr kept in its error


@dataclass(frozen=True)
class Outcome:
    reward: float | None = None
    error: str | None = None  # why the episode is dropped (None: it finished)
    extra: dict[str, float] = field(default_factory=dict)  # the episode's numbers to log, as env/<name>


def _reward(value: Any, where: str) -> Outcome:
    if value is None:
        return Outcome()
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        return Outcome(error=f"{where} returned {value!r}: return a finite number, or None for the reward function")
    return Outcome(reward=float(value))


class AgentProgram:
    """One of the two kinds of agent; `run` plays one episode within `timeout_s`."""

    name: str

    def run(self, base_url: str, task: dict[str, Any], timeout_s: float) -> Outcome:
        raise NotImplementedError


class PythonAgent(AgentProgram):
    def __init__(self, fn: Callable[[str, dict], Any], name: str):
        self.fn, self.name = fn, name

    def run(self, base_url: str, task: dict[str, Any], timeout_s: float) -> Outcome:
        result: list[Outcome] = []

        def play() -> None:
            try:
                value = self.fn(base_url, task)
                result.append(value if isinstance(value, Outcome) else _reward(value, self.name))
            except BaseException:  # the agent's own failure: its traceback is the message
                result.append(Outcome(error=f"{self.name} raised:\n{traceback.format_exc().rstrip()}"))

        # A thread cannot be stopped: one that runs over its time goes on in the background, and its session is
        # closed, so its later calls get a 409 and are not recorded.
        thread = threading.Thread(target=play, name=f"agent-{task.get('session')}", daemon=True)
        thread.start()
        thread.join(timeout_s)
        if thread.is_alive():
            return Outcome(error=f"{self.name} did not finish within {timeout_s:g} s (--agent_timeout)")
        return result[0]


class CommandAgent(AgentProgram):
    def __init__(self, command: str):
        self.command = self.name = command

    def run(self, base_url: str, task: dict[str, Any], timeout_s: float) -> Outcome:
        env = {
            **os.environ,
            "OPENAI_BASE_URL": base_url,
            "OPENAI_API_KEY": "openppo",
            # the Anthropic SDK (and CLIs built on it) append /v1/messages to the session's URL themselves
            "ANTHROPIC_BASE_URL": base_url.removesuffix("/v1"),
            "ANTHROPIC_API_KEY": "openppo",
            "OPENPPO_TASK": json.dumps(task),
        }
        proc = subprocess.Popen(
            self.command,
            shell=True,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            start_new_session=True,  # its own process group: a timeout stops whatever it started too
        )
        try:
            out, err = proc.communicate(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            return Outcome(error=f"`{self.command}` did not finish within {timeout_s:g} s (--agent_timeout)")
        if proc.returncode != 0:
            return Outcome(error=f"`{self.command}` exited with {proc.returncode}; stderr:\n{err[-STDERR_TAIL:]}")
        lines = [line.strip() for line in out.splitlines() if line.strip()]
        last = lines[-1] if lines else "none"
        if last.lower() == "none":
            return Outcome()
        try:
            return _reward(float(last), f"`{self.command}`")
        except ValueError:
            return Outcome(error=f"`{self.command}` printed {last!r} last: print the reward (a number) or none")


def load_agent_program(spec: str, flag: str = FLAG) -> AgentProgram:
    """`spec` as --agent_program takes it; a one-line UserError naming `flag` for a file or callable that is not
    there. A spec whose first word ends in .py is a Python file; anything else is a command."""
    words = shlex.split(spec)
    if len(words) != 1 or not words[0].split(":")[0].endswith(".py"):
        return CommandAgent(spec)
    path, _, name = words[0].partition(":")
    name = name or "agent"
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{flag}: agent file {path} not found; pass FILE.py[:NAME], NAME a callable (base_url, task)")
    module = import_file(p, flag, "openppo_agent_program_")
    fn = getattr(module, name, None)
    if not callable(fn):
        raise UserError(f"{flag}: {path} defines no callable {name!r}; add def {name}(base_url, task): ... or name it")
    return PythonAgent(fn, f"{p.name}:{name}")

"""The environment side of multi-turn RL: what a user's agent file defines, and how it is loaded.

An episode is one sample: the model answers the prompt, the environment reads the answer as text and returns a
`StepResult` (feedback for the next turn, a reward, whether the episode is over), and so on for at most
`--agent_max_turns` model turns. The environment never sees tokens: `openppo.agents.rollout` owns tokenization,
so the token ids the policy is trained on are exactly the ones the engine sampled (token in, token out), and
the feedback tokens it inserts are masked out of the loss.

A user's file (`--agent_func_path my_env.py`) defines `class Agent(AgentEnv)`; `load_agent_env` imports it. A Molt
agent file (`class AgentRunner(StepEnvRunner)`, Molt's `--train.agent_path`) is played through `openppo.agents.molt`,
an OpenRLHF one (`class AgentExecutor(MultiTurnAgentExecutor)`) through `openppo.agents.openrlhf_agent`.
"""

from __future__ import annotations

import abc
import inspect
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from openppo.errors import UserError
from openppo.utils.imports import import_file

FLAG = "--agent_func_path"
_FIX = (
    "class Agent(AgentEnv) (from openppo.agents import AgentEnv) with a step(self, response_text, turn) method, "
    "Molt's class AgentRunner(StepEnvRunner), or OpenRLHF's class AgentExecutor(MultiTurnAgentExecutor)"
)


class AgentError(RuntimeError):
    """An environment raised or returned something other than a `StepResult` during a rollout."""


class EnvTimeout(AgentError):
    """An environment call that did not return within --agent_timeout."""


@dataclass
class StepResult:
    """What the environment returns after one model turn."""

    feedback: str = ""
    """text appended as the next user/tool turn (through the rollout's feedback template); ignored when done"""
    reward: float = 0.0
    """this turn's reward; the episode's reward is the sum over its turns"""
    done: bool = False
    """end the episode now (it also ends after the last allowed turn)"""
    extra: dict[str, float] = field(default_factory=dict)
    """per-sample metrics to log; a later turn's value replaces an earlier one under the same name"""
    images: list = field(default_factory=list)
    """images shown with the feedback (PIL images, or the references `openppo.utils.images` reads), in the order
    of the image placeholders in its text, one each: over image prompts only (--max_images_per_prompt)"""


class AgentEnv(abc.ABC):
    """One episode of an environment: built once per sample, then `step` once per model turn.

    Args:
        prompt: the rendered prompt text the model saw (chat template applied, if any).
        label: the data set's label for this prompt (`--label_key`), or None.
    """

    decode_special_tokens: ClassVar[bool] = False
    """whether `step` gets the model's turn with its special tokens (Molt's and OpenRLHF's environments do)"""
    decode_stop_token: ClassVar[bool] = True
    """whether that text keeps the stop token that ended the turn (vLLM's `.text`, which OpenRLHF's environments
    read, leaves it out; without special tokens it is never there)"""

    def __init__(self, prompt: str, label: Any):
        self.prompt = prompt
        self.label = label

    @abc.abstractmethod
    def step(self, response_text: str, turn: int) -> StepResult:
        """React to the model's answer of turn `turn` (0-based), decoded without special tokens."""


def load_agent_env(path: str | Path, flag: str = FLAG) -> type[AgentEnv]:
    """The `Agent` class of the .py file at `path`; a one-line UserError naming `flag` and the fix otherwise (also
    for a Molt chat agent, which `load_agent` gives and the run plays through its endpoint)."""
    agent = load_agent(path, flag)
    if not isinstance(agent, type):
        raise UserError(f"{flag}: {path} holds a Molt ChatAgentRunner, played through the run's endpoint; not here")
    return agent


def load_agent(path: str | Path, flag: str = FLAG) -> type[AgentEnv] | Any:
    """What the .py file at `path` plays: its `Agent` class, the AgentEnv class of a Molt `StepEnvRunner` or of an
    OpenRLHF `AgentExecutor`, or the `AgentRunner` instance itself of a Molt `ChatAgentRunner` (an agent that calls
    the endpoint: `molt.chat_program` plays it); a one-line UserError naming `flag` and the fix otherwise."""
    p = Path(path).expanduser()
    if not p.is_file():
        raise UserError(f"{flag}: agent file {path} not found; pass an existing .py file that defines {_FIX}")
    if p.suffix != ".py":
        raise UserError(f"{flag}: {path} is not a .py file; pass a Python file that defines {_FIX}")
    from openppo.agents import molt, openrlhf_agent

    # a Molt agent file imports molt.agents, an OpenRLHF one openrlhf.utils.agent
    with molt.molt_modules(), openrlhf_agent.openrlhf_modules():
        module = import_file(p, flag, "openppo_agent_env_")
    cls = getattr(module, "Agent", None)
    if cls is None and inspect.isclass(getattr(module, "AgentExecutor", None)):
        return openrlhf_agent.agent_env(module.AgentExecutor, str(path), flag)
    if cls is None and inspect.isclass(getattr(module, "AgentRunner", None)):
        try:
            runner = module.AgentRunner()
        except Exception as err:
            why = f"{type(err).__name__}: {err}"
            raise UserError(f"{flag}: AgentRunner() of {path} raised {why}; fix the file") from err
        if getattr(runner, "env_cls", None) is None and getattr(runner, "agent_cls", None) is not None:
            return runner  # a ChatAgentRunner
        return molt.agent_env(runner, str(path), flag)
    if cls is None:
        raise UserError(f"{flag}: {path} defines no Agent; add {_FIX}")
    if not (inspect.isclass(cls) and issubclass(cls, AgentEnv)):
        raise UserError(f"{flag}: Agent in {path} is not a subclass of openppo.agents.AgentEnv; declare it as {_FIX}")
    if inspect.isabstract(cls):
        raise UserError(f"{flag}: Agent in {path} does not implement step(self, response_text, turn) -> StepResult")
    return cls

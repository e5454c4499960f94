"""Molt's agent interface (`--train.agent_path`, a recipe from NVIDIA-NeMo/labs-molt): its agent files run unchanged.

A Molt agent file says `from molt.agents import Env, Result, StepEnvRunner`, defines `class MyEnv(Env)` with an async
`step(state) -> Result` (and an optional async `reset(state) -> state`), and exports `class AgentRunner(StepEnvRunner)`
bound to it. Without Molt installed, `molt_modules` puts this module in `sys.modules` as `molt.agents` while such a
file is imported, so the names resolve here; with Molt installed its own classes are used. Either way `agent_env`
turns the runner into an openppo `AgentEnv`, and the multi-turn rollout (`openppo.agents.rollout`) plays it exactly
as an `--agent_func_path` environment: token in, token out, the feedback masked out of the loss.

The mapping, per model turn: Molt's state is `observation_text` (the prompt and every earlier turn and feedback, as
text), `action_text` (this turn, decoded with its special tokens, as Molt does) and `label`; `sampling_params` is
None (openppo's sampling settings are the run's, one per run). The `Result`'s reward adds to the episode's, its
`observation` is the next turn's feedback (encoded raw, no template, as in Molt), `terminated` or `truncated` ends
the episode (so does --agent_max_turns), `info` and `score` are logged per sample. The steps of a turn's running
episodes are awaited concurrently on one event loop, as Molt awaits them, each within --agent_timeout
(`openppo.agents.async_env`, shared with OpenRLHF's agent files); its `images` are shown with the feedback (over image
prompts: `openppo.agents.rollout`). What openppo does not do is refused in one line naming the episode: a `reset`
that rewrites the first observation (the prompt is rendered from the data set), per-turn sampling parameters.

A file exporting `class AgentRunner(ChatAgentRunner)` bound to a `ChatAgent` (an async `run(ctx) -> Result` that
calls the policy through the OpenAI API itself) is played as an --agent_program (`chat_program`): each episode's
`ChatContext` carries the data set's prompt as unrendered chat messages, its tools and label, and the base URL of the
episode's session on the run's endpoint (`openppo.agents.endpoint`), which renders every request with the chat
template and records the tokens the engines generate; the `Result`'s scalar reward is the episode's, and the
numbers in its `info` and `score` are logged as `env/<name>`, as an environment's are. The endpoint speaks OpenAI's
wire protocol and, at the session URL, Anthropic's Messages API (`openppo.agents.anthropic_wire`), and takes text.
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import sys
import types
from abc import ABC, abstractmethod
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from openppo.agents.async_env import AsyncStepEnv, logged, refuse_sampling_params, scalar
from openppo.agents.base import AgentEnv, AgentError, StepResult
from openppo.agents.program import AgentProgram, Outcome, PythonAgent
from openppo.errors import UserError


@dataclass
class Result:
    """What an `Env.step` returns (Molt's fields, Gymnasium's step tuple)."""

    reward: Any = 0.0
    observation: str = ""
    terminated: bool = True
    truncated: bool = False
    info: dict = field(default_factory=dict)
    score: Any = None
    images: list | None = None
    sampling_params: object = None


class Env(ABC):
    """One episode's environment: `reset` once, then `step` once per model turn (both coroutines)."""

    def __init__(self, *args, **kwargs):  # noqa: B027 (Molt's: a subclass need not call it)
        pass

    async def reset(self, state: dict, **kwargs) -> dict:
        return state

    @abstractmethod
    async def step(self, state: dict, **kwargs) -> Result:
        raise NotImplementedError


class Runner:
    """What a Molt agent file exports as `AgentRunner`."""


class StepEnvRunner(Runner):
    def __init__(self, env_cls: type):
        if not (isinstance(env_cls, type) and issubclass(env_cls, Env)):
            raise TypeError("StepEnvRunner(env_cls): env_cls must be a subclass of molt.agents.Env")
        self.env_cls = env_cls


@dataclass
class ChatContext:
    """What a `ChatAgent.run` gets for one episode (Molt's fields)."""

    messages: list  # the data set's prompt as OpenAI chat messages, unrendered: send them as they are
    tools: list | None  # the row's tool schemas (--tools_key), or None
    prompt: str  # the last user message's text
    label: Any
    images: list | None  # always None here: the endpoint takes text
    base_url: str  # the episode's session on the run's endpoint, with /v1: an OpenAI client's base_url
    session_url: str  # the same without /v1
    model_name: str  # the name the endpoint serves the policy under
    api_key: str
    session_id: str
    sampling_params: Any  # .max_tokens, .temperature, .top_p, .top_k: the run's settings
    max_length: int  # prompt + response tokens an episode's context may reach (--max_len)


class ChatAgent(ABC):
    """Molt's agent that calls the policy through the OpenAI API itself: an async `run(ctx) -> Result`."""

    def __init__(self, *args, **kwargs):  # noqa: B027 (Molt's: a subclass need not call it)
        pass

    @abstractmethod
    async def run(self, ctx: ChatContext) -> Result:
        raise NotImplementedError


class ChatAgentRunner(Runner):
    """Molt's runner of a `ChatAgent`: openppo plays it through the run's endpoint (`chat_program`)."""

    def __init__(self, agent_cls: type):
        if not (isinstance(agent_cls, type) and issubclass(agent_cls, ChatAgent)):
            raise TypeError("ChatAgentRunner(agent_cls): agent_cls must be a subclass of molt.agents.ChatAgent")
        self.agent_cls = agent_cls


@dataclass(frozen=True)
class ChatSettings:
    """The run's side of a `ChatContext`: the endpoint's model name and the sampling and length limits."""

    model_name: str
    max_tokens: int
    temperature: float
    top_p: float
    top_k: int
    max_length: int


def _last_user_text(messages: list) -> str:
    """The text of the last user message (the text parts of a list content)."""
    last = next((m for m in reversed(messages) if m.get("role") == "user"), {})
    content = last.get("content")
    if isinstance(content, list):
        return "".join(str(part.get("text") or "") for part in content if isinstance(part, dict))
    return "" if content is None else str(content)


def chat_program(runner: Any, path: str, settings: ChatSettings) -> AgentProgram:
    """The --agent_program that plays the Molt `ChatAgentRunner` instance `runner` of the file `path`: each episode
    builds a `ChatContext` from the task (`messages`, `tools`, `label`, the session's URL) and awaits the agent's
    `run` on an event loop of the episode's own thread; the `Result`'s scalar reward is the episode's, its `info`
    and `score` numbers the episode's logged extras."""
    agent_cls = runner.agent_cls
    name = f"{Path(path).name}:{agent_cls.__name__}"

    def play(base_url: str, task: dict[str, Any]) -> Outcome:
        messages = task["messages"]
        ctx = ChatContext(
            messages=[dict(m) for m in messages],
            tools=task.get("tools"),
            prompt=_last_user_text(messages),
            label=task.get("label"),
            images=None,
            base_url=base_url,
            session_url=base_url.removesuffix("/v1"),
            model_name=settings.model_name,
            api_key="EMPTY",
            session_id=task["session"],
            sampling_params=types.SimpleNamespace(
                n=1,
                max_tokens=settings.max_tokens,
                temperature=settings.temperature,
                top_p=settings.top_p,
                top_k=settings.top_k,
            ),
            max_length=settings.max_length,
        )
        result = asyncio.run(agent_cls().run(ctx))
        if not isinstance(result, Result) and type(result).__name__ != "Result":
            raise AgentError(f"{agent_cls.__name__}.run returned {type(result).__name__}; return a Result")
        reward = scalar(result.reward)
        if reward is None:
            raise AgentError(f"{agent_cls.__name__}.run returned a Result without a scalar reward")
        return Outcome(reward=reward, extra=logged(result.info, result.score))

    return PythonAgent(play, name)


@contextlib.contextmanager
def molt_modules():
    """While a Molt agent file is imported: `molt.agents` resolves to this module, unless Molt itself is
    installed. The entries stay afterwards (a file may import lazily, inside `step`)."""
    if "molt.agents" not in sys.modules and importlib.util.find_spec("molt") is None:
        package = types.ModuleType("molt")
        package.__path__ = []  # a package: `import molt.agents` looks here
        package.agents = sys.modules[__name__]
        sys.modules.setdefault("molt", package)
        for name in ("molt.agents", "molt.agents.base", "molt.agents.chat_agent"):  # where Molt's files import from
            sys.modules.setdefault(name, sys.modules[__name__])
    yield


def agent_env(runner: Any, path: str, flag: str) -> type[AgentEnv]:
    """The openppo environment class that plays the Molt `AgentRunner` instance `runner` of the file `path`."""
    env_cls = getattr(runner, "env_cls", None)
    if env_cls is None:
        raise UserError(
            f"{flag}: {path}: AgentRunner is neither a StepEnvRunner(Env) nor a ChatAgentRunner(ChatAgent), the Molt "
            "agents openppo plays; bind it to one of them"
        )

    class MoltEnv(AsyncStepEnv):
        episode_cls: ClassVar[type] = env_cls

        def _result(self, result: Any) -> StepResult:
            if not isinstance(result, Result) and type(result).__name__ != "Result":
                raise AgentError(f"{env_cls.__name__}.step returned {type(result).__name__}; return a Result")
            reward = scalar(result.reward)
            if reward is None:
                raise AgentError(f"{env_cls.__name__}.step returned a Result without a scalar reward")
            refuse_sampling_params(env_cls.__name__, result.sampling_params)
            return StepResult(
                feedback=result.observation or "",
                reward=reward,
                done=bool(result.terminated or result.truncated),
                extra=logged(result.info, result.score),
                images=list(result.images or ()),
            )

    MoltEnv.__name__ = MoltEnv.__qualname__ = f"Molt{env_cls.__name__}"
    return MoltEnv

"""OpenRLHF's agent files (`--agent_func_path` / `--train.agent_func_path`, OpenRLHF 0.9 to 0.11) run unchanged.

Such a file says `from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor`, defines
`class AgentInstance(AgentInstanceBase)` with an async `step(states) -> dict` (and an optional async `reset`), and
exports `class AgentExecutor(MultiTurnAgentExecutor)` whose `__init__` binds it: `super().__init__(AgentInstance)`.
Without OpenRLHF installed, `openrlhf_modules` puts this module in `sys.modules` as `openrlhf.utils.agent` while such a
file is imported, so the names resolve here; with OpenRLHF installed its own classes are used. `agent_env` turns the
executor class into an openppo `AgentEnv` (`openppo.agents.async_env`, as Molt's files are), which the multi-turn
rollout plays token in, token out, the feedback masked out of the loss.

The mapping, per model turn, as OpenRLHF's `MultiTurnAgentExecutor` hands it over:
- `reset` gets `{"observation": prompt, "label": label}` (the prompt rendered from the data set) and returns the state;
- `step` gets `observation_text` (the prompt and every earlier turn and feedback, as text), `action_text` (the turn
  decoded as vLLM's `.text` with OpenRLHF's `skip_special_tokens=False`: special tokens kept, the stop token that
  ended the turn left out), `label`, and `sampling_params` None (every turn samples with the run's settings);
- of the dict it returns, `rewards` (a number, or the first element of a tensor) adds to the episode's reward,
  `environment_feedback` is appended raw (no template) when the episode goes on, `done` ends it (so do
  --agent_max_turns and the length budget), `environment_images` are shown with it (over image prompts:
  `openppo.agents.rollout`), and the numbers in `extra_logs` and `scores` are logged as `env/<name>` and
  `env/score`. Dynamic filtering reads the episode's reward (OpenRLHF reads `scores`).

Refused in one line: an executor that drives the engine itself (its own `execute`, OpenRLHF's OpenAI-server and
NeMo-Gym executors: serve such an agent as --agent_program), the pre-0.9 executor that takes the engine in its
constructor, and per episode a `reset` that rewrites the prompt and `sampling_params` of its own.
"""

from __future__ import annotations

import contextlib
import importlib.util
import inspect
import sys
import types
from abc import ABC, abstractmethod
from typing import Any, ClassVar

from openppo.agents.async_env import AsyncStepEnv, logged, refuse_sampling_params, scalar
from openppo.agents.base import AgentEnv, AgentError, StepResult
from openppo.errors import UserError

MODULE = "openrlhf.utils.agent"
_REQUIRED = ("rewards", "environment_feedback", "done")  # the keys OpenRLHF's executor reads without a default
_KEYS = ", ".join(_REQUIRED)


class AgentInstanceBase(ABC):
    """One episode's environment (OpenRLHF's): built with no arguments, `reset` once, `step` once per model turn."""

    def __init__(self, *args, **kwargs):  # noqa: B027 (OpenRLHF's is abstract; a subclass need not call it)
        pass

    async def reset(self, states: dict, **kwargs) -> dict:
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs) -> dict:
        raise NotImplementedError


class AgentExecutorBase(ABC):
    """What an OpenRLHF agent file exports as `AgentExecutor`."""

    @abstractmethod
    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        raise NotImplementedError


class MultiTurnAgentExecutor(AgentExecutorBase):
    """The executor that plays an `AgentInstanceBase` subclass; openppo drives its turns (`agent_env`)."""

    def __init__(self, agent_instance_cls: type):
        if not (isinstance(agent_instance_cls, type) and issubclass(agent_instance_cls, AgentInstanceBase)):
            raise TypeError("MultiTurnAgentExecutor(agent_instance_cls): it must be a subclass of AgentInstanceBase")
        self.agent_instance_cls = agent_instance_cls

    async def execute(self, prompt, label, sampling_params, max_length, hf_tokenizer, llm_engine, images=None):
        raise RuntimeError("openppo plays the turns of an AgentInstance itself (openppo.agents.openrlhf_agent)")


@contextlib.contextmanager
def openrlhf_modules():
    """While an OpenRLHF agent file is imported: `openrlhf.utils.agent` resolves to this module, unless OpenRLHF
    itself is installed. The entries stay afterwards (a file may import lazily, inside `step`)."""
    if MODULE not in sys.modules and importlib.util.find_spec("openrlhf") is None:
        for name in ("openrlhf", "openrlhf.utils"):
            package = types.ModuleType(name)
            package.__path__ = []  # a package: `import openrlhf.utils.agent` looks here
            sys.modules.setdefault(name, package)
        sys.modules["openrlhf.utils"].agent = sys.modules[__name__]
        sys.modules.setdefault(MODULE, sys.modules[__name__])
    yield


def agent_env(executor_cls: type, path: str, flag: str) -> type[AgentEnv]:
    """The openppo environment class that plays the `AgentExecutor` class `executor_cls` of the file `path`; a
    one-line UserError naming `flag` for an executor openppo cannot play."""
    base = getattr(sys.modules.get(MODULE), "MultiTurnAgentExecutor", MultiTurnAgentExecutor)
    fix = "bind it as OpenRLHF's examples do: AgentExecutor(MultiTurnAgentExecutor), super().__init__(AgentInstance)"
    required = [
        p.name
        for p in inspect.signature(executor_cls).parameters.values()
        if p.default is p.empty and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)
    ]
    if required:
        raise UserError(
            f"{flag}: {path}: AgentExecutor takes {', '.join(required)} (OpenRLHF < 0.9's executor, given the "
            f"engine); {fix}"
        )
    if not issubclass(executor_cls, base):
        raise UserError(
            f"{flag}: {path}: AgentExecutor is not a MultiTurnAgentExecutor: it drives the engine itself, which "
            f"openppo does; serve an agent that calls the OpenAI API as --agent_program instead, or {fix}"
        )
    if any("execute" in vars(c) for c in executor_cls.__mro__[: executor_cls.__mro__.index(base)]):
        raise UserError(
            f"{flag}: {path}: AgentExecutor overrides execute; openppo drives the turns of the AgentInstance itself: "
            "drop the override, or serve an agent that calls the OpenAI API as --agent_program"
        )
    try:
        executor = executor_cls()
    except Exception as err:
        raise UserError(f"{flag}: AgentExecutor() of {path} raised {type(err).__name__}: {err}; fix the file") from err
    instance_cls = executor.agent_instance_cls
    if inspect.isabstract(instance_cls):
        raise UserError(f"{flag}: {instance_cls.__name__} in {path} does not implement async step(self, states)")

    class OpenRLHFEnv(AsyncStepEnv):
        episode_cls: ClassVar[type] = instance_cls
        decode_stop_token: ClassVar[bool] = False  # vLLM's .text leaves out the stop token that ended the turn

        def _result(self, result: Any) -> StepResult:
            name = instance_cls.__name__
            if not isinstance(result, dict):
                raise AgentError(f"{name}.step returned {type(result).__name__}; return a dict with {_KEYS}")
            missing = [k for k in _REQUIRED if k not in result]
            if missing:
                raise AgentError(f"{name}.step returned a dict without {', '.join(missing)}; return {_KEYS}")
            reward = scalar(result["rewards"])
            if reward is None:
                raise AgentError(f"{name}.step returned rewards {result['rewards']!r}; return a number or tensor")
            refuse_sampling_params(name, result.get("sampling_params"))
            return StepResult(
                feedback=str(result["environment_feedback"] or ""),
                reward=reward,
                done=bool(result["done"]),
                extra=logged(result.get("extra_logs"), result.get("scores")),
                images=list(result.get("environment_images") or ()),
            )

    OpenRLHFEnv.__name__ = OpenRLHFEnv.__qualname__ = f"OpenRLHF{instance_cls.__name__}"
    return OpenRLHFEnv

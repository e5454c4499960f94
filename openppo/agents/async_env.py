"""Environments written as async episode objects over a state dict, played as openppo multi-turn environments.

Molt's `Env` (`openppo.agents.molt`) and OpenRLHF's `AgentInstance` (`openppo.agents.openrlhf_agent`) have the same
shape: one object per episode, an async `reset(state)` given `{"observation": prompt, "label": label}`, then an async
`step(state)` per model turn given `observation_text` (the prompt and every earlier turn and feedback, as text),
`action_text` (this turn), `label` and `sampling_params`. They differ in what `step` returns. `AsyncStepEnv` holds what
is common; a subclass reads a step's return (`_result`).

- One event loop on a thread of its own runs every such coroutine of the process (`EventLoop`): an episode object
  may keep loop-bound objects (an aiohttp session) from one turn to the next.
- `reset` runs once, when the episode is built; one that rewrites the first observation is refused (the prompt is
  rendered from the data set, and the group's episodes share it).
- The steps of a turn's running episodes are awaited concurrently (`step_all`), as both frameworks await them, each
  within --agent_timeout: a turn of episodes that each wait on a tool server takes one wait, not one per episode.
- `sampling_params` is None: openppo samples every turn with the run's settings.
"""

from __future__ import annotations

import asyncio
import inspect
import numbers
import threading
from abc import abstractmethod
from typing import Any, ClassVar

from openppo.agents.base import AgentEnv, AgentError, EnvTimeout, StepResult


class EventLoop:
    """One event loop on a thread of its own for every async environment of the process (module docstring)."""

    _loop: asyncio.AbstractEventLoop | None = None
    _lock = threading.Lock()

    @classmethod
    def run(cls, coroutine):
        with cls._lock:
            if cls._loop is None:
                cls._loop = asyncio.new_event_loop()
                threading.Thread(target=cls._loop.run_forever, name="agent-env-loop", daemon=True).start()
        return asyncio.run_coroutine_threadsafe(coroutine, cls._loop).result()


def scalar(value: Any) -> float | None:
    """A reward, score or logged value as both frameworks read one: a number, or the first element of a tensor or
    list; None for anything else (a string is not logged)."""
    if hasattr(value, "detach") and hasattr(value, "flatten"):
        flat = value.detach().flatten()
        return float(flat[0].item()) if flat.numel() else None
    if isinstance(value, (list, tuple)):
        return scalar(value[0]) if value else None
    return float(value) if isinstance(value, numbers.Real) else None


def logged(values: dict | None, score: Any = None) -> dict[str, float]:
    """What is logged of a step: the numbers among `values` (a string is not logged), and `score` as `score` when it
    is one."""
    extra = {str(k): v for k, v in ((k, scalar(v)) for k, v in (values or {}).items()) if v is not None}
    if scalar(score) is not None:
        extra["score"] = scalar(score)
    return extra


class AsyncStepEnv(AgentEnv):
    """An openppo environment that plays the async episode class `episode_cls` (module docstring)."""

    decode_special_tokens: ClassVar[bool] = True  # both frameworks' action_text keeps them (answer and tool markers)
    episode_cls: ClassVar[type]

    def __init__(self, prompt: str, label: Any):
        super().__init__(prompt, label)
        self.env = self._build()
        state = EventLoop.run(self.env.reset({"observation": prompt, "label": label}))
        name = self.episode_cls.__name__
        if not isinstance(state, dict):
            raise AgentError(f"{name}.reset returned {type(state).__name__}; return the state dict")
        if state.get("observation", prompt) != prompt:
            raise AgentError(
                f"{name}.reset rewrote the first observation; openppo renders the prompt from the data set "
                "(--input_key, --apply_chat_template): put that text in the data set instead"
            )
        self.text = prompt

    def _build(self) -> Any:
        """The episode object. An `async def __init__` (some of OpenRLHF's examples declare one, which a plain call
        cannot run) is awaited on the loop."""
        cls = self.episode_cls
        if inspect.iscoroutinefunction(cls.__init__):
            env = cls.__new__(cls)
            EventLoop.run(env.__init__())
            return env
        return cls()

    @abstractmethod
    def _result(self, result: Any) -> StepResult:
        """The StepResult of what the episode's `step` returned; AgentError naming the class if it is wrong."""

    def step(self, response_text: str, turn: int) -> StepResult:
        return self._finish(EventLoop.run(self.env.step(self._state(response_text))), response_text)

    @classmethod
    def step_all(
        cls, envs: list[AsyncStepEnv], texts: list[str], turn: int, timeout_s: float | None
    ) -> list[StepResult | BaseException]:
        """Every running episode's step of a turn at once: concurrently on the one event loop, each within
        `timeout_s` (a late one is cancelled, and its entry an EnvTimeout); an episode's error is its entry."""

        async def own(env: AsyncStepEnv, text: str):
            try:
                return await env.env.step(env._state(text))
            except Exception as err:  # the step's own, a TimeoutError among them, kept apart from wait_for's
                return err

        async def one(env: AsyncStepEnv, text: str):
            try:
                return await asyncio.wait_for(own(env, text), timeout_s)
            except asyncio.TimeoutError:
                return EnvTimeout()

        async def together():
            return await asyncio.gather(*(one(e, t) for e, t in zip(envs, texts)), return_exceptions=True)

        out: list[StepResult | BaseException] = []
        for env, text, result in zip(envs, texts, EventLoop.run(together())):
            try:
                out.append(result if isinstance(result, BaseException) else env._finish(result, text))
            except AgentError as err:
                out.append(err)
        return out

    def _state(self, response_text: str) -> dict:
        state = {"observation_text": self.text, "action_text": response_text, "label": self.label}
        return {**state, "sampling_params": None}

    def _finish(self, result: Any, response_text: str) -> StepResult:
        """The step's StepResult, checked; the episode's text grows by the turn and its feedback."""
        step = self._result(result)
        self.text += response_text + step.feedback
        return step


def refuse_sampling_params(name: str, sampling_params: Any) -> None:
    """What neither framework's step may return here: sampling parameters of its own (every turn samples with the
    run's)."""
    if sampling_params is not None:
        raise AgentError(
            f"{name}.step returned sampling_params: openppo samples every turn with the run's settings "
            "(--temperature, --top_p, --generate_max_len)"
        )

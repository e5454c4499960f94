"""Multi-turn agents: an environment answers each model turn with feedback (text, and images over image prompts),
token in, token out.

`AgentEnv` / `StepResult` (base.py) are what a user's `--agent_func_path` file implements; `load_agent_env`
imports it (`load_agent` also gives a Molt chat agent's runner, which `molt.chat_program` plays).
`run_agent_episodes` (rollout.py) plays the episodes against a generation engine, batching every turn, and returns
`openppo.ppo.experience.Sample`s whose feedback tokens carry `action_mask` 0. `Transcript` (transcript.py) turns the
calls an agent makes through the OpenAI-compatible endpoint (endpoint.py) into training segments.
"""

from openppo.agents.base import AgentEnv, AgentError, StepResult, load_agent, load_agent_env
from openppo.agents.rollout import GenerateFn, engine_generate_fn, run_agent_episodes
from openppo.agents.transcript import Call, Segment, Transcript

__all__ = [
    "AgentEnv",
    "AgentError",
    "Call",
    "GenerateFn",
    "Segment",
    "StepResult",
    "Transcript",
    "engine_generate_fn",
    "load_agent",
    "load_agent_env",
    "run_agent_episodes",
]

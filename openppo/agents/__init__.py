"""Multi-turn agents: an environment answers each model turn with text feedback, token in, token out.

`AgentEnv` / `StepResult` (base.py) are what a user's `--agent_func_path` file implements; `load_agent_env`
imports it. `run_agent_episodes` (rollout.py) plays the episodes against a generation engine, batching every
turn, and returns `openppo.ppo.experience.Sample`s whose feedback tokens carry `action_mask` 0.
"""

from openppo.agents.base import AgentEnv, AgentError, StepResult, load_agent_env
from openppo.agents.rollout import GenerateFn, engine_generate_fn, run_agent_episodes

__all__ = [
    "AgentEnv",
    "AgentError",
    "GenerateFn",
    "StepResult",
    "engine_generate_fn",
    "load_agent_env",
    "run_agent_episodes",
]

"""An environment written against OpenRLHF's agent interface (`openrlhf.utils.agent`, OpenRLHF 0.9 to 0.11), as the
file an OpenRLHF recipe passes to --agent_func_path is: openppo plays it through `openppo.agents.openrlhf_agent`
(tests/agents/test_openrlhf_agent.py with a scripted engine).

Two model turns, in the shape of OpenRLHF's examples: an `async def __init__` (as its gem example declares), a
`reset` that returns the observation it was given, and a `step` that returns the executor's dict with tensors. Each
turn earns the share of its characters that are vowels, and the episode ends after the second.
"""

from typing import Any

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

FEEDBACK = " Vowels only: "
SEEN: list[dict] = []  # every step's state (the scripted test reads them)


class AgentInstance(AgentInstanceBase):
    async def __init__(self, *args, **kwargs):
        self.step_idx = 0

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> dict[str, Any]:
        SEEN.append(dict(states))
        self.step_idx += 1
        text = states["action_text"]
        share = sum(c in "aeiou" for c in text) / max(len(text), 1)
        done = self.step_idx >= 2
        return {
            "rewards": torch.tensor([share]),
            "scores": torch.tensor(float(share > 0.5)),
            "environment_feedback": "\n" if done else FEEDBACK,
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": {"vowel_share": torch.tensor(share), "answer": text},  # (text is not a metric: not logged)
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

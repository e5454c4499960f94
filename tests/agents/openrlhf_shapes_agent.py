"""A two-turn agent over image prompts, written against OpenRLHF's agent interface as its VLM agent recipe's file is
(tests/ppo/test_vlm_grpo.py runs it on the shapes task with the tiny VLM).

The first turn answers the picture's question; the environment asks to count again (text feedback), and the second
turn's count is scored: 1.0 when it is the label, plus a hundredth of the answer's length in characters, so that a
random tiny model's episodes earn different rewards within a group. It checks what it is given: the prompt shows its
image placeholder and the label is a count of 1..4.
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from openppo.tasks.arithmetic import reward

FEEDBACK = "\nCount them again: how many shapes?\n"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turns = 0

    async def reset(self, states, **kwargs):
        if "<image>" not in states["observation"] or states["label"] not in ("1", "2", "3", "4"):
            raise ValueError(f"an image prompt with its count expected, got {states!r}")
        return states

    async def step(self, states, **kwargs):
        self.turns += 1
        done = self.turns == 2
        score = reward(states["action_text"], states["label"]) + len(states["action_text"]) / 100 if done else 0.0
        return {
            "rewards": torch.tensor(score),
            "environment_feedback": FEEDBACK,
            "done": done,
            "extra_logs": {"counted": float(done)},
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

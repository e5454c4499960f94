"""A two-turn agent over image prompts, written against OpenRLHF's agent interface as its VLM agent recipe's file is
(tests/ppo/test_vlm_grpo.py runs it on the shapes task with the tiny VLM).

The first turn answers the picture's question; the environment shows the shapes again, drawn apart in a picture of
its own (`environment_images`, its `<image>` placeholder in the feedback text, as OpenRLHF's VLM agent shows a
screenshot), and asks to count again; the second turn's count is scored: 1.0 when it is the label, plus a hundredth
of the answer's length in characters, so that a random tiny model's episodes earn different rewards within a group.
It checks what it is given: the prompt shows its image placeholder and the label is a count of 1..4.
"""

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

from openppo.tasks.arithmetic import reward
from openppo.tasks.shapes import draw

FEEDBACK = "\nHere they are again, apart: <image>\nHow many shapes?\n"


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turns = 0

    async def reset(self, states, **kwargs):
        if "<image>" not in states["observation"] or states["label"] not in ("1", "2", "3", "4"):
            raise ValueError(f"an image prompt with its count expected, got {states!r}")
        return states

    async def step(self, states, **kwargs):
        self.turns += 1
        if self.turns == 1:
            apart = [("square", "black", 2 + 14 * i, 20, 10) for i in range(int(states["label"]))]
            return {
                "rewards": torch.tensor(0.0),
                "environment_feedback": FEEDBACK,
                "environment_images": [draw(apart, 56)],
                "done": False,
            }
        score = reward(states["action_text"], states["label"]) + len(states["action_text"]) / 100
        return {"rewards": torch.tensor(score), "environment_feedback": "", "done": True, "extra_logs": {"counted": 1}}


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)

"""An environment written against Molt's agent interface (`molt.agents`, NVIDIA-NeMo/labs-molt), as the file a Molt
recipe passes to --train.agent_path is: openppo plays it through `openppo.agents.molt` (tests/agents/test_molt_agent.py
with a scripted engine; tests/ppo/test_molt_quick_start.py in Molt's quick-start recipe).

Two model turns: after the first the environment asks for vowels, the second ends the episode. Each turn earns the
share of its characters that are vowels (a tensor, as Molt's examples return), so the episodes of a random tiny
model earn different rewards within a group (Molt's quick-start drops groups whose rewards are all 0 or all 1).
"""

import torch
from molt.agents import Env, Result, StepEnvRunner

FEEDBACK = " Vowels only: "
SEEN: list[dict] = []  # every step's state (the scripted test reads them)


class VowelsEnv(Env):
    def __init__(self):
        super().__init__()
        self.turns = 0

    async def step(self, state):
        SEEN.append(dict(state))
        self.turns += 1
        text = state["action_text"]
        share = sum(c in "aeiou" for c in text) / max(len(text), 1)
        last = self.turns == 2
        return Result(
            reward=torch.tensor([share]),
            observation="" if last else FEEDBACK,
            terminated=last,
            info={"vowel_share": torch.tensor(share), "answer": text},  # (the text is not a metric: not logged)
            score=float(share > 0.5),
        )


class AgentRunner(StepEnvRunner):
    def __init__(self):
        super().__init__(VowelsEnv)

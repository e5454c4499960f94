"""A guessing game for multi-turn RL: find the secret digit, told "higher" or "lower" after each wrong guess.

The label is the secret integer 0..9. Each model turn is read for its first integer; the environment answers
"higher", "lower", or, when the turn holds no integer, asks for one. A correct guess ends the episode with
reward 1.0; wrong guesses earn nothing, so the policy can only gain by using the feedback within
`--agent_max_turns` turns. `guess_number/solved` is logged as `env/guess_number/solved`, the mean over the batch.

Prompts: `python examples/agents/guess_number.py prompts.jsonl 256` writes 256 rows {"input", "label"} for
`--prompt_data prompts.jsonl --input_key input --label_key label`.
"""

import json
import random
import re
import sys

from openppo.agents import AgentEnv, StepResult

PROMPT = "I picked a secret integer from 0 to 9. Guess it: answer with one number. I will say higher or lower."
_INTEGER = re.compile(r"-?\d+")


class Agent(AgentEnv):
    def __init__(self, prompt, label):
        super().__init__(prompt, label)
        self.secret = int(label)  # labels read from JSON may be strings

    def step(self, response_text, turn):
        match = _INTEGER.search(response_text)
        if match is None:
            return StepResult(feedback="Answer with one integer from 0 to 9.", extra={"guess_number/solved": 0.0})
        guess = int(match.group())
        if guess == self.secret:
            return StepResult(feedback="correct", reward=1.0, done=True, extra={"guess_number/solved": 1.0})
        return StepResult(feedback="higher" if guess < self.secret else "lower", extra={"guess_number/solved": 0.0})


def write_prompts(path: str, num_prompts: int, seed: int = 0) -> None:
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(num_prompts):
            f.write(json.dumps({"input": PROMPT, "label": rng.randint(0, 9)}) + "\n")


if __name__ == "__main__":
    write_prompts(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 256)

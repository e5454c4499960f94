"""A tiny policy that calls a tool: the suite's tiny model SFT-ed (tests/ppo/distill_models.sft_model_dir) to answer a
question rendered with the `add` tool (Qwen2.5's chat template, as the endpoint renders it) with a Hermes tool call,
`<tool_call>{"name": "add", "arguments": {"a": A, "b": B}}</tool_call>` with the question's numbers, and then the
end token. A random tiny model would never write one, and the agent test needs tool calls that vLLM's parser reads;
sampled at temperature 1 the SFT-ed model still breaks some of them, so the rewards vary."""

from __future__ import annotations

import json
import random
from pathlib import Path

from tests.agents.served_agent import TOOLS
from tests.ppo.distill_models import sft_model_dir


def question(a: int, b: int) -> str:
    return f"What is {a} + {b}?"


def tool_model_dir(pairs: list[tuple[int, int]], steps: int = 200) -> Path:
    def examples(tok, rng: random.Random):
        out = []
        for a, b in rng.sample(pairs, min(8, len(pairs))):
            text = tok.apply_chat_template(
                [{"role": "user", "content": question(a, b)}], tools=TOOLS, add_generation_prompt=True, tokenize=False
            )
            call = f"<tool_call>\n{json.dumps({'name': 'add', 'arguments': {'a': 2, 'b': 3}})}\n</tool_call>"
            answer = tok.encode(call, add_special_tokens=False) + [tok.eos_token_id]
            out.append((tok.encode(text, add_special_tokens=False), answer))
        return out

    build = {"kind": "tool-caller", "pairs": [list(p) for p in pairs]}
    return sft_model_dir("tiny-8k-tool-caller", build, examples, steps)

"""A small arithmetic task: 'What is a + b?' prompts with the answer as label, and its rule reward.

Generated locally (seeded), so it needs no download. The reward reads the last number in the response, which
makes it tolerant of short explanations: a strict "only the number" reward gives a pretrained 135M model almost
no signal to start from.
"""

from __future__ import annotations

import json
import random
import re
from pathlib import Path

INSTRUCTION = "Reply with only the final number."
_NUMBER = re.compile(r"-?\d+")


def make_rows(n: int, *, seed: int = 0, max_operand: int = 9, ops: str = "+") -> list[dict]:
    """`n` rows {input, output, label}: a question, its answer text (for SFT) and the label (for RL)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        a, b, op = rng.randint(0, max_operand), rng.randint(0, max_operand), rng.choice(ops)
        answer = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"input": f"What is {a} {op} {b}? {INSTRUCTION}", "output": str(answer), "label": str(answer)})
    return rows


def last_number(text: str) -> str | None:
    found = _NUMBER.findall(text)
    return found[-1] if found else None


def reward(response: str, label: str) -> float:
    """1.0 when the last number in the response equals the label, else 0.0."""
    return 1.0 if last_number(response) == str(label).strip() else 0.0


def write_jsonl(rows: list[dict], path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path

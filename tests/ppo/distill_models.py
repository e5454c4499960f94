"""Tiny teachers and students for the distillation tests: the suite's tiny model, fine-tuned in this process to answer
every prompt with a colour word, " red" or " blue", and then the end token.

A random tiny model spreads its probability over 8k tokens, so a student sampling from it would almost never draw a
token a peaked teacher likes, and on-policy distillation would have nothing to learn from in a test's few steps (in
practice too the student starts from an SFT-ed model). So both sides are SFT-ed first:
- a teacher to its colour 12 times in 14 (and to each colour once, so that it has seen both), so it says its colour
  with probability ~0.93;
- the student to each colour equally: it says " red" about half the time.
The reverse KL is then ~0.25 nats per response at the start and the teacher's log-probs tell the two answers apart.
One word, not a longer pattern: measured, with three-word patterns the sampled-token advantages of the colour words
also moved the end token (which both models score alike, advantage ~0), and at a learning rate that learns in a few
steps the student stopped ending its answers at step 2 (the reverse KL went from 0.3 to 1.3 nats and stayed).
Fine-tuning is a plain PyTorch loop on the response tokens (`sft_model_dir`, ~7 s); the models are cached like the
suite's others.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tests.model_cache import cache_dir, tiny_model_dir

COLOURS = (" red", " blue")
EVERY_MIX = tuple((c,) for c in COLOURS)  # the student's SFT answers


def teacher_patterns(colour: str) -> tuple[tuple[str, ...], ...]:
    """A teacher's SFT answers: its colour 12 times, each colour once."""
    return ((colour,),) * 12 + EVERY_MIX


def pattern_model_dir(name: str, patterns: tuple[tuple[str, ...], ...], prompts: list[str], steps: int = 120) -> Path:
    """The tiny model SFT-ed to answer each of `prompts` with one of `patterns` (drawn at random per example) and
    then the end token; cached as `<cache>/tiny-8k-distill-<name>`."""

    def examples(tok, rng: random.Random) -> list[tuple[list[int], list[int]]]:
        words = {w: tok.encode(w, add_special_tokens=False) for w in COLOURS}
        assert all(len(ids) == 1 for ids in words.values()), words
        prompt_ids = [tok.encode(p, add_special_tokens=False) for p in prompts]
        return [
            (ids, [words[w][0] for w in rng.choice(patterns)] + [tok.eos_token_id])
            for ids in rng.sample(prompt_ids, min(16, len(prompt_ids)))
        ]

    build = {"kind": "distill-pattern", "patterns": [list(p) for p in patterns], "prompts": list(prompts)}
    return sft_model_dir(f"tiny-8k-distill-{name}", build, examples, steps)


def sft_model_dir(
    name: str,
    build: dict,
    examples: Callable[[Any, random.Random], list[tuple[list[int], list[int]]]],
    steps: int,
    lr: float = 3e-3,
) -> Path:
    """The suite's tiny model fine-tuned in this process (AdamW at `lr`, `steps` steps, seeded) on the response tokens
    of `examples(tokenizer, rng)`'s (prompt ids, answer ids) pairs, drawn anew each step; cached as `<cache>/<name>`
    for `build` (JSON: lists, not tuples)."""
    from openppo.models.zoo import _cached_build

    def make(tmp: Path) -> dict:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        torch.manual_seed(0)
        rng = random.Random(0)
        base = tiny_model_dir()
        tok = AutoTokenizer.from_pretrained(base)
        model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
        optimizer = torch.optim.AdamW(model.parameters(), lr=lr)
        for _ in range(steps):
            pairs = examples(tok, rng)
            rows = [ids + answer for ids, answer in pairs]
            targets = [[-100] * len(ids) + answer for ids, answer in pairs]
            width = max(map(len, rows))
            x = torch.tensor([r + [tok.pad_token_id] * (width - len(r)) for r in rows])
            y = torch.tensor([t + [-100] * (width - len(t)) for t in targets])
            mask = (y != -100) | (torch.arange(width) < torch.tensor([len(r) for r in rows])[:, None])
            loss = model(input_ids=x, attention_mask=mask.long(), labels=y).loss
            optimizer.zero_grad()
            loss.backward()
            optimizer.step()
        model.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        return {"steps": steps, "final_loss": loss.item()}

    return _cached_build(cache_dir() / name, {**build, "base": str(tiny_model_dir()), "steps": steps}, make)

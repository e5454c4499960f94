"""Small learnable data sets for the CLI tests."""

from __future__ import annotations

WORDS = [
    "apple",
    "river",
    "stone",
    "cloud",
    "green",
    "table",
    "light",
    "music",
    "tiger",
    "ocean",
    "paper",
    "sugar",
    "horse",
    "glass",
    "bread",
    "chair",
]


def sft_rows(n: int = 32) -> list[dict]:
    """'Repeat: w' -> 'w w w': the response is a deterministic function of the prompt."""
    return [
        {"input": f"Repeat the word {WORDS[i % len(WORDS)]}.", "output": " ".join([WORDS[i % len(WORDS)]] * 3)}
        for i in range(n)
    ]


def preference_rows(n: int = 32) -> list[dict]:
    """Chosen answers are polite, rejected ones rude: separable by a token present in the response."""
    return [
        {
            "prompt": f"Say something about {WORDS[i % len(WORDS)]}.",
            "chosen": f"The {WORDS[i % len(WORDS)]} is lovely, thank you.",
            "rejected": f"The {WORDS[i % len(WORDS)]} is awful, go away.",
        }
        for i in range(n)
    ]

"""A tiny learnable task for tests and smoke runs: say the target word as often as possible.

The label is the target word; the reward is the share of the response's words equal to it (case-insensitive,
surrounding punctuation and `<|...|>` / `</s>` special-token text ignored), 0.0 for an empty response. A random
tiny policy finds some signal at once and the mean reward should climb within a few PPO steps.
"""

import re

_SPECIAL = re.compile(r"<\|[^|>]*\|>|</?s>")
_PUNCT = ".,;:!?\"'()[]{}"


def response_of(query: str, prompt: str) -> str:
    if not query.startswith(prompt):
        raise ValueError(f"the query does not start with its prompt {prompt[:80]!r}")
    return query[len(prompt) :]


def target_share(response: str, target: str) -> float:
    words = [w.strip(_PUNCT).lower() for w in _SPECIAL.sub(" ", response).split()]
    words = [w for w in words if w]
    target = target.strip().lower()
    return sum(w == target for w in words) / len(words) if words else 0.0


def reward_func(queries, prompts, labels, **kwargs):
    if any(label is None for label in labels):
        raise ValueError("target_token needs the target word as the label (pass --label_key)")
    return [target_share(response_of(q, p), str(label)) for q, p, label in zip(queries, prompts, labels)]

"""Reward for pipeline tests whose dynamic filtering is deterministic: the label decides the group mean.

"always" -> 1.0 and "never" -> 0.0 for every sample (such groups are dropped by the default range (0, 1));
"mixed" -> 0.25 or 0.75 by the parity of the response's length (non-zero advantages, group mean strictly inside
the range, so always kept).
"""


def reward_func(queries, prompts, labels, **kwargs):
    out = []
    for query, prompt, label in zip(queries, prompts, labels):
        if label == "always":
            out.append(1.0)
        elif label == "never":
            out.append(0.0)
        else:
            out.append(0.25 + 0.5 * (len(query[len(prompt) :]) % 2))
    return out

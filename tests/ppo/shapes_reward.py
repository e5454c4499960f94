"""Reward for the image-prompt e2e test: the shapes task's reward (the count is the label), plus a small term that
differs within a group so that GRPO always has advantages to learn from (a random tiny model never counts right).

It also checks what it is given: each prompt shows its image placeholder and each label is a count of 1..4, so a
run that lost its images or labels on the way fails here; `extra_logs/label` is the mean label it saw.
"""

from openppo.tasks.shapes import reward


def reward_func(queries, prompts, labels, **kwargs):
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        if "<image>" not in prompt or label not in ("1", "2", "3", "4"):
            raise ValueError(f"an image prompt with its count expected, got label {label!r} for {prompt!r}")
        response = query[len(prompt) :]
        rewards.append(reward(response, label) + 0.1 * (len(response) % 3))
    return {"rewards": rewards, "scores": rewards, "extra_logs": {"label": [float(label) for label in labels]}}

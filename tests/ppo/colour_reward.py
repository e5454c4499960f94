"""Reward for the distillation + GRPO run: 1.0 for an answer that is the colour " blue", else 0.0."""


def reward_func(queries, prompts, labels, **kwargs):
    return [1.0 if query[len(prompt) :].strip() == "blue" else 0.0 for query, prompt in zip(queries, prompts)]

"""Reward function for the built-in arithmetic task (`python -m openppo.cli.make_task arithmetic`).

Use it with `--remote_rm_url examples/reward_funcs/arithmetic.py --label_key label`, or serve it with
`python -m openppo.cli.serve_rm --reward_func examples/reward_funcs/arithmetic.py`.
Reward 1.0 when the last number in the response equals the label, else 0.0 (`openppo.tasks.arithmetic.reward`);
`extra_logs/has_number` tracks how often the policy answers with a number at all.
"""

from openppo.tasks.arithmetic import last_number, reward


def response_of(query: str, prompt: str) -> str:
    # The query is the prompt followed by the response. Scoring the whole query instead would let a number in
    # the question ("What is 3 + 4?") count as the answer when the response has none.
    if not query.startswith(prompt):
        raise ValueError(f"the query does not start with its prompt {prompt[:80]!r}")
    return query[len(prompt) :]


def reward_func(queries, prompts, labels, **kwargs):
    responses = [response_of(q, p) for q, p in zip(queries, prompts)]
    rewards = [reward(r, label) for r, label in zip(responses, labels)]
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {"has_number": [float(last_number(r) is not None) for r in responses]},
    }

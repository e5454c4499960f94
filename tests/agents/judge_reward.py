"""The reward function of the --agent_program run, for the episodes whose agent returned None (odd prompt indexes):
0.5 each, and `reward/judged` 1.0 when what it was given is the task's question followed by the episode's last
answer (so the run's log shows that this function, not the agent, scored them)."""


def reward_func(queries, prompts, labels, **kwargs):
    judged = [1.0 if p.startswith("What is") and q.startswith(p) else 0.0 for q, p in zip(queries, prompts)]
    return {"rewards": [0.5] * len(queries), "extra_logs": {"judged": judged}}

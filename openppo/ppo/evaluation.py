"""Eval metrics from the reward source: pass@1 and pass@k over k samples per prompt, overall and per datasource.

With a 0/1 correctness reward, pass@1 is the mean success rate and pass@k the share of prompts with at least one
success among k samples (k = --eval_n_samples_per_prompt; the plain estimator with n = k, Chen et al. 2021,
arXiv:2107.03374). With graded rewards the same numbers read as mean reward and mean best-of-k reward.
"""

from __future__ import annotations

from collections import defaultdict

import torch


def pass_at_k(rewards: torch.Tensor) -> dict[str, float]:
    """rewards [num_prompts, k] -> {"pass@1", "pass@k"} (k is the literal sample count in the key)."""
    k = rewards.size(1)
    out = {"pass@1": rewards.float().mean().item()}
    if k > 1:
        out[f"pass@{k}"] = rewards.float().max(dim=1).values.mean().item()
    return out


def eval_metrics(rewards: torch.Tensor, datasources: list[str], response_lengths: torch.Tensor) -> dict[str, float]:
    """`eval/pass@1`, `eval/pass@k`, `eval/response_length`, and `eval/<datasource>/pass@...` when there are several."""
    metrics = {f"eval/{key}": value for key, value in pass_at_k(rewards).items()}
    metrics["eval/response_length"] = response_lengths.float().mean().item()
    rows: dict[str, list[int]] = defaultdict(list)
    for row, source in enumerate(datasources):
        rows[source].append(row)
    if len(rows) > 1:
        for source, idx in rows.items():
            metrics.update({f"eval/{source}/{key}": value for key, value in pass_at_k(rewards[idx]).items()})
    return metrics

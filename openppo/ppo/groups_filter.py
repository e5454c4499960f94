"""DAPO dynamic sampling (Yu et al. 2025, arXiv:2503.14476, section 3.2): a group whose samples all score the same
gives every sample a zero group-normalised advantage, so it costs compute and teaches nothing. Such groups are
dropped and the batch is refilled with new prompts.

OpenRLHF's rule is kept: a group stays when `lo < mean score < hi` (strict), which for 0/1 rewards and the
default range (0, 1) is exactly "not all wrong and not all right".
"""

from __future__ import annotations

import torch


def keep_groups(scores: torch.Tensor, n_samples_per_prompt: int, reward_range: tuple[float, float]) -> torch.Tensor:
    """bool [num_groups]: which groups of `n_samples_per_prompt` consecutive scores to keep."""
    if scores.numel() % n_samples_per_prompt:
        raise ValueError(f"{scores.numel()} scores do not form groups of {n_samples_per_prompt}")
    lo, hi = reward_range
    means = scores.float().view(-1, n_samples_per_prompt).mean(dim=1)
    return (means > lo) & (means < hi)


def expand_to_samples(group_mask: torch.Tensor, n_samples_per_prompt: int) -> list[int]:
    """Sample positions belonging to the kept groups, in order."""
    return [
        g * n_samples_per_prompt + i
        for g in torch.nonzero(group_mask).flatten().tolist()
        for i in range(n_samples_per_prompt)
    ]

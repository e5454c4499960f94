"""From one scalar score per response to the per-token rewards the advantage estimators consume.

Order of operations (`shape_sequence_rewards`, then `token_level_rewards`), all on [B] scalars until the last step:

  1. normalise the reward model's score with its stored mean/std  `--normalize_reward`
  2. clip it                                                       `--reward_clip_range`
  3. DAPO soft overlong penalty                                    `--overlong_buffer_len`, `--overlong_penalty_factor`
  4. truncated-response penalty (ProRL "stop properly")            `--stop_properly_penalty_coef`
  5. group baseline per prompt (RLOO, GRPO, ...)                   `--advantage_estimator`
  6. reward on the last response token, -beta * KL on every token  `--init_kl_coef` (KL in the reward)

Why clip first (OpenRLHF clips after step 5): clipping guards against reward-model outliers, so it belongs on the
reward model's output. Clipping after the group baseline would instead clip advantages: it breaks the zero mean of a
group, and with group_norm a group of n responses can reach |A| = (n - 1) / sqrt(n) (> 10 for n >= 102), where a
clip would silently change GRPO. The length penalties come after the clip so that they keep their full size even for
a response whose score was clipped; they are bounded by construction.
Responses are in consecutive groups of `n_samples_per_prompt` (all samples of prompt 0, then prompt 1, ...).
Everything returned is detached: rewards are targets.
"""

from __future__ import annotations

import torch

from openppo.algorithms.advantages import GROUP_ESTIMATORS, check_advantage_estimator
from openppo.algorithms.reductions import bool_mask, check_arg, check_same_shape

# verl's GRPO epsilon. OpenRLHF's 1e-9 is below fp32 resolution next to a std of order 1 (so it only guards an exact
# zero), and TRL's 1e-4 visibly shrinks advantages (0.8659 instead of 0.8660 for rewards [1, 0, 0, 1]).
GRPO_STD_EPS = 1e-6


def shape_group_rewards(
    rewards: torch.Tensor, n_samples_per_prompt: int, estimator: str, *, std_eps: float = GRPO_STD_EPS
) -> torch.Tensor:
    """Group baseline on scalar rewards, one group = the n consecutive responses to one prompt.

        rloo               r_i - sum_{j != i} r_j / (n - 1)              (Ahmadian et al. 2024, arXiv:2402.14740)
        reinforce_baseline r_i - mean(r)                                 (REINFORCE++-baseline, arXiv:2501.03262)
        dr_grpo            r_i - mean(r)                                 (Liu et al. 2025, arXiv:2503.20783)
        group_norm         (r_i - mean(r)) / (std(r) + std_eps)          (GRPO, Shao et al. 2024, arXiv:2402.03300)
        gae, reinforce     r_i unchanged

    std is the unbiased (Bessel) standard deviation, as in verl, TRL and OpenRLHF. A group whose rewards are all
    equal gives exactly 0 (no NaN, no rounding residue from the mean). Shapes: [B] -> [B] with B a multiple of n;
    detached; dtype kept.
    """
    check_advantage_estimator(estimator)
    rewards = rewards.detach()
    if estimator not in GROUP_ESTIMATORS:
        return rewards
    if n_samples_per_prompt < 2:
        raise ValueError(f"{estimator} compares the responses to one prompt: needs n >= 2, got {n_samples_per_prompt}")
    if rewards.dim() != 1 or rewards.numel() % n_samples_per_prompt:
        raise ValueError(
            f"shape_group_rewards: rewards must be [B] with B a multiple of {n_samples_per_prompt}, "
            f"got {tuple(rewards.shape)}"
        )
    n = n_samples_per_prompt
    groups = rewards.view(-1, n)
    if estimator == "rloo":
        centered = groups - (groups.sum(dim=1, keepdim=True) - groups) / (n - 1)
    else:
        centered = groups - groups.mean(dim=1, keepdim=True)
    if estimator == "group_norm":
        centered = centered / (groups.std(dim=1, keepdim=True) + std_eps)
    # mean() of equal fp32 values can differ from them in the last bit; an equal group carries no signal.
    equal = groups.amax(dim=1, keepdim=True) == groups.amin(dim=1, keepdim=True)
    centered = torch.where(equal, torch.zeros_like(centered), centered)
    return centered.reshape(-1)


def normalize_reward(rewards: torch.Tensor, mean: float, std: float) -> torch.Tensor:
    """(r - mean) / std with the statistics stored with the reward model (`--normalize_reward`). [B] -> [B]."""
    check_arg(std > 0, f"std must be > 0, got {std}")
    return (rewards.detach() - mean) / std


def clip_rewards(rewards: torch.Tensor, clip_range: tuple[float, float]) -> torch.Tensor:
    """Clamp to [low, high] (`--reward_clip_range`). [B] -> [B]."""
    low, high = clip_range
    check_arg(low < high, f"clip_range: low must be < high, got {clip_range}")
    return rewards.detach().clamp(low, high)


def overlong_penalty(
    response_lengths: torch.Tensor,
    *,
    max_new_tokens: int,
    buffer_len: int,
    factor: float = 1.0,
    dtype: torch.dtype = torch.float32,
) -> torch.Tensor:
    """DAPO soft overlong punishment (Yu et al. 2025, arXiv:2503.14476), <= 0, to add to the reward.

        exceed  = clamp(len - (max_new_tokens - buffer_len), 0, buffer_len)
        penalty = -factor * exceed / buffer_len

    0 up to max_new_tokens - buffer_len, linear down to -factor at max_new_tokens (and beyond).
    Shapes: response_lengths [B] (token counts) -> [B] in `dtype`.
    """
    check_arg(0 < buffer_len <= max_new_tokens, f"buffer_len must be in (0, {max_new_tokens}], got {buffer_len}")
    check_arg(factor >= 0, f"factor must be >= 0, got {factor}")
    exceed = (response_lengths.to(dtype) - (max_new_tokens - buffer_len)).clamp(0, buffer_len)
    return -factor * exceed / buffer_len


def apply_truncation_penalty(rewards: torch.Tensor, truncated: torch.Tensor, coef: float) -> torch.Tensor:
    """Penalise responses cut at the length limit (the "stop properly" penalty of NVIDIA's ProRL v2 recipe).

    coef in [0, 1]: r <- coef * r for truncated responses; coef < 0: r <- coef (a fixed penalty).
    Shapes: rewards [B], truncated [B] (bool or 0/1) -> [B].
    """
    check_arg(coef <= 1, f"coef must be <= 1, got {coef}")
    rewards = rewards.detach()
    penalised = torch.full_like(rewards, coef) if coef < 0 else rewards * coef
    return torch.where(bool_mask(truncated), penalised, rewards)


def shape_sequence_rewards(
    scores: torch.Tensor,
    *,
    estimator: str,
    n_samples_per_prompt: int,
    reward_mean_std: tuple[float, float] | None = None,
    reward_clip_range: tuple[float, float] | None = None,
    response_lengths: torch.Tensor | None = None,
    max_new_tokens: int | None = None,
    overlong_buffer_len: int | None = None,
    overlong_penalty_factor: float = 1.0,
    truncated: torch.Tensor | None = None,
    stop_properly_penalty_coef: float | None = None,
    std_eps: float = GRPO_STD_EPS,
) -> torch.Tensor:
    """Steps 1-5 of the module docstring, each skipped when its option is None. [B] -> [B], detached."""
    rewards = scores.detach()
    if reward_mean_std is not None:
        rewards = normalize_reward(rewards, *reward_mean_std)
    if reward_clip_range is not None:
        rewards = clip_rewards(rewards, reward_clip_range)
    if overlong_buffer_len is not None:
        if response_lengths is None or max_new_tokens is None:
            raise ValueError("shape_sequence_rewards: the overlong penalty needs response_lengths and max_new_tokens")
        rewards = rewards + overlong_penalty(
            response_lengths,
            max_new_tokens=max_new_tokens,
            buffer_len=overlong_buffer_len,
            factor=overlong_penalty_factor,
            dtype=rewards.dtype,
        ).to(rewards.device)
    if stop_properly_penalty_coef is not None:
        if truncated is None:
            raise ValueError("shape_sequence_rewards: the truncation penalty needs `truncated`")
        rewards = apply_truncation_penalty(rewards, truncated, stop_properly_penalty_coef)
    return shape_group_rewards(rewards, n_samples_per_prompt, estimator, std_eps=std_eps)


def last_token_index(mask: torch.Tensor) -> torch.Tensor:
    """Index of the last kept position of each row, [B, T] -> [B] (0 for an all-masked row)."""
    positions = torch.arange(mask.shape[-1], device=mask.device).expand_as(mask)
    return torch.where(bool_mask(mask), positions, torch.zeros_like(positions)).amax(dim=-1)


def token_level_rewards(
    sequence_rewards: torch.Tensor, mask: torch.Tensor, kl: torch.Tensor | None = None, kl_coef: float = 0.0
) -> torch.Tensor:
    """Per-token rewards: the scalar reward on the last response token, minus kl_coef * kl on every token.

        R_t = r * 1[t = last kept token] - kl_coef * kl_t       (Ziegler et al. 2019, arXiv:1909.08593)

    Shapes: sequence_rewards [B], mask [B, T], kl [B, T] (from `compute_approx_kl`, usually k1) -> [B, T]; detached;
    0 where masked. An all-masked row gets no reward at all. Pass kl=None (or kl_coef=0) when KL is a loss term.
    """
    check_same_shape(mask=mask, kl=kl)
    keep = bool_mask(mask)
    rewards = sequence_rewards.detach()
    token_rewards = torch.zeros(mask.shape, dtype=rewards.dtype, device=rewards.device)
    has_token = keep.any(dim=-1)
    token_rewards.scatter_(
        1, last_token_index(mask).unsqueeze(1), torch.where(has_token, rewards, torch.zeros_like(rewards)).unsqueeze(1)
    )
    if kl is not None and kl_coef != 0.0:
        token_rewards = token_rewards - kl_coef * torch.where(keep, kl.detach(), torch.zeros_like(kl)).to(
            token_rewards.dtype
        )
    return token_rewards

"""Rollout samples -> padded training tensors, and rewards -> advantages (pure; no Ray, DeepSpeed or vLLM).

Layout. A row is prompt + response, right-padded to the batch's longest row. Log-probs from the actor are
[B, T-1]: position t scores token t+1. `action_mask[b, t] = 1` exactly when token t+1 is a response token, so
every per-token tensor of the RL math (log-probs, values, rewards, advantages) lives on that [B, T-1] grid.
Environment feedback inside a multi-turn response is kept in the sequence with `action_mask` 0.
"""

from __future__ import annotations

import torch

from openppo.algorithms import compute_advantages, compute_approx_kl, shape_sequence_rewards, token_level_rewards
from openppo.ppo.config import AlgoConfig
from openppo.rollout.pool import Sample


def collate_samples(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: sequences/attention_mask [B, T]; action_mask/rollout_log_probs [B, T-1]."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    batch = len(samples)
    sequences = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    action_mask = torch.zeros((batch, width - 1), dtype=torch.long)
    rollout_log_probs = torch.zeros((batch, width - 1), dtype=torch.float32)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert len(s.rollout_log_probs) == r, "one rollout log-prob per response token"
        sequences[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[row, : p + r] = 1
        # Token p + i (response token i) is predicted at position p + i - 1.
        mask = torch.ones(r, dtype=torch.long) if s.action_mask is None else torch.tensor(s.action_mask)
        action_mask[row, p - 1 : p - 1 + r] = mask
        rollout_log_probs[row, p - 1 : p - 1 + r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
    return {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "rollout_log_probs": rollout_log_probs,
        "response_length": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
        "truncated": torch.tensor([s.truncated for s in samples], dtype=torch.bool),
    }


def kl_coef_in_reward(algo: AlgoConfig, kl_coef: float) -> float:
    """The KL is a per-token reward penalty unless --use_kl_loss moves it into the loss."""
    return 0.0 if algo.use_kl_loss else kl_coef


def compute_advantages_for_batch(
    batch: dict[str, torch.Tensor],
    scores: torch.Tensor,
    *,
    algo: AlgoConfig,
    n_samples_per_prompt: int,
    generate_max_len: int,
    kl_coef: float,
    log_probs: torch.Tensor | None = None,
    ref_log_probs: torch.Tensor | None = None,
    values: torch.Tensor | None = None,
    reward_mean_std: tuple[float, float] | None = None,
) -> dict[str, torch.Tensor]:
    """Shaped rewards -> token rewards (with the KL penalty) -> advantages and returns, all on the [B, T-1] grid.

    `scores` [B] are raw rewards in group order (n consecutive samples per prompt). Returns the tensors the
    training step needs: advantages, returns, token_rewards, kl (zeros without a reference), shaped_rewards.
    """
    mask = batch["action_mask"]
    shaped = shape_sequence_rewards(
        scores.float(),
        estimator=algo.advantage_estimator,
        n_samples_per_prompt=n_samples_per_prompt,
        reward_mean_std=reward_mean_std if algo.normalize_reward else None,
        reward_clip_range=tuple(algo.reward_clip_range),
        response_lengths=batch["response_length"],
        max_new_tokens=generate_max_len,
        overlong_buffer_len=algo.overlong_buffer_len,
        overlong_penalty_factor=algo.overlong_penalty_factor,
        truncated=batch["truncated"],
        stop_properly_penalty_coef=algo.stop_properly_penalty_coef,
    )
    if ref_log_probs is not None and log_probs is not None:
        kl = compute_approx_kl(log_probs, ref_log_probs, algo.kl_estimator, mask=mask)
    else:
        kl = torch.zeros(mask.shape, dtype=torch.float32)
    token_rewards = token_level_rewards(shaped, mask, kl, kl_coef_in_reward(algo, kl_coef))
    advantages, returns = compute_advantages(
        algo.advantage_estimator,
        token_rewards,
        mask,
        values=values,
        gamma=algo.gamma,
        lambd=algo.lambd,
        std_norm=not algo.no_advantage_std_norm,
    )
    return {
        "advantages": advantages,
        "returns": returns,
        "token_rewards": token_rewards,
        "kl": kl,
        "shaped_rewards": shaped,
    }

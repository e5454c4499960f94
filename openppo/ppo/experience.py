"""Rollout samples -> padded training tensors, and rewards -> advantages (pure; no Ray, DeepSpeed or vLLM).

Layout. A row is prompt + response, right-padded to the batch's longest row. Log-probs from the actor are
[B, T-1]: position t scores token t+1. `action_mask[b, t] = 1` exactly when token t+1 is a response token, so
every per-token tensor of the RL math (log-probs, values, rewards, advantages) lives on that [B, T-1] grid.
Environment feedback inside a multi-turn response is kept in the sequence with `action_mask` 0.
"""

from __future__ import annotations

from dataclasses import replace

import torch

from openppo.algorithms import compute_advantages, compute_approx_kl, shape_sequence_rewards, token_level_rewards
from openppo.ppo.config import AlgoConfig
from openppo.rollout.pool import Sample
from openppo.utils.images import BATCH_KEY as IMAGES
from openppo.utils.images import encode_image_rows


def collate_samples(samples: list[Sample], pad_token_id: int) -> dict[str, torch.Tensor]:
    """Right-padded tensors: sequences/attention_mask [B, T]; action_mask/rollout_log_probs [B, T-1]; versions
    [B, T-1], the weight version that sampled each trained token (`Sample.token_versions`, else the sample's
    `policy_version`), -1 where the action mask is 0. With image prompts also `images` [B, N], the rows' images
    (`openppo.utils.images.encode_image_rows`)."""
    lengths = [len(s.prompt_ids) + len(s.response_ids) for s in samples]
    width = max(lengths)
    batch = len(samples)
    sequences = torch.full((batch, width), pad_token_id, dtype=torch.long)
    attention_mask = torch.zeros((batch, width), dtype=torch.long)
    action_mask = torch.zeros((batch, width - 1), dtype=torch.long)
    rollout_log_probs = torch.zeros((batch, width - 1), dtype=torch.float32)
    versions = torch.full((batch, width - 1), -1, dtype=torch.long)
    for row, s in enumerate(samples):
        p, r = len(s.prompt_ids), len(s.response_ids)
        assert len(s.rollout_log_probs) == r, "one rollout log-prob per response token"
        sequences[row, : p + r] = torch.tensor(s.prompt_ids + s.response_ids, dtype=torch.long)
        attention_mask[row, : p + r] = 1
        # Token p + i (response token i) is predicted at position p + i - 1.
        mask = torch.ones(r, dtype=torch.long) if s.action_mask is None else torch.tensor(s.action_mask)
        action_mask[row, p - 1 : p - 1 + r] = mask
        rollout_log_probs[row, p - 1 : p - 1 + r] = torch.tensor(s.rollout_log_probs, dtype=torch.float32)
        trained = mask.bool()
        tags = s.token_versions if s.token_versions is not None else [s.policy_version] * int(trained.sum())
        assert len(tags) == int(trained.sum()), "one weight version per trained token"
        versions[row, p - 1 : p - 1 + r][trained] = torch.tensor(tags, dtype=torch.long)
    batch_tensors = {
        "sequences": sequences,
        "attention_mask": attention_mask,
        "action_mask": action_mask,
        "rollout_log_probs": rollout_log_probs,
        "versions": versions,
        "response_length": torch.tensor([len(s.response_ids) for s in samples], dtype=torch.long),
        "truncated": torch.tensor([s.truncated for s in samples], dtype=torch.bool),
    }
    if any(s.images for s in samples):  # image prompts: every model that scores the rows needs their pixels
        batch_tensors[IMAGES] = encode_image_rows([s.images or [] for s in samples])
    return batch_tensors


def training_rows(samples: list[Sample], multiple: int = 1) -> tuple[list[Sample], torch.Tensor]:
    """The rows a batch trains on, and the sample (episode) each row belongs to [R]: one row per sample, or per
    segment of an agent episode served through the OpenAI endpoint (`Sample.segments`). When segments make the row
    count no multiple of `multiple` (the data-parallel ranks' number), rows that train nothing are added (a copy of
    the last row with an all-zero action mask), belonging to episode -1."""
    rows, episode = [], []
    for i, s in enumerate(samples):
        for row in s.segments or [s]:
            rows.append(row)
            episode.append(i)
    while len(rows) % multiple:
        last = rows[-1]
        rows.append(replace(last, action_mask=[0] * len(last.response_ids), token_versions=[], segments=None))
        episode.append(-1)
    return rows, torch.tensor(episode, dtype=torch.long)


def per_episode(values: torch.Tensor, episode: torch.Tensor, num_episodes: int, reduce: str) -> torch.Tensor:
    """Row values [R] gathered per episode [num_episodes] ("sum" or "amax"); rows of episode -1 left out."""
    keep = episode >= 0
    out = torch.zeros(num_episodes, dtype=values.dtype)
    return out.scatter_reduce(0, episode[keep], values[keep], reduce=reduce, include_self=False)


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
    episode: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """Shaped rewards -> token rewards (with the KL penalty) -> advantages and returns, all on the [B, T-1] grid.

    `scores` [B] are raw rewards in group order (n consecutive samples per prompt). Returns the tensors the
    training step needs: advantages, returns, token_rewards, kl (zeros without a reference), shaped_rewards.

    `episode` [R] (`training_rows`): when the batch's R rows are the segments of B agent episodes, the rewards are
    shaped per episode (the group baseline over the n episodes of a prompt; an episode's length is its segments'
    generated tokens together, truncated when one of them is) and every segment of an episode gets its shaped reward,
    so all of them share its advantage; rows of episode -1 get none.
    """
    mask = batch["action_mask"]
    lengths, truncated = batch["response_length"], batch["truncated"]
    if episode is not None:
        generated = mask.sum(dim=-1)
        lengths = per_episode(generated, episode, len(scores), "sum")
        truncated = per_episode(truncated.long(), episode, len(scores), "amax").bool()
    shaped = shape_sequence_rewards(
        scores.float(),
        estimator=algo.advantage_estimator,
        n_samples_per_prompt=n_samples_per_prompt,
        reward_mean_std=reward_mean_std if algo.normalize_reward else None,
        reward_clip_range=tuple(algo.reward_clip_range),
        response_lengths=lengths,
        max_new_tokens=generate_max_len,
        overlong_buffer_len=algo.overlong_buffer_len,
        overlong_penalty_factor=algo.overlong_penalty_factor,
        truncated=truncated,
        stop_properly_penalty_coef=algo.stop_properly_penalty_coef,
    )
    if episode is not None:
        shaped = torch.where(episode >= 0, shaped[episode.clamp(min=0)], torch.zeros((), dtype=shaped.dtype))
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
        whiten=False if algo.no_advantage_whiten else None,
        std_norm=not algo.no_advantage_std_norm,
    )
    return {
        "advantages": advantages,
        "returns": returns,
        "token_rewards": token_rewards,
        "kl": kl,
        "shaped_rewards": shaped,
    }

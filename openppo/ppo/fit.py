"""The one training loop for actor and critic on a batch of experience, inside a DeepSpeed rank.

Each optimizer step takes `grad_accum` micro-batches on every rank. Before the first of them the step's global
normalisers (response tokens and responses over all its micro-batches and ranks) are all-reduced, so the loss is
one exact token-mean (or sequence-mean) over the step, not a mean of micro-batch means. DeepSpeed divides each
micro-batch loss by grad_accum and averages gradients over ranks; the backward pass therefore uses
`contribution * world_size * grad_accum` (see openppo.algorithms.aggregation).

`actor_loss` and `critic_loss` are the two objectives; `fit_experience` is shared.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch

from openppo.algorithms import (aggregate_loss, default_loss_agg_mode, kl_loss, loss_normalizers, masked_mean,
                                policy_loss, value_loss)
from openppo.ppo.config import AlgoConfig

LossFn = Callable[[dict[str, torch.Tensor], torch.Tensor], tuple[torch.Tensor, dict[str, float]]]


def micro_batches(data: dict[str, torch.Tensor], micro: int, epoch_seed: int) -> list[dict[str, torch.Tensor]]:
    """Shuffled micro-batches of this rank's experience (the same order on a resume: seeded per epoch)."""
    size = next(iter(data.values())).size(0)
    order = torch.randperm(size, generator=torch.Generator().manual_seed(epoch_seed))
    return [{k: v[order[i: i + micro]] for k, v in data.items()} for i in range(0, size, micro)]


def _all_reduce_sum(t: torch.Tensor, world_size: int) -> torch.Tensor:
    if world_size > 1:
        torch.distributed.all_reduce(t)
    return t


def fit_experience(engine, data: dict[str, torch.Tensor], loss_fn: LossFn, *, micro: int, grad_accum: int,
                   epochs: int, world_size: int, seed: int, device: torch.device) -> dict[str, float]:
    """Train `engine` on `data` (this rank's share) for `epochs`; returns metrics averaged over micro-batches.

    `loss_fn(micro_batch, normalizers)` returns (contribution to the step loss, metrics). `normalizers` is the
    all-reduced int64 [2] (num_tokens, num_seqs) of the step's action masks. Averaging the returned metrics over
    ranks gives, for loss/* keys, the mean step loss.
    """
    sums: dict[str, float] = defaultdict(float)
    count = 0
    engine.train()
    for epoch in range(epochs):
        batches = micro_batches(data, micro, seed + epoch)
        for start in range(0, len(batches), grad_accum):
            step = batches[start: start + grad_accum]
            counts = sum(loss_normalizers(b["action_mask"]) for b in step)
            normalizers = _all_reduce_sum(counts.to(device), world_size)
            for batch in step:
                batch = {k: v.to(device) for k, v in batch.items()}
                contribution, metrics = loss_fn(batch, normalizers)
                engine.backward(contribution * world_size * grad_accum)
                engine.step()
                for key, value in metrics.items():
                    # A loss/* metric is a contribution; scaled like the backward pass, its mean over every
                    # micro-batch of every rank is the step's loss.
                    sums[key] += value * world_size * grad_accum if key.startswith("loss/") else value
                count += 1
    return {k: v / max(count, 1) for k, v in sums.items()}


def actor_loss(engine, algo: AlgoConfig, *, kl_coef: float, temperature: float, generate_max_len: int,
               is_correction: str | None, is_threshold: tuple[float, float]) -> LossFn:
    """Policy loss (+ KL loss, - entropy bonus) of one micro-batch, as a contribution to the step loss."""
    low, high = algo.eps_clip_low_high or (algo.eps_clip, algo.eps_clip)
    mode = algo.loss_agg_mode or default_loss_agg_mode(algo.advantage_estimator, algo.policy_loss_type)
    # The entropy is always logged; it carries a gradient only when it is a loss term.
    entropy_in_loss = bool(algo.entropy_loss_coef)

    def loss_fn(batch: dict[str, torch.Tensor], normalizers: torch.Tensor):
        mask = batch["action_mask"]
        out = engine(batch["sequences"], batch["attention_mask"], temperature=temperature,
                     return_entropy=True if entropy_in_loss else "log")

        def agg(per_token):
            return aggregate_loss(per_token, mask, mode, num_tokens_global=normalizers[0],
                                  num_seqs_global=normalizers[1], norm_len=generate_max_len)

        per_token, pg_metrics = policy_loss(
            out.log_probs, batch["old_log_probs"], batch["advantages"], mask, eps_clip_low=low, eps_clip_high=high,
            dual_clip=algo.dual_clip, loss_type=algo.policy_loss_type,
            rollout_log_probs=batch.get("rollout_log_probs") if is_correction else None, is_correction=is_correction,
            is_threshold=is_threshold)
        loss = agg(per_token)
        metrics = {"loss/policy": loss.item(), **{f"policy/{k}": float(v) for k, v in pg_metrics.items()}}
        if algo.use_kl_loss and "ref_log_probs" in batch:
            kl_term = agg(kl_loss(out.log_probs, batch["ref_log_probs"], mask, algo.kl_estimator))
            loss = loss + kl_coef * kl_term
            metrics["loss/kl"] = kl_term.item()
        if entropy_in_loss:
            loss = loss - algo.entropy_loss_coef * agg(out.entropy)
        # a plain mean of this micro-batch (averaged over micro-batches and ranks), not a step-loss contribution
        metrics["policy/entropy"] = masked_mean(out.entropy.detach(), mask).item()
        return loss, metrics

    return loss_fn


def critic_loss(engine, algo: AlgoConfig) -> LossFn:
    """Clipped value loss of one micro-batch (token-mean over the step)."""

    def loss_fn(batch: dict[str, torch.Tensor], normalizers: torch.Tensor):
        mask = batch["action_mask"]
        values = engine(batch["sequences"], batch["attention_mask"])[:, :-1]
        per_token, v_metrics = value_loss(values, batch["old_values"], batch["returns"], mask, algo.value_clip)
        loss = aggregate_loss(per_token, mask, "token-mean", num_tokens_global=normalizers[0])
        return loss, {"loss/value": loss.item(), "critic/values": masked_mean(values.detach(), mask).item(),
                      **{f"critic/{k}": float(v) for k, v in v_metrics.items()}}

    return loss_fn

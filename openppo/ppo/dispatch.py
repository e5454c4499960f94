"""Who does the work: the worker groups and engines of a run, and how a batch is dealt to a group's ranks.

Rank i of a group gets the i-th shard: contiguous rows, or rows dealt by tokens when micro-batches are costed by
tokens (packing, token budgets). The K consecutive ranks of a ring (--ring_attn_size) or of a tensor-parallel group
(--ds_tensor_parallel_size) form one data-parallel rank and all receive its shard.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from openppo.ppo.micro_batches import balanced_shards, shard_sizes


@dataclass
class Groups:
    """The worker groups and engines the controller drives (None where the run does not need one)."""

    policy: Any
    engines: list[Any]
    engine_infos: list[dict[str, Any]] = field(default_factory=list)  # pid, node, log files of each engine
    critic: Any = None
    reference: Any = None
    reward: Any = None
    reward_source: Any = None  # a RewardSource when scoring is not done by a reward model
    reward_normalization: tuple[float, float] | None = None

    def trained(self) -> list[Any]:
        return [g for g in (self.policy, self.critic) if g is not None]


def shard_rows(data: dict[str, torch.Tensor], n: int, balance: bool) -> list[list[int]]:
    """Row indices per rank: contiguous shards, or (`balance`) shards with even token totals; sizes differ by at
    most one row where the batch does not divide (forward-only passes)."""
    if balance and n > 1:
        return balanced_shards(data["attention_mask"].sum(-1).tolist(), n)
    bounds = [0]
    for rows in shard_sizes(data["sequences"].size(0), n):
        bounds.append(bounds[-1] + rows)
    return [list(range(start, end)) for start, end in zip(bounds, bounds[1:])]


def take_rows(data: dict[str, torch.Tensor], rows: list[int]) -> dict[str, torch.Tensor]:
    index = torch.tensor(rows, dtype=torch.long)
    return {k: v[index] for k, v in data.items()}


def in_batch_order(results: list[torch.Tensor], rows_per_shard: list[list[int]]) -> torch.Tensor:
    """The shards' results (one tensor per shard, rows in the shard's order) put back in the batch's row order."""
    stacked = torch.cat(results)
    out = torch.empty_like(stacked)
    out[torch.tensor([i for rows in rows_per_shard for i in rows], dtype=torch.long)] = stacked
    return out


def replicated(data: dict[str, torch.Tensor], rows_per_shard: list[list[int]],
               replicas: int) -> list[dict[str, torch.Tensor]]:
    """Each shard's rows, once for each of the `replicas` consecutive ranks (a ring, a tensor-parallel group) that
    hold them."""
    return [take_rows(data, rows) for rows in rows_per_shard for _ in range(replicas)]


def shards(data: dict[str, torch.Tensor], n: int, balance: bool = False,
           replicas: int = 1) -> list[dict[str, torch.Tensor]]:
    """One shard per rank of a group of `n` ranks, for training: the shards hold equal numbers of rows (validation
    makes --train_batch_size divide over the data-parallel ranks of the actor and the critic)."""
    size, data_parallel = data["sequences"].size(0), n // replicas
    if size % data_parallel:
        raise ValueError(f"a training batch of {size} rows does not split over {data_parallel} data-parallel ranks")
    return replicated(data, shard_rows(data, data_parallel, balance), replicas)

"""Which rows go to which rank and which micro-batch.

The driver deals a batch to a model group's ranks (`shards`, `shard_rows`): contiguous rows, or rows dealt by tokens
when micro-batches are costed by tokens; the K ranks of a ring or a tensor-parallel group all receive their shard.
Each rank then cuts its rows into micro-batches (`Batching`): a row count, or with `--use_dynamic_batch` a token
budget. The cost of a micro-batch is the number of token positions its forward computes: the sum of the row lengths
when the rows are packed (`--packing_samples`), rows x the longest row when they are padded (each micro-batch is
trimmed to its own longest row). A row longer than the budget goes alone. With shared prompts
(`--share_prompt_in_group`) a row that shares its prompt with the row before it in the micro-batch costs only its
response, and the ranks are dealt whole groups (the rows of a prompt), so that a group's prompt is computed once.

DeepSpeed needs the same number of micro-steps on every rank (gradient reduction in ZeRO-2/3 and parameter gathers
in ZeRO-3 are collectives), so `plan_on_all_ranks` all-reduces the counts and `equalize` splits the most expensive
micro-batches of a rank until it has as many as the busiest rank; a rank with fewer rows than that gets empty
micro-batches, run as no-op steps (`noop_rows`).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from openppo.ppo.config import PPOConfig
from openppo.utils.images import BATCH_KEY as IMAGES
from openppo.utils.transfer import to_device

if TYPE_CHECKING:
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

# -- the cost of a micro-batch, and cutting rows into micro-batches (pure) ---------------------------------------------


@dataclass(frozen=True)
class Batching:
    """How one rank cuts its rows into micro-batches."""

    packed: bool = False  # --packing_samples
    rows: int = 1  # rows per micro-batch when no token budget is set
    max_tokens: int | None = None  # token budget per micro-batch (--use_dynamic_batch)
    share_prompts: bool = False  # --share_prompt_in_group: a group's prompt is computed once per micro-batch

    def plan(self, lengths: list[int], shares: list[int] | None = None) -> list[list[int]]:
        """Micro-batches (lists of indices into `lengths`, in order) covering every row once; `shares[i]`: the prompt
        tokens row i shares with row i - 1 (`prompt_shares`)."""
        if self.max_tokens is None:
            return [list(range(i, min(i + self.rows, len(lengths)))) for i in range(0, len(lengths), self.rows)]
        return split_by_tokens(lengths, self.max_tokens, self.packed, shares)


def cost(lengths: list[int], packed: bool, shares: list[int] | None = None) -> int:
    """Token positions a forward over these consecutive rows computes (`shares`: as in `Batching.plan`, for these
    rows; the first row pays its whole prompt)."""
    if not lengths:
        return 0
    if not packed:
        return len(lengths) * max(lengths)
    return sum(lengths) - (sum(shares[1:]) if shares else 0)


def split_by_tokens(
    lengths: list[int], max_tokens: int, packed: bool, shares: list[int] | None = None
) -> list[list[int]]:
    """Consecutive rows while the micro-batch's cost stays within `max_tokens` (at least one row each)."""
    micros: list[list[int]] = []
    current: list[int] = []
    for i in range(len(lengths)):
        rows = [*current, i]
        if current and cost([lengths[j] for j in rows], packed, _shares(shares, rows)) > max_tokens:
            micros.append(current)
            current = []
        current.append(i)
    if current:
        micros.append(current)
    return micros


def _shares(shares: list[int] | None, rows: list[int]) -> list[int] | None:
    return None if shares is None else [shares[j] for j in rows]


def equalize(
    micros: list[list[int]], lengths: list[int], count: int, packed: bool, shares: list[int] | None = None
) -> list[list[int]]:
    """Split the costliest micro-batches (halving them) until there are `count`; pad with empty ones when every
    micro-batch is a single row. The order of the rows is kept."""
    micros = [list(m) for m in micros]
    while len(micros) < count:
        splittable = [i for i, m in enumerate(micros) if len(m) > 1]
        if not splittable:
            micros += [[] for _ in range(count - len(micros))]
            break
        i = max(splittable, key=lambda k: cost([lengths[j] for j in micros[k]], packed, _shares(shares, micros[k])))
        half = len(micros[i]) // 2
        micros[i : i + 1] = [micros[i][:half], micros[i][half:]]
    return micros


def shard_sizes(size: int, num_shards: int) -> list[int]:
    """Rows per rank when `size` rows are dealt to `num_shards` ranks: equal, or one more for the first ranks.

    Training batches always split evenly (validation sees to it); forward-only batches (log-probs, values,
    scores, eval) may not, and every rank runs as many micro-batches as the busiest one anyway."""
    if size < num_shards:
        raise ValueError(f"a batch of {size} rows cannot be dealt to {num_shards} ranks (each needs one)")
    per, extra = divmod(size, num_shards)
    return [per + (k < extra) for k in range(num_shards)]


def balanced_shards(lengths: list[int], num_shards: int) -> list[list[int]]:
    """Deal rows to `num_shards` data-parallel ranks, as many each as `shard_sizes` gives, evening out their token
    totals.

    Longest first, each row to the shard with the fewest tokens that still has room (greedy LPT). Each shard's
    indices are returned sorted, so a shard keeps the batch's order.
    """
    size = len(lengths)
    room = shard_sizes(size, num_shards)
    shards: list[list[int]] = [[] for _ in range(num_shards)]
    totals = [0] * num_shards
    for i in sorted(range(size), key=lambda k: -lengths[k]):
        s = min((k for k in range(num_shards) if len(shards[k]) < room[k]), key=lambda k: totals[k])
        shards[s].append(i)
        totals[s] += lengths[i]
    return [sorted(s) for s in shards]


# -- dealing a batch to a group's ranks (the driver) -------------------------------------------------------------------


def row_lengths(data: dict[str, torch.Tensor]) -> list[int]:
    return data["attention_mask"].sum(-1).tolist()


def prompt_shares(data: dict[str, torch.Tensor]) -> list[int]:
    """Per row, the prompt tokens it shares with the row before it (0: a new group; see `shared_prefixes`)."""
    from openppo.models.actor import prompt_lengths
    from openppo.models.row_layout import shared_prefixes

    return shared_prefixes(data["sequences"], data["attention_mask"], prompt_lengths(data["action_mask"]))


def prompt_groups(shares: list[int]) -> list[list[int]]:
    """The row indices of each group: a row that shares nothing with the row before it (`prompt_shares`) opens one."""
    starts = [i for i, s in enumerate(shares) if not s] + [len(shares)]
    return [list(range(a, b)) for a, b in zip(starts, starts[1:])]


def group_shards(data: dict[str, torch.Tensor], n: int) -> list[list[int]] | None:
    """Row indices per rank dealing whole groups (rows sharing a prompt), their token totals evened out; None when
    the groups do not split into equal row counts (the rows are then dealt one by one)."""
    shares, lengths = prompt_shares(data), row_lengths(data)
    groups = prompt_groups(shares)
    if len(groups) % n or len({len(g) for g in groups}) > 1:
        return None
    costs = [lengths[g[0]] + sum(lengths[i] - shares[i] for i in g[1:]) for g in groups]
    return [[i for k in shard for i in groups[k]] for shard in balanced_shards(costs, n)]


def shard_rows(data: dict[str, torch.Tensor], n: int, balance: bool, share: bool = False) -> list[list[int]]:
    """Row indices per rank: contiguous shards, or (`balance`) shards with even token totals (with `share`, of whole
    groups where they divide evenly); sizes differ by at most one row where the batch does not divide (forward-only
    passes)."""
    if share and n > 1 and (dealt := group_shards(data, n)) is not None:
        return dealt
    if balance and n > 1:
        return balanced_shards(row_lengths(data), n)
    bounds = [0]
    for rows in shard_sizes(data["sequences"].size(0), n):
        bounds.append(bounds[-1] + rows)
    return [list(range(start, end)) for start, end in zip(bounds, bounds[1:])]


def take_rows(data: dict[str, torch.Tensor], rows: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
    index = torch.as_tensor(rows, dtype=torch.long)
    return {k: v[index] for k, v in data.items()}


def in_batch_order(results: list[torch.Tensor], rows_per_shard: list[list[int]]) -> torch.Tensor:
    """The shards' results (one tensor per shard, rows in the shard's order) put back in the batch's row order."""
    stacked = torch.cat(results)
    out = torch.empty_like(stacked)
    out[torch.tensor([i for rows in rows_per_shard for i in rows], dtype=torch.long)] = stacked
    return out


def replicated(
    data: dict[str, torch.Tensor], rows_per_shard: list[list[int]], replicas: int
) -> list[dict[str, torch.Tensor]]:
    """Each shard's rows, once for each of the `replicas` consecutive ranks (a ring, a tensor-parallel group) that
    hold them."""
    return [take_rows(data, rows) for rows in rows_per_shard for _ in range(replicas)]


def shards(
    data: dict[str, torch.Tensor], n: int, balance: bool = False, replicas: int = 1, share: bool = False
) -> list[dict[str, torch.Tensor]]:
    """One shard per rank of a group of `n` ranks, for training: the shards hold equal numbers of rows (validation
    makes --train_batch_size divide over the data-parallel ranks of the actor and the critic)."""
    size, data_parallel = data["sequences"].size(0), n // replicas
    if size % data_parallel:
        raise ValueError(f"a training batch of {size} rows does not split over {data_parallel} data-parallel ranks")
    return replicated(data, shard_rows(data, data_parallel, balance, share), replicas)


def all_reduce(t: torch.Tensor, world_size: int, op=None) -> torch.Tensor:
    """Sum (or `op`) over the ranks; a no-op on one rank (tests and benchmarks run without a process group)."""
    if world_size > 1:
        torch.distributed.all_reduce(t, op=op or torch.distributed.ReduceOp.SUM)
    return t


# -- a rank's micro-batches --------------------------------------------------------------------------------------------


def plan_on_all_ranks(
    batching: Batching,
    lengths: list[list[int]],
    world_size: int,
    device: torch.device,
    shares: list[list[int]] | None = None,
) -> list[list[list[int]]]:
    """One micro-batch plan per set of rows (an optimizer step, or a whole forward pass), with the same number
    of micro-batches on every rank (one all-reduce for all sets); `shares` as in `Batching.plan`, per set."""
    shares = shares if batching.share_prompts and shares is not None else [None] * len(lengths)
    plans = [batching.plan(rows, s) for rows, s in zip(lengths, shares)]
    # (one rank counts on the host: a device round trip would make it wait on the GPU for nothing)
    counts = all_reduce(
        torch.tensor([len(p) for p in plans], device=device if world_size > 1 else "cpu"),
        world_size,
        torch.distributed.ReduceOp.MAX,
    )
    return [
        equalize(p, rows, int(c), batching.packed, s) for p, rows, s, c in zip(plans, lengths, shares, counts.tolist())
    ]


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row of this micro-batch (it was padded to the whole batch).

    Tensors [b, T] are cut to the longest row W, per-token tensors [b, T-1] to W-1; others are kept, and so are the
    rows' encoded images (`images`, per row, whatever their width).
    """
    width = batch["sequences"].size(1)
    keep = int(batch["attention_mask"].sum(-1).max())
    if keep == width:
        return batch
    out = {}
    for key, value in batch.items():
        if key == IMAGES:
            out[key] = value
        elif value.dim() >= 2 and value.size(1) == width:
            out[key] = value[:, :keep]
        elif value.dim() >= 2 and value.size(1) == width - 1:
            out[key] = value[:, : keep - 1]
        else:
            out[key] = value
    return out


def pad_to_width(values: torch.Tensor, width: int, fill: float = 0.0) -> torch.Tensor:
    """Right-pad dimension 1 of [b, w, ...] to `width` (the inverse of `trim_padding` for outputs)."""
    if values.size(1) == width:
        return values
    pad = [0, 0] * (values.dim() - 2) + [0, width - values.size(1)]
    return torch.nn.functional.pad(values, pad, value=fill)


def select_rows(data: dict[str, torch.Tensor], rows: list[int] | torch.Tensor) -> dict[str, torch.Tensor]:
    """The rows of a micro-batch, trimmed to its own longest row."""
    return trim_padding(take_rows(data, rows))


def noop_rows(data: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """An empty micro-batch as a real one that weighs nothing: row 0 with no action tokens. Its forward and backward
    still run, because the other ranks' collectives wait for them."""
    batch = select_rows(data, [0])
    return {**batch, "action_mask": torch.zeros_like(batch["action_mask"])}


def train_batching(cfg: PPOConfig, share_prompts: bool = False) -> Batching:
    r = cfg.rollout
    return Batching(
        packed=r.packing_samples,
        rows=cfg.train.micro_train_batch_size,
        max_tokens=r.train_tokens() if r.use_dynamic_batch else None,
        share_prompts=share_prompts,
    )


def forward_batching(cfg: PPOConfig, share_prompts: bool = False) -> Batching:
    """Forward-only passes keep no activations for a backward, so their micro-batches may be larger."""
    r = cfg.rollout
    budget = r.forward_tokens()
    return Batching(
        packed=r.packing_samples,
        rows=r.micro_rollout_batch_size,
        max_tokens=budget if r.use_dynamic_batch else None,
        share_prompts=share_prompts,
    )


class ForwardChunks:
    """A forward-only pass over micro-batches, written as a loop by the caller:

        chunks = ForwardChunks(engine, strategy, data, batching)
        for micro in chunks:  # tensors on the device, each micro-batch trimmed to its longest row
            chunks.add(engine(micro["sequences"], micro["attention_mask"]).log_probs)
        return chunks.result()  # [B, ...] in row order, fp32 on CPU, per-token values re-padded to the batch's width

    Every rank runs as many forwards as the busiest one (ZeRO-3 gathers parameters collectively); the extra ones are
    thrown away. Run it under `torch.no_grad()`. The micro-batches come with their host copies (`DeviceBatch.host`,
    for an actor's masks) and the results stay on the device until `result`, so the pass never waits on the GPU
    between its forwards (`openppo.utils.transfer`)."""

    def __init__(self, engine, strategy: DeepSpeedStrategy, data: dict[str, torch.Tensor], batching: Batching):
        engine.eval()
        self.data, self.device = data, strategy.device
        self.width = data["sequences"].size(1)
        shares = [prompt_shares(data)] if batching.share_prompts and "action_mask" in data else None
        self.plan = plan_on_all_ranks(batching, [row_lengths(data)], strategy.world_size, strategy.device, shares)[0]
        self.out: list[torch.Tensor] = []

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        for rows in self.plan:
            self._rows, self._batch = rows, select_rows(self.data, rows or [0])
            yield to_device(self._batch, self.device)

    def add(self, result: torch.Tensor) -> None:
        """The result of the micro-batch just yielded."""
        if not self._rows:
            return
        result = result.float()
        if result.dim() > 1:  # per-token: back to the batch's width (T or T-1 columns)
            result = pad_to_width(result, result.size(1) + self.width - self._batch["sequences"].size(1))
        self.out.append(result)

    def result(self) -> torch.Tensor:
        return torch.cat(self.out).cpu()  # the pass's one read

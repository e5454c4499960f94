"""Which rows go into which micro-batch and which rank: a row count or a token budget (pure; no collectives).

The cost of a micro-batch is the number of token positions its forward computes: the sum of the row lengths when the
rows are packed (`--packing_samples`), rows x the longest row when they are padded (each micro-batch is trimmed to its
own longest row). With `--use_dynamic_batch`, micro-batches are filled in order up to a token budget; a row longer
than the budget goes alone.

DeepSpeed needs the same number of micro-steps on every rank (gradient reduction in ZeRO-2/3 and parameter gathers
in ZeRO-3 are collectives), so `equalize` splits the most expensive micro-batches of a rank until it has as many as
the busiest rank; a rank with fewer rows than that gets empty micro-batches, run as no-op steps.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Batching:
    """How one rank cuts its rows into micro-batches."""

    packed: bool = False  # --packing_samples
    rows: int = 1  # rows per micro-batch when no token budget is set
    max_tokens: int | None = None  # token budget per micro-batch (--use_dynamic_batch)

    def plan(self, lengths: list[int]) -> list[list[int]]:
        """Micro-batches (lists of indices into `lengths`, in order) covering every row once."""
        if self.max_tokens is None:
            return [list(range(i, min(i + self.rows, len(lengths)))) for i in range(0, len(lengths), self.rows)]
        return split_by_tokens(lengths, self.max_tokens, self.packed)


def cost(lengths: list[int], packed: bool) -> int:
    """Token positions a forward over these rows computes."""
    if not lengths:
        return 0
    return sum(lengths) if packed else len(lengths) * max(lengths)


def split_by_tokens(lengths: list[int], max_tokens: int, packed: bool) -> list[list[int]]:
    """Consecutive rows while the micro-batch's cost stays within `max_tokens` (at least one row each)."""
    micros: list[list[int]] = []
    current: list[int] = []
    for i, length in enumerate(lengths):
        if current and cost([lengths[j] for j in current] + [length], packed) > max_tokens:
            micros.append(current)
            current = []
        current.append(i)
    if current:
        micros.append(current)
    return micros


def equalize(micros: list[list[int]], lengths: list[int], count: int, packed: bool) -> list[list[int]]:
    """Split the costliest micro-batches (halving them) until there are `count`; pad with empty ones when every
    micro-batch is a single row. The order of the rows is kept."""
    micros = [list(m) for m in micros]
    while len(micros) < count:
        splittable = [i for i, m in enumerate(micros) if len(m) > 1]
        if not splittable:
            micros += [[] for _ in range(count - len(micros))]
            break
        i = max(splittable, key=lambda k: cost([lengths[j] for j in micros[k]], packed))
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

"""Running packed rows sharded over a ring group (`--ring_attn_size K`): the models' side of ring attention.

Every rank of a ring group holds the same packed row; `SequenceParallel.shard` gives this rank its chunk and the
chunk's next-token labels, and `gather` puts per-token results of all chunks back into the row, so the model
classes keep their packed code path. The ring context stays active until the next row: a backward with gradient
checkpointing re-runs attention and must still find it (see openppo.models.ring_attention).
"""

from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from openppo.models.ring_attention import (
    enable_ring_attention,
    gather_from_ring,
    ring_chunk,
    ring_context,
    split_for_ring,
)


class SequenceParallel:
    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int, head_stride: int):
        self.group, self.size, self.rank, self.head_stride = group, size, rank, head_stride
        self._active = contextlib.ExitStack()
        self.tokens = [0, 0]  # (this rank's chunk, whole rows) tokens so far: the share a rank really computes

    def shard(
        self, input_ids: torch.Tensor, position_ids: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """This rank's (input_ids, position_ids, labels) chunk of the packed row [1, N]; activates the ring."""
        self._active.close()
        self._active.enter_context(ring_context(position_ids, self.group, self.head_stride))
        shard = split_for_ring(input_ids, position_ids, self.rank, self.size)
        self.tokens[0] += shard.input_ids.size(1)
        self.tokens[1] += input_ids.size(1)
        labels = ring_chunk(input_ids.roll(-1, dims=1), self.rank, self.size)  # the next token, across chunk borders
        return shard.input_ids, shard.position_ids, labels

    def token_share(self) -> float:
        """The share of the rows' tokens this rank ran through the model since the last call (about 1/K)."""
        share = self.tokens[0] / max(self.tokens[1], 1)
        self.tokens = [0, 0]
        return share

    def gather(self, local: torch.Tensor, num_tokens: int) -> torch.Tensor:
        """Per-token [1, C, ...] of every chunk -> [1, num_tokens, ...] (backward keeps this rank's slice)."""
        return gather_from_ring(local, self.group, num_tokens=num_tokens)


def setup_sequence_parallel(
    model: torch.nn.Module, hf_model: torch.nn.Module, ring_size: int, head_stride: int
) -> None:
    """Split the ranks of the default group into consecutive ring groups of `ring_size` and attach this rank's to
    `model` (as `model.sequence_parallel`). Every rank must call it: creating groups is collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % ring_size == 0, f"{world} ranks do not split into rings of {ring_size}"
    mine = None
    for start in range(0, world, ring_size):
        group = dist.new_group(list(range(start, start + ring_size)))
        if start <= rank < start + ring_size:
            mine = group
    enable_ring_attention(hf_model)
    model.sequence_parallel = SequenceParallel(mine, ring_size, rank % ring_size, head_stride)

"""Position ids for padded and packed rows."""

from __future__ import annotations

import torch


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so left- and right-padded rows both start at 0."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.clamp(min=0)


def packed_position_ids(seq_lens: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[1, sum(seq_lens)] positions restarting at 0 for every packed sequence."""
    return torch.cat([torch.arange(n, device=device) for n in seq_lens]).unsqueeze(0)

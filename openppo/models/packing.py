"""Sample packing: the real tokens of a padded batch concatenated into one row, and per-token outputs mapped back.

A packed row has no padding and no attention mask; `position_ids` restart at 0 for every sequence, which is how
transformers 5 (sdpa, eager, flex) knows not to attend across sequences (only with `use_cache=False`, see
PLATFORM.md). The RL math stays on the padded [B, T] / [B, T-1] grid: models pack on the way in and scatter their
per-token outputs back, so packing changes the compute, never the numbers.

Next-token quantities are computed on the packed row itself: packed position i is scored against token i + 1. At
the last token of a sequence that is the next sequence's first token, a meaningless value that lands on a padded
grid position no mask ever selects (the last token of a row predicts nothing).
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from openppo.models.positions import position_ids_from_mask
from openppo.models.varlen_attention import set_packed_rows


class Packed(NamedTuple):
    input_ids: torch.Tensor  # [1, N]: the real tokens of every row, row after row
    position_ids: torch.Tensor  # [1, N]: restarting at 0 for every row
    token_mask: torch.Tensor  # [B, T] bool: where the packed tokens sit on the padded grid


def pack_rows(sequences: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Pack the real tokens (attention_mask 1) of each row, in row order: [B, T] -> [1, N] with N = mask.sum()."""
    mask = attention_mask.bool()
    positions = (attention_mask.long().cumsum(-1) - 1).clamp(min=0)
    return Packed(sequences[mask].unsqueeze(0), positions[mask].unsqueeze(0), mask)


def prepare_inputs(
    input_ids: torch.Tensor, attention_mask: torch.Tensor | None, position_ids: torch.Tensor | None, pack: bool
):
    """A model's (input_ids, attention_mask, position_ids, Packed or None) for a padded batch, packed when `pack`.

    Also announces a packed row (no mask) to the varlen attention, which splits it by sequence.
    """
    packed = None
    if pack:
        assert attention_mask is not None and position_ids is None, "pack=True takes a padded batch"
        packed = pack_rows(input_ids, attention_mask)
        input_ids, attention_mask, position_ids = packed.input_ids, None, packed.position_ids
    elif position_ids is None:
        assert attention_mask is not None, "padded batches need an attention mask"
        position_ids = position_ids_from_mask(attention_mask)
    set_packed_rows(position_ids if attention_mask is None else None)
    return input_ids, attention_mask, position_ids, packed


def unpack_rows(packed: torch.Tensor, token_mask: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token values of a packed row [1, N, *rest] back on the padded grid [B, T, *rest] (autograd-aware)."""
    out = packed.new_full((*token_mask.shape, *packed.shape[2:]), fill)
    out[token_mask] = packed[0]
    return out


def next_token_values(per_position: torch.Tensor, token_mask: torch.Tensor) -> torch.Tensor:
    """Packed next-token values [1, N-1] (position i scores token i+1) -> the padded grid [B, T-1]."""
    padded = torch.nn.functional.pad(per_position, (0, 1))  # the last packed position predicts nothing
    return unpack_rows(padded, token_mask)[:, :-1]


def trim_padding(batch: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Drop the columns that are padding in every row of this micro-batch (it was padded to the whole batch).

    Tensors [b, T] are cut to the longest row W, per-token tensors [b, T-1] to W-1; others are kept.
    """
    width = batch["sequences"].size(1)
    keep = int(batch["attention_mask"].sum(-1).max())
    if keep == width:
        return batch
    out = {}
    for key, value in batch.items():
        if value.dim() >= 2 and value.size(1) == width:
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

"""Attention over packed rows without an N x N mask: each packed sequence attends to itself only ("varlen").

transformers' sdpa runs a packed row [1, N] with a block-diagonal [N, N] mask, which on CPU (and on GPUs without
flash-attn) computes and masks every cross-sequence score: the packed row pays N^2 where the sequences need only
sum(L_i^2). Here sequences of similar length share one causal sdpa call, right-padded to the longest (at most 2x
their own scores, `batches_well`); a row of very unequal ones makes one causal sdpa call per sequence. The attention
function is registered with transformers under `ATTN_IMPLEMENTATION`; it is used for the packed forwards announced
by `set_packed_rows` and is plain sdpa otherwise, so one model serves packed and padded batches. The announced rows
stay in force until the next call, because a backward with gradient checkpointing re-runs attention after the
forward has returned.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

ATTN_IMPLEMENTATION = "openppo_varlen_sdpa"

_BOUNDS: list[tuple[int, int]] | None = None  # (start, end) of every sequence of the current packed row
_PADDED: tuple[torch.Tensor, torch.Tensor] | None = None  # its `_padded_index` when `batches_well`, else None


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Start and end of each sequence of a packed row [1, N] whose positions restart at 0."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [pos.numel()]
    return list(zip(starts, ends))


def set_packed_rows(position_ids: torch.Tensor | None) -> None:
    """Announce the packed row of the next forward (and its backward); None for padded batches."""
    global _BOUNDS, _PADDED
    _BOUNDS = None if position_ids is None else sequence_bounds(position_ids)
    _PADDED = _padded_index(_BOUNDS, position_ids.device) if _BOUNDS and batches_well(_BOUNDS) else None


def batches_well(bounds: list[tuple[int, int]], max_waste: float = 2.0) -> bool:
    """Whether the sequences, right-padded to the longest, cost at most `max_waste` x their own attention scores."""
    lengths = [e - s for s, e in bounds]
    return len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= max_waste * sum(n * n for n in lengths)


def _padded_index(bounds: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, Lmax] positions of each sequence in the packed row, padded with N (a zero row appended), and the mask of
    real positions. Real positions in row-major order are the packed order."""
    num = bounds[-1][1]
    longest = max(e - s for s, e in bounds)
    index = torch.full((len(bounds), longest), num, dtype=torch.long)
    for i, (s, e) in enumerate(bounds):
        index[i, : e - s] = torch.arange(s, e)
    index = index.to(device)
    return index, index < num


def _to_padded(x: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[1, H, N, D] -> [B, H, Lmax, D] along `index` (the appended zero row fills the padding)."""
    x = torch.cat([x, x.new_zeros(1, x.shape[1], 1, x.shape[3])], dim=2)[0]
    return x[:, index].transpose(0, 1)


def varlen_attention_forward(module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                             attention_mask: torch.Tensor | None, **kwargs) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, N, H, D] (transformers' attention-function contract)."""
    bounds, padded = _BOUNDS, _PADDED
    if bounds is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != bounds[-1][1]:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if padded is not None:
        # Sequences of similar length: one causal sdpa call over them right-padded. A real query never sees the
        # padding, which comes after it, so the result is exact. One call instead of one per sequence took a
        # SmolLM2 update on CPU from 27.3 to 24.9 s (docs/benchmarks.md).
        index, real = padded
        out = sdpa_attention_forward(module, _to_padded(query, index), _to_padded(key, index),
                                     _to_padded(value, index), None, **kwargs)[0]  # [B, Lmax, H, D]
        return out[real].unsqueeze(0), None
    parts = [sdpa_attention_forward(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0]
             for s, e in bounds]
    return torch.cat(parts, dim=1), None


def _mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask for an announced packed row (the sequences are split instead); sdpa's mask otherwise."""
    return None if _BOUNDS is not None else sdpa_mask(*args, **kwargs)


def enable_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch a loaded HF model (possibly PEFT-wrapped) from sdpa to the varlen function; False if it was not on
    sdpa (eager, flash-attn or flex handle packed rows their own way) and is left alone."""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model
    if base.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
    base.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True

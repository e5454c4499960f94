"""Sequence-parallel ("ring") attention for packed rows, in plain torch (`--ring_attn_size`, `--ring_head_stride`).

A packed row [1, N] (several sequences, `position_ids` restarting at 0, no attention mask) is shared by the K
ranks of a ring group: it is right-padded to a multiple of K and rank r runs the HF model on the contiguous
chunk r of length C = N_pad / K only. Inside every attention layer the ranks exchange keys/values so that the
result equals single-rank causal attention over the whole row, block-diagonal by packed sequence.

How this departs from the textbook ring attention (arXiv 2310.01889) and from OpenRLHF's `ring_flash_attn`:
* A true ring: K/V blocks travel rank r -> r+1 with p2p send/recv (overlapped with the block compute); partial
  outputs are merged with their log-sum-exp. The backward recomputes each block's probabilities from the saved
  log-sum-exp and sends the dK/dV accumulators around the ring with the K/V blocks, one extra hop bringing each
  accumulator home. Works over gloo (CPU) and nccl.
* Chunks are contiguous (what the trainer's split gives), not zigzag: with causal masking, rank r only computes
  the blocks of ranks <= r, so the last rank does K blocks of work and the first one 1. Correct, not balanced.
* The block compute materialises [heads_per_step, C, C] fp32 scores: fine for CPU tests and modest lengths, not
  for 100k-token rows. On CUDA with `ring_flash_attn` and flash-attn installed, the flash "llama3" kernels are
  used instead (all-gather of K/V, reduce-scatter of dK/dV): that branch is a few lines and is not tested here.
* `head_stride` counts KV heads, as `heads_k_stride` in ring_flash_attn (which OpenRLHF's `--ring_head_stride`
  feeds): each step moves `head_stride` KV heads and computes the `head_stride * num_heads / num_kv_heads` query
  heads that read them, bounding the communicated and score buffers. 0 means all heads at once.
* Compute and the dK/dV accumulators are fp32 whatever the input dtype; K/V travel in the input dtype (bf16 halves
  the traffic), dK/dV in fp32 so K hops of bf16 rounding do not pile up.

Gradients: rank r's backward yields the gradient contributions that flow through its own tokens (with dK/dV of
its keys coming back from the other ranks). The gradient of the row is the SUM of the K ranks' parameter grads;
across ring groups (different rows, like data-parallel replicas) it is the usual mean. An engine that averages
over all W = num_groups * K ranks (DeepSpeed's default data-parallel group) therefore yields 1/K of the right
gradient: multiply each rank's loss by K before backward.

Labels: the log-prob of the last token of chunk r needs the first token of chunk r+1. Every rank holds the whole
packed row, so shift on the full row, then chunk: `labels = ring_chunk(input_ids.roll(-1, dims=1), r, K)`
(positions whose label crosses a sequence end, and the pad tail, are masked by the caller as without a ring).

Usage (every rank of the ring group, identical `input_ids` / `position_ids` of the full row):

    enable_ring_attention(model)                     # or from_pretrained(..., attn_implementation=ATTN_IMPLEMENTATION)
    shard = split_for_ring(input_ids, position_ids, ring_rank, ring_size)
    with ring_context(position_ids, group=ring_group, head_stride=0):
        logits = model(input_ids=shard.input_ids, position_ids=shard.position_ids, use_cache=False).logits
        labels = ring_chunk(input_ids.roll(-1, dims=1), ring_rank, ring_size)
        log_probs = gather_from_ring(log_probs_from_logits(logits, labels), ring_group, num_tokens=N)  # [1, N]
        loss = loss_fn(log_probs)                    # the same loss on every rank of the group
        loss.backward()                              # inside the context when gradient checkpointing is on
    # then reduce the parameter grads: sum within the ring group, mean across groups (see "Gradients" above)
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Iterator
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.distributed as dist
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from openppo.models.hf import base_model

ATTN_IMPLEMENTATION = "ring_attention"
"""The name to pass as `attn_implementation` (registered by `register_ring_attention`)."""


@dataclass(frozen=True)
class RingContext:
    """What the attention layers need to know about the current sharded forward (see `ring_context`)."""

    group: dist.ProcessGroup | None
    """the ring group; None for a ring of one rank (nothing is exchanged)"""
    rank: int
    """this rank's index in the ring group, i.e. which chunk of the padded row it holds"""
    size: int
    """K, the number of ranks sharing the row"""
    seq_ids: torch.Tensor
    """[N_pad] index of the packed sequence of every token of the padded row (the pad tail is one more)"""
    head_stride: int
    """KV heads per communication step; 0 = all"""

    @property
    def local_len(self) -> int:
        return self.seq_ids.numel() // self.size

    @functools.cached_property
    def cu_seqlens(self) -> torch.Tensor:
        """[num_seqs + 1] int32 sequence starts of the padded row and its length (flash-attn convention)."""
        counts = torch.bincount(self.seq_ids)  # seq_ids run 0, 0, 1, 1, 1, 2, ...: counts are the lengths
        return torch.cat([counts.new_zeros(1), counts.cumsum(0)]).to(torch.int32)


_ACTIVE: RingContext | None = None


def packed_sequence_ids(position_ids: torch.Tensor) -> torch.Tensor:
    """[N] sequence index of each token of a packed row [1, N] or [N].

    A sequence starts wherever the position does not continue the previous one by +1: the rule transformers'
    masks use for packed rows, so the ring attends exactly like the sdpa reference.
    """
    pos = position_ids.reshape(-1)
    starts = torch.ones_like(pos, dtype=torch.bool)
    starts[1:] = pos[1:] != pos[:-1] + 1
    return starts.long().cumsum(0) - 1


@contextlib.contextmanager
def ring_context(
    position_ids: torch.Tensor, group: dist.ProcessGroup | None, head_stride: int = 0
) -> Iterator[RingContext]:
    """Make the attention layers run sharded over `group` for the forwards (and backwards) inside the block.

    `position_ids`: [1, N] of the FULL packed row, unpadded, identical on every rank of the group (the same tensor
    given to `split_for_ring`). `group=None` is a ring of one rank (the ring code path without communication).
    With gradient checkpointing the backward recomputes attention, so it must run inside the block too.
    """
    global _ACTIVE
    if position_ids.dim() == 2 and position_ids.shape[0] != 1:
        raise ValueError(f"ring attention takes one packed row [1, N]; got position_ids {tuple(position_ids.shape)}")
    if head_stride < 0:
        raise ValueError(f"head_stride must be >= 0 (0 = all heads at once), got {head_stride}")
    size = 1 if group is None else dist.get_world_size(group)
    rank = 0 if group is None else dist.get_rank(group)
    n = position_ids.shape[-1]
    pad = (-n) % size
    padded = torch.cat([position_ids.reshape(-1), torch.arange(pad, device=position_ids.device)])
    ctx = RingContext(group=group, rank=rank, size=size, seq_ids=packed_sequence_ids(padded), head_stride=head_stride)
    previous, _ACTIVE = _ACTIVE, ctx
    try:
        yield ctx
    finally:
        _ACTIVE = previous


def active_ring_context() -> RingContext | None:
    return _ACTIVE


# ----------------------------------------------------------------------------------------------------------------
# Splitting the row and gathering per-token results


class RingShard(NamedTuple):
    input_ids: torch.Tensor  # [1, N_pad / K] this rank's chunk
    position_ids: torch.Tensor  # [1, N_pad / K] global packed positions of the chunk (RoPE needs them)
    pad_len: int  # N_pad - N, tokens appended at the end of the row (they all land on the last rank)


def ring_chunk(tensor: torch.Tensor, ring_rank: int, ring_size: int, pad_value: float | int = 0) -> torch.Tensor:
    """Chunk `ring_rank` of a per-token tensor [1, N, ...] right-padded with `pad_value` to a multiple of K."""
    n = tensor.shape[1]
    pad = (-n) % ring_size
    if pad:
        tail = tensor.new_full((tensor.shape[0], pad, *tensor.shape[2:]), pad_value)
        tensor = torch.cat([tensor, tail], dim=1)
    chunk = tensor.shape[1] // ring_size
    return tensor[:, ring_rank * chunk : (ring_rank + 1) * chunk]


def split_for_ring(
    input_ids: torch.Tensor, position_ids: torch.Tensor, ring_rank: int, ring_size: int, pad_token_id: int = 0
) -> RingShard:
    """This rank's chunk of a packed row [1, N]; the pad tail gets positions 0, 1, ... (its own sequence)."""
    if input_ids.shape[0] != 1 or input_ids.shape != position_ids.shape:
        raise ValueError(
            f"ring attention takes one packed row [1, N]; got input_ids {tuple(input_ids.shape)}, "
            f"position_ids {tuple(position_ids.shape)}"
        )
    pad = (-input_ids.shape[1]) % ring_size
    pad_pos = torch.arange(pad, device=position_ids.device, dtype=position_ids.dtype).unsqueeze(0)
    positions = torch.cat([position_ids, pad_pos], dim=1)
    return RingShard(
        ring_chunk(input_ids, ring_rank, ring_size, pad_token_id), ring_chunk(positions, ring_rank, ring_size), pad
    )


class _GatherFromRing(torch.autograd.Function):
    """all_gather along dim 1; backward keeps this rank's slice of the gradient, unscaled.

    Every rank computes the same loss from the same gathered tensor, so each already holds the full gradient
    w.r.t. the gathered tensor: the gradient of its own chunk is just its slice. Summing across ranks would
    count it K times.
    """

    @staticmethod
    def forward(ctx, local: torch.Tensor, group: dist.ProcessGroup, size: int, rank: int) -> torch.Tensor:
        parts = [torch.empty_like(local) for _ in range(size)]
        dist.all_gather(parts, local.contiguous(), group=group)
        ctx.rank, ctx.chunk = rank, local.shape[1]
        return torch.cat(parts, dim=1)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        return grad.narrow(1, ctx.rank * ctx.chunk, ctx.chunk).contiguous(), None, None, None


def gather_from_ring(
    local: torch.Tensor, group: dist.ProcessGroup | None, num_tokens: int | None = None
) -> torch.Tensor:
    """[1, C, ...] per-token values of each rank -> [1, N_pad, ...] on every rank (first `num_tokens` if given)."""
    full = (
        local
        if group is None
        else _GatherFromRing.apply(local, group, dist.get_world_size(group), dist.get_rank(group))
    )
    return full if num_tokens is None else full[:, :num_tokens]


# ----------------------------------------------------------------------------------------------------------------
# The ring


class _Shift:
    """Async: send `tensors` to the next rank of the ring, receive the previous rank's into new buffers.

    The sent tensors are referenced until `wait` so they cannot be freed mid-transfer. Distinct tags keep the
    K/V and dK/dV messages that are in flight together apart on gloo (nccl ignores tags and orders them).
    """

    def __init__(self, tensors: list[torch.Tensor], ring: RingContext, tag: int):
        self.sent = [t.contiguous() for t in tensors]
        self.received = [torch.empty_like(t) for t in self.sent]
        nxt = dist.get_global_rank(ring.group, (ring.rank + 1) % ring.size)
        prev = dist.get_global_rank(ring.group, (ring.rank - 1) % ring.size)
        ops = [dist.P2POp(dist.isend, t, nxt, ring.group, tag) for t in self.sent]
        ops += [dist.P2POp(dist.irecv, t, prev, ring.group, tag) for t in self.received]
        self.works = dist.batch_isend_irecv(ops)

    def wait(self) -> list[torch.Tensor]:
        for work in self.works:
            work.wait()
        self.sent = []
        return self.received


def _block_mask(ring: RingContext, src: int) -> torch.Tensor:
    """[C, C] True where local query i may attend key j of chunk `src`: same packed sequence, not in the future."""
    c = ring.local_len
    q_idx = torch.arange(ring.rank * c, (ring.rank + 1) * c, device=ring.seq_ids.device)
    k_idx = torch.arange(src * c, (src + 1) * c, device=ring.seq_ids.device)
    same_seq = ring.seq_ids[q_idx, None] == ring.seq_ids[None, k_idx]
    return same_seq & (q_idx[:, None] >= k_idx[None, :])


def _scores(q: torch.Tensor, k: torch.Tensor, mask: torch.Tensor, scale: float) -> torch.Tensor:
    """q [h, g, C, D] fp32, k [h, C, D] -> masked scores [h, g, C, C] (-inf where masked)."""
    s = torch.matmul(q, k.float().unsqueeze(1).transpose(-1, -2)) * scale
    return s.masked_fill(~mask, float("-inf"))


def _forward_heads(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, scale: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """One head group. q [h, g, C, D]; k, v [h, C, D]. Returns out [h, g, C, Dv] (fp32) and lse [h, g, C]."""
    q32 = q.float()
    out = q32.new_zeros((*q.shape[:-1], v.shape[-1]))
    lse = q32.new_full(q.shape[:-1], float("-inf"))
    kv = [k, v]
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        shift = _Shift(kv, ring, tag=0) if step + 1 < ring.size else None
        # Chunks after ours hold only future keys: fully masked, nothing to add (we still pass them on).
        if src <= ring.rank:
            s = _scores(q32, kv[0], _block_mask(ring, src), scale)
            # Step 0 is our own chunk, where every query sees at least itself: lse is finite from then on, so
            # exp(lse - new_lse) never meets -inf - -inf, and fully masked rows of later blocks add exp(-inf) = 0.
            new_lse = torch.logaddexp(lse, torch.logsumexp(s, dim=-1))
            p = torch.exp(s - new_lse.unsqueeze(-1))
            out = out * torch.exp(lse - new_lse).unsqueeze(-1) + torch.matmul(p, kv[1].float().unsqueeze(1))
            lse = new_lse
        if shift is not None:
            kv = shift.wait()
    return out, lse


def _backward_heads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    dout: torch.Tensor,
    ring: RingContext,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One head group, flash-attention style backward; shapes as in `_forward_heads`. Returns dq, dk, dv (fp32).

    dK/dV of chunk `src` ride with its K/V: at each step a rank adds its part to the accumulator received from
    the previous rank and sends it on; after K steps each accumulator has visited every rank and the last hop
    has brought it back to the rank owning those keys.
    """
    q32, do32 = q.float(), dout.float()
    delta = (do32 * out.float()).sum(-1, keepdim=True)  # rowsum(dO * O) [h, g, C, 1]
    dq = torch.zeros_like(q32)
    kv = [k, v]
    dkv_shift: _Shift | None = None
    dkv: list[torch.Tensor] = []
    for step in range(ring.size):
        src = (ring.rank - step) % ring.size
        kv_shift = _Shift(kv, ring, tag=0) if step + 1 < ring.size else None
        dk = q32.new_zeros(k.shape)
        dv = q32.new_zeros(v.shape)
        if src <= ring.rank:
            k32, v32 = kv[0].float(), kv[1].float()
            p = torch.exp(_scores(q32, k32, _block_mask(ring, src), scale) - lse.unsqueeze(-1))
            dv = torch.matmul(p.transpose(-1, -2), do32).sum(1)  # summed over the g query heads sharing v
            ds = p * (torch.matmul(do32, v32.unsqueeze(1).transpose(-1, -2)) - delta)
            dq += torch.matmul(ds, k32.unsqueeze(1)) * scale
            dk = torch.matmul(ds.transpose(-1, -2), q32).sum(1) * scale
        if dkv_shift is not None:  # the accumulator for chunk `src`, sent by the previous rank last step
            received = dkv_shift.wait()
            dk, dv = dk + received[0], dv + received[1]
        if ring.size > 1:
            dkv_shift = _Shift([dk, dv], ring, tag=1)
        else:
            dkv = [dk, dv]
        if kv_shift is not None:
            kv = kv_shift.wait()
    if dkv_shift is not None:
        dkv = dkv_shift.wait()  # our own chunk's dK/dV, complete
    return dq, dkv[0], dkv[1]


class _RingAttention(torch.autograd.Function):
    """Causal varlen attention of the local queries over the keys/values of every rank of the ring.

    q [H, C, D], k [Hkv, C, D], v [Hkv, C, Dv] (batch dim dropped; query head i reads KV head i // (H / Hkv), as
    transformers' `repeat_kv`). Returns [H, C, Dv] in q's dtype.
    """

    @staticmethod
    def forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, scale: float
    ) -> torch.Tensor:
        # Autocast would run the matmuls below in bf16 despite the explicit .float(): turn it off in here.
        with torch.autocast(q.device.type, enabled=False):
            return _RingAttention._forward(ctx, q, k, v, ring, scale)

    @staticmethod
    def _forward(
        ctx, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ring: RingContext, scale: float
    ) -> torch.Tensor:
        num_kv = k.shape[0]
        stride = ring.head_stride or num_kv
        q4 = q.unflatten(0, (num_kv, -1))
        out = q.new_empty((*q4.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q4.shape[:-1], dtype=torch.float32)
        for h in range(0, num_kv, stride):
            heads = slice(h, h + stride)
            o, block_lse = _forward_heads(q4[heads], k[heads], v[heads], ring, scale)
            out[heads], lse[heads] = o.to(out.dtype), block_lse
        out = out.flatten(0, 1)
        ctx.save_for_backward(q, k, v, out, lse)
        ctx.ring, ctx.scale, ctx.stride = ring, scale, stride
        return out

    @staticmethod
    def backward(ctx, dout: torch.Tensor):
        with torch.autocast(dout.device.type, enabled=False):
            return _RingAttention._backward(ctx, dout)

    @staticmethod
    def _backward(ctx, dout: torch.Tensor):
        q, k, v, out, lse = ctx.saved_tensors
        num_kv = k.shape[0]
        q4, out4, dout4 = (t.unflatten(0, (num_kv, -1)) for t in (q, out, dout))
        dq, dk, dv = torch.empty_like(q4), torch.empty_like(k), torch.empty_like(v)
        for h in range(0, num_kv, ctx.stride):
            heads = slice(h, h + ctx.stride)
            grads = _backward_heads(
                q4[heads], k[heads], v[heads], out4[heads], lse[heads], dout4[heads], ctx.ring, ctx.scale
            )
            dq[heads], dk[heads], dv[heads] = (g.to(dq.dtype) for g in grads)
        return dq.flatten(0, 1), dk, dv, None, None


# ----------------------------------------------------------------------------------------------------------------
# CUDA: ring_flash_attn's "llama3" kernels (all-gather K/V, reduce-scatter dK/dV), when importable.
# Untested here (no CUDA, no flash-attn on the dev box); it takes the same contiguous chunks as the torch ring.

try:
    from ring_flash_attn import llama3_flash_attn_prepare_cu_seqlens, llama3_flash_attn_varlen_func
except (ImportError, OSError):  # flash-attn missing, or built for another CUDA/torch
    llama3_flash_attn_varlen_func = None


def _flash_ring(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, ring: RingContext, scale: float
) -> torch.Tensor:
    """[1, H, C, D] inputs -> [1, C, H, D] output, via ring_flash_attn (varlen layout [C, H, D])."""
    cu_q, cu_k, max_q, max_k, k_slice = llama3_flash_attn_prepare_cu_seqlens(
        ring.cu_seqlens.to(query.device), True, ring.rank, ring.size
    )
    out = llama3_flash_attn_varlen_func(
        query[0].transpose(0, 1),
        key[0].transpose(0, 1),
        value[0].transpose(0, 1),
        cu_q,
        cu_k,
        max_q,
        max_k,
        heads_k_stride=ring.head_stride or key.shape[1],
        local_k_slice=k_slice,
        softmax_scale=scale,
        causal=True,
        group=ring.group,
    )
    return out.unsqueeze(0)


# ----------------------------------------------------------------------------------------------------------------
# transformers 5 attention interface


def ring_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    sliding_window: int | None = None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' attention-function signature: query [B, H, S, D], key/value [B, Hkv, S, D] -> [B, S, H, D].

    Without an active `ring_context` this is transformers' sdpa (with the mask our mask function let transformers
    build), so one model serves sharded and unsharded forwards.
    """
    ring = _ACTIVE
    if ring is None:
        return sdpa_attention_forward(
            module,
            query,
            key,
            value,
            attention_mask,
            dropout=dropout,
            scaling=scaling,
            sliding_window=sliding_window,
            **kwargs,
        )
    if attention_mask is not None or query.shape[0] != 1:
        raise ValueError(
            "ring attention runs one packed row [1, C] per rank with attention_mask=None "
            f"(got batch {query.shape[0]}, mask {'set' if attention_mask is not None else 'None'})"
        )
    if query.shape[2] != ring.local_len:
        raise ValueError(
            f"ring attention: this rank's chunk has {ring.local_len} tokens but the layer got "
            f"{query.shape[2]}; feed the chunk from split_for_ring(...) of the row given to ring_context"
        )
    if dropout or sliding_window is not None or kwargs.get("softcap") or not getattr(module, "is_causal", True):
        raise NotImplementedError("ring attention supports causal attention without dropout, sliding window or softcap")
    num_kv = key.shape[1]
    if ring.head_stride and num_kv % ring.head_stride:
        raise ValueError(f"head_stride {ring.head_stride} must divide the number of KV heads ({num_kv})")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    if (
        llama3_flash_attn_varlen_func is not None
        and query.is_cuda
        and ring.size > 1
        and query.dtype in (torch.float16, torch.bfloat16)
    ):
        return _flash_ring(query, key, value, ring, scale), None
    out = _RingAttention.apply(query[0], key[0], value[0], ring, scale)
    return out.transpose(0, 1).unsqueeze(0), None


def _ring_mask(*args, **kwargs) -> torch.Tensor | None:
    """Mask function for our implementation name: none when sharded (the ring masks by sequence itself),
    transformers' sdpa mask otherwise (padded batches keep their padding mask on the unsharded path)."""
    return None if _ACTIVE is not None else sdpa_mask(*args, **kwargs)


def register_ring_attention() -> None:
    """Register `ATTN_IMPLEMENTATION` with transformers (idempotent): needed before from_pretrained(...,
    attn_implementation=ATTN_IMPLEMENTATION). Without a registered mask function transformers would drop the
    attention mask silently for an unknown name, so we register one too."""
    AttentionInterface.register(ATTN_IMPLEMENTATION, ring_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _ring_mask)


def enable_ring_attention(model: torch.nn.Module) -> None:
    """Switch a loaded HF model (PreTrainedModel, possibly PEFT-wrapped) to ring attention."""
    register_ring_attention()
    base = base_model(model)
    base.set_attn_implementation(ATTN_IMPLEMENTATION)
    if base.config._attn_implementation != ATTN_IMPLEMENTATION:
        raise ValueError(
            f"{type(base).__name__} does not dispatch attention through transformers' "
            "AttentionInterface; it cannot use ring attention"
        )

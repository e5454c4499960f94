"""Attention over packed rows without an N x N mask: each packed sequence attends to itself only ("varlen").

transformers' sdpa runs a packed row [1, N] with a block-diagonal [N, N] mask, which on CPU (and on GPUs without
flash-attn) computes and masks every cross-sequence score: the packed row pays N^2 where the sequences need only
sum(L_i^2). Here sequences of similar length share one causal sdpa call, right-padded to the longest (at most 2x
their own scores, `batches_well`); a row of very unequal ones makes one causal sdpa call per sequence. The attention
function is registered with transformers under `ATTN_IMPLEMENTATION`; it is used for the packed forwards announced
by `set_packed_rows` and is plain sdpa otherwise, so one model serves packed and padded batches. The announced rows
stay in force until the next call, because a backward with gradient checkpointing re-runs attention after the
forward has returned.

Shared prompts (`set_shared_rows`): a group's prompt sits once in the row, followed by each of its responses, and
each response attends to the prompt and to itself. The prompts attend as packed sequences; the responses attend in
one sdpa call, right-padded, with each response's keys and values laid out as [its prompt, padded to the longest |
itself] and a mask that lets query j see the prompt and the response up to j (the lower-right causal rule of a
suffix). The prompt's keys and values are gathered once per response, so their gradients add up over the group.
On a GPU (`FLEX_DEVICES`) the whole shared row instead runs as one FlexAttention call (transformers' compiled
`flex_attention_forward`) under a block mask of the same rule, so no key or value is copied and only the blocks
the rule keeps are computed.
"""

from __future__ import annotations

import torch
from transformers import AttentionInterface, masking_utils
from transformers.integrations.flex_attention import flex_attention_forward
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from openppo.models.hf import base_model
from openppo.models.ring_attention import packed_sequence_ids
from openppo.utils.transfer import upload

ATTN_IMPLEMENTATION = "openppo_varlen_sdpa"

# On CPU, PyTorch's bf16/fp16 flash kernel is slower than its fp32 one up to about this many tokens per sequence
# (docs/benchmarks.md, "Measurements behind code defaults"), so shorter sequences attend in fp32: faster, and the
# softmax in full precision.
CPU_FP32_ATTENTION_MAX_LEN = 512

# Devices whose shared-prompt rows attend through FlexAttention: it needs torch.compile's GPU kernels for speed and
# has no backward on CPU, where the per-response sdpa call runs instead.
FLEX_DEVICES = ("cuda",)

_BOUNDS: list[tuple[int, int]] | None = None  # (start, end) of every sequence of the current packed row
_PADDED: tuple[torch.Tensor, torch.Tensor] | None = None  # its `_padded_index` when `batches_well`, else None
_SHARED: SharedAttention | None = None  # the current row's responses to shared prompts (`set_shared_rows`)
_ROW: tuple[int, torch.Tensor | None] | None = None  # the packed row's length and transformers' sequence ids of it
_PADDING: bool | None = None  # whether the current padded batch has padding, when known (`set_padded_rows`)


def sequence_bounds(position_ids: torch.Tensor) -> list[tuple[int, int]]:
    """Start and end of each sequence of a packed row [1, N] whose positions restart at 0."""
    pos = position_ids.reshape(-1)
    starts = (pos == 0).nonzero().flatten().tolist()
    if not starts or starts[0] != 0:
        starts = [0] + starts
    ends = starts[1:] + [pos.numel()]
    return list(zip(starts, ends))


def set_packed_rows(position_ids: torch.Tensor | None, device: torch.device | None = None) -> None:
    """Announce the packed row of the next forward (and its backward); None for padded batches. `device`: the
    model's, when `position_ids` are a host copy (read there without waiting on the GPU)."""
    global _BOUNDS, _PADDED, _SHARED, _ROW, _PADDING
    _PADDING = None
    _BOUNDS = None if position_ids is None else sequence_bounds(position_ids)
    device = device or (None if position_ids is None else position_ids.device)
    _PADDED = _padded_index(_BOUNDS, device) if _BOUNDS and batches_well(_BOUNDS) else None
    _SHARED = None
    _ROW = None
    if _BOUNDS:  # transformers' form: each token's sequence, None for a row of one sequence (`_packed_sequences`)
        lengths = torch.tensor([e - s for s, e in _BOUNDS])
        ids = torch.repeat_interleave(torch.arange(len(_BOUNDS)), lengths).unsqueeze(0)
        _ROW = (_BOUNDS[-1][1], upload(ids, device) if len(_BOUNDS) > 1 else None)


def _row_sequence_ids(position_ids: torch.Tensor, device: torch.device) -> tuple[int, torch.Tensor | None]:
    """transformers' sequence ids of a row from its host `position_ids` [1, N] (`_packed_sequences`), by its own
    rule, which ring attention's `packed_sequence_ids` follows too; None for one sequence."""
    ids = packed_sequence_ids(position_ids)
    return ids.numel(), upload(ids.unsqueeze(0), device) if bool(ids[-1] > 0) else None


def set_shared_rows(
    prompts: list[tuple[int, int]],
    responses: list[tuple[int, int, int]],
    num_tokens: int,
    device: torch.device,
    position_ids: torch.Tensor | None = None,
) -> None:
    """Announce a row of shared prompts: `prompts` (start, end), then `responses` (start, end, index of the prompt
    it answers), covering the row's `num_tokens` tokens; `position_ids` [1, N]: the row's on the host, from which
    transformers' sequence search is answered without waiting on the GPU."""
    global _BOUNDS, _PADDED, _SHARED, _ROW, _PADDING
    _BOUNDS, _PADDING = prompts, None
    _ROW = None if position_ids is None else _row_sequence_ids(position_ids, device)
    _PADDED = _padded_index(prompts, device) if batches_well(prompts) else None
    _SHARED = SharedAttention(prompts, [r for r in responses if r[1] > r[0]], num_tokens, device)


class SharedAttention:
    """The gathers and the mask that run every response of a shared-prompt row in one sdpa call (module doc)."""

    def __init__(self, prompts: list[tuple[int, int]], responses: list[tuple[int, int, int]], num_tokens: int, device):
        self.num_responses = len(responses)
        prompt_len = max(e - s for s, e in prompts)
        longest = max((e - s for s, e, _ in responses), default=0)
        q_index = torch.zeros(len(responses), longest, dtype=torch.long)
        kv_index = torch.zeros(len(responses), prompt_len + longest, dtype=torch.long)
        mask = torch.zeros(len(responses), 1, longest, prompt_len + longest, dtype=torch.bool)
        mask[:, :, :, 0] = True  # a padding query sees one real key: its (dropped) output stays finite
        real = torch.zeros(len(responses), longest, dtype=torch.bool)
        for i, (s, e, g) in enumerate(responses):
            ps, pe = prompts[g]
            n = e - s
            q_index[i, :n] = torch.arange(s, e)
            kv_index[i, : pe - ps] = torch.arange(ps, pe)
            kv_index[i, prompt_len : prompt_len + n] = torch.arange(s, e)
            mask[i, 0, :n, : pe - ps] = True
            mask[i, 0, :n, prompt_len : prompt_len + n] = torch.ones(n, n, dtype=torch.bool).tril()
            real[i, :n] = True
        self.q_index, self.kv_index = upload(q_index.flatten(), device), upload(kv_index.flatten(), device)
        self.mask = upload(mask, device)
        self.real = upload(real.flatten().nonzero().flatten(), device)
        # where each of the row's tokens lands in [prompt tokens..., response tokens...]
        order = torch.cat([torch.arange(s, e) for s, e in prompts] + [torch.arange(s, e) for s, e, _ in responses])
        assert order.numel() == num_tokens, "the prompts and responses must cover the row"
        self.inverse = upload(torch.empty_like(order).scatter_(0, order, torch.arange(order.numel())), device)
        self._prompts, self._responses, self._num_tokens = prompts, responses, num_tokens
        self._block_mask = None  # FlexAttention's, built at the first layer that needs it

    def block_mask(self, device: torch.device):
        """FlexAttention's block mask of the row: a token sees the earlier tokens of its own sequence (a prompt, or a
        response), and a response token also sees every token of the prompt it answers."""
        if self._block_mask is None:
            from torch.nn.attention.flex_attention import create_block_mask

            n = self._num_tokens
            sequence = torch.empty(n, dtype=torch.long)  # prompts 0..P-1, then one id per response
            group = torch.empty(n, dtype=torch.long)  # the prompt a token is of, or answers
            in_prompt = torch.zeros(n, dtype=torch.bool)
            for g, (s, e) in enumerate(self._prompts):
                sequence[s:e], group[s:e], in_prompt[s:e] = g, g, True
            for i, (s, e, g) in enumerate(self._responses):
                sequence[s:e], group[s:e] = len(self._prompts) + i, g
            sequence, group, in_prompt = (upload(x, device) for x in (sequence, group, in_prompt))

            def visible(b, h, q, kv):
                own = (sequence[q] == sequence[kv]) & (kv <= q)
                return own | (in_prompt[kv] & ~in_prompt[q] & (group[q] == group[kv]))

            self._block_mask = create_block_mask(visible, None, None, n, n, device=device)
        return self._block_mask

    def responses(self, module, query, key, value, **kwargs) -> torch.Tensor:
        """[n, H, D]: every response token's attention output, response after response (n: their tokens)."""
        q = _to_padded(query, self.q_index, self.num_responses)
        k = _to_padded(key, self.kv_index, self.num_responses)
        v = _to_padded(value, self.kv_index, self.num_responses)
        out = _sdpa(module, q, k, v, self.mask, **kwargs)[0]  # [R, L, H, D]
        return out.reshape(-1, *out.shape[2:]).index_select(0, self.real)


def batches_well(bounds: list[tuple[int, int]], max_waste: float = 2.0) -> bool:
    """Whether the sequences, right-padded to the longest, cost at most `max_waste` x their own attention scores."""
    lengths = [e - s for s, e in bounds]
    return len(lengths) > 1 and len(lengths) * max(lengths) ** 2 <= max_waste * sum(n * n for n in lengths)


def _padded_index(bounds: list[tuple[int, int]], device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """The gather index [B * Lmax] that lays the packed row out as B right-padded sequences, and the flat positions
    of the real tokens in that layout (row-major, which is the packed order).

    Padding slots gather position 0. Under a causal mask a real query only sees keys before it, all real, and a
    padding query's output is dropped, so what the padding holds never reaches a result and its gradient is zero.
    Gathers (`index_select`, whose backward is `index_add_`) took half the time of boolean-mask indexing."""
    longest = max(e - s for s, e in bounds)
    index = torch.zeros(len(bounds), longest, dtype=torch.long)
    real = torch.zeros(len(bounds), longest, dtype=torch.bool)
    for i, (s, e) in enumerate(bounds):
        index[i, : e - s] = torch.arange(s, e)
        real[i, : e - s] = True
    return upload(index.flatten(), device), upload(real.flatten().nonzero().flatten(), device)


def _to_padded(x: torch.Tensor, index: torch.Tensor, num_seqs: int) -> torch.Tensor:
    """[1, H, N, D] -> [B, H, Lmax, D] along the gather `index`."""
    heads, dim = x.shape[1], x.shape[3]
    return x[0].index_select(1, index).view(heads, num_seqs, -1, dim).transpose(0, 1)


def _sdpa(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """transformers' sdpa, run in fp32 for half-precision inputs on CPU up to `CPU_FP32_ATTENTION_MAX_LEN` tokens."""
    dtype = query.dtype
    if (
        query.device.type != "cpu"
        or dtype not in (torch.bfloat16, torch.float16)
        or query.shape[2] > CPU_FP32_ATTENTION_MAX_LEN
    ):
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    if attention_mask is not None and attention_mask.is_floating_point():
        attention_mask = attention_mask.float()
    out, weights = sdpa_attention_forward(module, query.float(), key.float(), value.float(), attention_mask, **kwargs)
    return out.to(dtype), weights


# Opaque to torch.compile (--torch_compile): the packed rows' bounds are Python ints read from module state, on which
# a traced layer would be specialised, so every new packing would compile it again (20-30 s each on a 2-core CPU)
# until dynamo's recompile limit sent it back to eager. The layer's graph breaks around attention instead, and the
# compiled pieces take any length (FlexAttention's own compiled kernel, on GPU, is still compiled inside).
@torch.compiler.disable
def varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    **kwargs,
) -> tuple[torch.Tensor, None]:
    """query [1, H, N, D], key/value [1, Hkv, N, D] -> [1, N, H, D] (transformers' attention-function contract)."""
    bounds, padded, shared = _BOUNDS, _PADDED, _SHARED
    if shared is not None and attention_mask is None and query.shape[0] == 1:
        if query.device.type in FLEX_DEVICES:
            return flex_attention_forward(module, query, key, value, shared.block_mask(query.device), **kwargs)
        parts = [_sequences(module, query, key, value, bounds, padded, **kwargs)[0]]
        if shared.num_responses:
            parts.append(shared.responses(module, query, key, value, **kwargs))
        return torch.cat(parts).index_select(0, shared.inverse).unsqueeze(0), None
    if bounds is None or attention_mask is not None or query.shape[0] != 1 or query.shape[2] != bounds[-1][1]:
        return _sdpa(module, query, key, value, attention_mask, **kwargs)
    return _sequences(module, query, key, value, bounds, padded, **kwargs), None


def _sequences(module, query, key, value, bounds, padded, **kwargs) -> torch.Tensor:
    """[1, n, H, D]: the packed sequences at `bounds` of the row, each attending to itself (n: their tokens)."""
    if padded is not None:
        # Sequences of similar length: one causal sdpa call over them right-padded. A real query never sees the
        # padding, which comes after it, so the result is exact. One call is faster than one per sequence
        # (docs/benchmarks.md, "Measurements behind code defaults").
        index, real = padded
        num = len(bounds)
        out = _sdpa(
            module,
            _to_padded(query, index, num),
            _to_padded(key, index, num),
            _to_padded(value, index, num),
            None,
            **kwargs,
        )[0]  # [B, Lmax, H, D]
        return out.reshape(-1, *out.shape[2:]).index_select(0, real).unsqueeze(0)
    parts = [_sdpa(module, query[:, :, s:e], key[:, :, s:e], value[:, :, s:e], None, **kwargs)[0] for s, e in bounds]
    return torch.cat(parts, dim=1)


def _mask(*args, **kwargs) -> torch.Tensor | None:
    """No mask for an announced packed row (the sequences are split instead); sdpa's mask otherwise. transformers
    reads the padding mask to see whether sdpa's causal shortcut applies (rows without padding), which would wait on
    the GPU: for padded rows the host knows to have padding (`set_padded_rows`) it cannot, and for rows it knows to
    have none the all-ones mask is left out, so the shortcut is found without reading it."""
    if _BOUNDS is not None:
        return None
    if _PADDING:  # the shortcut needs rows without padding
        kwargs["allow_is_causal_skip"] = False
    elif _PADDING is False and "attention_mask" in kwargs:  # an all-ones mask masks nothing: the same mask without it
        kwargs["attention_mask"] = None
    return sdpa_mask(*args, **kwargs)


def set_padded_rows(has_padding: bool | None) -> None:
    """Announce a padded batch (no packed row) for the next forward; `has_padding`: whether it has padding, known
    from the host's mask (None: unknown, transformers reads the device's)."""
    global _BOUNDS, _PADDED, _SHARED, _ROW, _PADDING
    _BOUNDS = _PADDED = _SHARED = _ROW = None
    _PADDING = has_padding


_find_packed_sequences = masking_utils.find_packed_sequence_indices


def _packed_sequences(position_ids: torch.Tensor) -> torch.Tensor | None:
    """transformers' sequence ids of a packed row (for the masks of every attention but ours), from the announced
    row's bounds when `position_ids` are that row's: its own search reads a device value, which makes the host wait
    for the GPU in every forward. The same values: a sequence starts where the positions restart."""
    if _ROW is None or tuple(position_ids.shape) != (1, _ROW[0]):
        return _find_packed_sequences(position_ids)
    return _ROW[1]


def enable_varlen_attention(model: torch.nn.Module) -> bool:
    """Switch a loaded HF model (possibly PEFT-wrapped) from sdpa to the varlen function; False if it was not on
    sdpa (eager, flash-attn or flex handle packed rows their own way) and is left alone."""
    base = base_model(model)
    if base.config._attn_implementation != "sdpa":
        return False
    AttentionInterface.register(ATTN_IMPLEMENTATION, varlen_attention_forward)
    AttentionMaskInterface.register(ATTN_IMPLEMENTATION, _mask)
    # (module-wide, but a no-op unless a row is announced, and only our attention announces rows)
    masking_utils.find_packed_sequence_indices = _packed_sequences
    base.set_attn_implementation(ATTN_IMPLEMENTATION)
    return True

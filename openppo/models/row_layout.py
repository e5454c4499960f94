"""Row layout: how a model runs a right-padded batch, chosen once per model (`RowLayout`).

- padded: the batch as it is, with an attention mask; every padding position is computed.
- packed (`--packing_samples`): the real tokens of all rows concatenated into one row [1, N] with no mask and
  `position_ids` restarting at 0 per sequence, which is how transformers 5 (sdpa, eager, flex) and our varlen
  attention know not to attend across sequences (only with `use_cache=False`, see PLATFORM.md).
- ring (`--ring_attn_size K`): packed, and the row sharded over K consecutive ranks that run ring attention
  together (`openppo.models.ring_attention`); each rank computes about 1/K of the tokens.
- shared prompts (`--share_prompt_in_group`): packed, with the prompt of consecutive rows that start with the same
  prompt (the n samples of a group) once, followed by each row's response; a response attends to the prompt and to
  itself, at the positions it has in its own row (`SharedPrompts`; the attention is in
  `openppo.models.varlen_attention`). The prompt's tokens are computed once for the group, and in a backward they
  receive the gradients of all its responses.

Whatever the layout, the models take the padded [B, T] batch and return per-token values on the padded grid
([B, T] or [B, T-1] for next-token values), so the RL math never sees the layout: it changes the compute, not the
numbers. The masks may be given on the host for a model on a GPU (the training loop does): the layout is then
computed on the host and its indices copied to the device without waiting on it (`openppo.utils.transfer`), where
reading a device mask's layout would make the host wait for the GPU to run everything queued before it.
Next-token values are computed on the model's row itself: position i is scored against token i + 1. In a
packed row the last token of a sequence is then scored against the next sequence's first token, a meaningless value
that lands on a padded-grid position no mask selects (the last token of a row predicts nothing).
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from openppo.models.ring_attention import (
    enable_ring_attention,
    gather_from_ring,
    ring_chunk,
    ring_context,
    split_for_ring,
)
from openppo.models.varlen_attention import set_packed_rows, set_padded_rows, set_shared_rows
from openppo.utils.transfer import host_copy, upload


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions counting only real tokens, so left- and right-padded rows both start at 0."""
    return (attention_mask.long().cumsum(-1) - 1).clamp(min=0)


def packed_position_ids(seq_lens: list[int], device: torch.device | None = None) -> torch.Tensor:
    """[1, sum(seq_lens)] positions restarting at 0 for every packed sequence."""
    return torch.cat([torch.arange(n, device=device) for n in seq_lens]).unsqueeze(0)


@dataclass
class Packed:
    input_ids: torch.Tensor  # [1, N]: the real tokens of every row, row after row
    position_ids: torch.Tensor  # [1, N]: restarting at 0 for every row
    token_mask: torch.Tensor  # [B, T] bool: where the packed tokens sit on the padded grid (on the mask's device)
    token_index: torch.Tensor  # [N]: their flat positions on the grid, on the model's device
    mask_position_ids: torch.Tensor  # [1, N]: `position_ids` on the mask's device


def pack_rows(sequences: torch.Tensor, attention_mask: torch.Tensor) -> Packed:
    """Pack the real tokens (attention_mask 1) of each row, in row order: [B, T] -> [1, N] with N = mask.sum().
    The layout is computed on the mask's device (the host's, without waiting on the GPU) and the tokens gathered on
    the sequences' one."""
    mask = attention_mask.bool()
    flat = mask.flatten().nonzero().squeeze(1)
    positions = position_ids_from_mask(attention_mask)[mask].unsqueeze(0)
    index = upload(flat, sequences.device)
    tokens = sequences.flatten().index_select(0, index).unsqueeze(0)
    return Packed(tokens, upload(positions, sequences.device), mask, index, positions)


def unpack_rows(packed: torch.Tensor, token_mask: torch.Tensor, token_index: torch.Tensor, fill: float = 0.0):
    """Per-token values of a packed row [1, N, *rest] back on the padded grid [B, T, *rest] (autograd-aware):
    `token_mask` [B, T] gives the grid's shape and `token_index` [N] the tokens' flat places on it (`Packed`).
    A gather by index: a boolean-mask assignment would make the host wait on the GPU for the mask's count."""
    rest = packed.shape[2:]
    out = packed.new_full((token_mask.numel(), *rest), fill)
    return out.index_copy(0, token_index, packed[0]).view(*token_mask.shape, *rest)


@dataclass
class SharedPrompts:
    """A row of shared prompts: every group's prompt once, then each of its rows' responses (module doc).

    `grid_index` [B, T] is where each token of the padded batch sits in the row (-1 for padding); `prompts` and
    `responses` are the (start, end) of each part in the row, a response with the index of its prompt."""

    input_ids: torch.Tensor  # [1, N]
    position_ids: torch.Tensor  # [1, N]: each token's position in its own row
    grid_index: torch.Tensor  # [B, T]
    prompts: list[tuple[int, int]]
    responses: list[tuple[int, int, int]]
    host_grid_index: torch.Tensor | None = None  # `grid_index` on the host, where the layout is read
    host_position_ids: torch.Tensor | None = None  # `position_ids` on the host

    @classmethod
    def pack(cls, sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> SharedPrompts:
        """Consecutive rows whose first `prompt_lens` tokens are the same (and as many) share them. The tokens are
        compared, and the layout built, on the host (from `host_copy` of uploaded sequences, and the host's masks):
        on a GPU nothing waits for it."""
        lengths = attention_mask.sum(-1).tolist()
        shares = shared_prefixes(host_copy(sequences), attention_mask, prompt_lens)
        grid = torch.full(sequences.shape, -1, dtype=torch.long)
        pieces, positions, prompts, responses = [], [], [], []
        n = 0  # tokens in the row so far
        for b, (length, p) in enumerate(zip(lengths, prompt_lengths_in(attention_mask, prompt_lens))):
            if not shares[b]:  # a new group: its prompt goes first
                prompts.append((n, n + p))
                pieces.append(sequences[b, :p])
                positions.append(torch.arange(p))
                n += p
            ps = prompts[-1][0]
            grid[b, :p] = torch.arange(ps, ps + p)
            responses.append((n, n + length - p, len(prompts) - 1))
            pieces.append(sequences[b, p:length])
            positions.append(torch.arange(p, length))
            grid[b, p:length] = torch.arange(n, n + length - p)
            n += length - p
        device, positions = sequences.device, torch.cat(positions).unsqueeze(0)
        return cls(
            torch.cat(pieces).unsqueeze(0),
            upload(positions, device),
            upload(grid, device),
            prompts,
            responses,
            grid,
            positions,
        )

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """Per-token values of the row [1, N, *rest] -> the padded grid [B, T, *rest] (a shared prompt's values go to
        every row of its group; autograd-aware)."""
        flat = values[0].index_select(0, self.grid_index.clamp(min=0).flatten())
        flat = flat.view(*self.grid_index.shape, *values.shape[2:])
        real = (self.grid_index >= 0).view(*self.grid_index.shape, *([1] * (values.dim() - 2)))
        return flat * real


def prompt_lengths_in(attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> list[int]:
    """Each row's prompt length, within its row (at least one token, at most all of them)."""
    return [min(max(int(p), 1), int(n)) for p, n in zip(prompt_lens.tolist(), attention_mask.sum(-1).tolist())]


def shared_prefixes(sequences: torch.Tensor, attention_mask: torch.Tensor, prompt_lens: torch.Tensor) -> list[int]:
    """Per row, the prompt tokens it shares with the row before it: its whole prompt when that row has the same
    prompt (the same tokens, as many), else 0. Rows sharing with their predecessor form a group."""
    prompts = prompt_lengths_in(attention_mask, prompt_lens)
    return [
        p if b and p == prompts[b - 1] and torch.equal(sequences[b, :p], sequences[b - 1, :p]) else 0
        for b, p in enumerate(prompts)
    ]


class Ring:
    """This rank's ring group: every rank of it holds the same packed row and runs its own chunk. The ring context
    stays active until the next row: a backward with gradient checkpointing re-runs attention and must still find
    it (see openppo.models.ring_attention)."""

    def __init__(self, group: dist.ProcessGroup | None, size: int, rank: int, head_stride: int):
        self.group, self.size, self.rank, self.head_stride = group, size, rank, head_stride
        self._active = contextlib.ExitStack()
        self.tokens = [0, 0]  # (this rank's chunk, whole rows) tokens so far: the share a rank really computes

    def shard(self, input_ids: torch.Tensor, position_ids: torch.Tensor):
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


@dataclass
class Rows:
    """One batch laid out for the model: its inputs, the next-token labels of each input position, and the way back
    to the padded grid."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor
    labels: torch.Tensor  # the token each input position predicts
    token_mask: torch.Tensor | None = None  # packed from a padded batch: where the row's tokens sit on the grid
    token_index: torch.Tensor | None = None  # and their flat places on it, on the model's device (`Packed`)
    shared: SharedPrompts | None = None  # shared prompts: where the grid's tokens sit in the row
    ring: Ring | None = None
    num_tokens: int = 0  # the whole packed row's length when this rank holds a ring chunk

    def to_grid(self, values: torch.Tensor) -> torch.Tensor:
        """Per-position values of the model's row [b, C, *rest] -> the padded grid [B, T, *rest]."""
        if self.ring is not None:
            values = self.ring.gather(values, self.num_tokens)
        if self.shared is not None:
            return self.shared.to_grid(values)
        return values if self.token_mask is None else unpack_rows(values, self.token_mask, self.token_index)

    def router_weights(self) -> torch.Tensor | None:
        """Each input token's weight in a mean over the batch's tokens (a router's load-balancing loss): the
        attention mask, or with shared prompts the rows a token stands for, so that a group's prompt counts once per
        response, as in rows that do not share it."""
        if self.shared is None:
            return self.attention_mask
        index = self.shared.grid_index
        counts = torch.bincount(index[index >= 0], minlength=self.input_ids.size(1))
        return counts.unsqueeze(0).to(torch.float32)

    def next_token_grid(self, values: torch.Tensor) -> torch.Tensor:
        """Next-token values [b, C] of the model's row (position i scores token i + 1) -> [B, T-1]. The row's last
        position predicts nothing: it is dropped, and in a packed row its place on the grid holds 0."""
        assert self.shared is None, "a shared prompt's last position predicts each row's own next token"
        if self.ring is not None:
            values = self.ring.gather(values, self.num_tokens)
        values = values[:, :-1]
        if self.token_mask is None:
            return values
        return unpack_rows(torch.nn.functional.pad(values, (0, 1)), self.token_mask, self.token_index)[:, :-1]


@dataclass
class RowLayout:
    packed: bool = False
    ring: Ring | None = None  # packed rows sharded over this ring group
    share_prompts: bool = False  # packed rows with each group's prompt once (given the rows' prompt lengths)

    @property
    def name(self) -> str:
        if self.ring is not None:
            return "ring"
        return "shared" if self.share_prompts else "packed" if self.packed else "padded"

    def rows(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None,
        position_ids: torch.Tensor | None = None,
        prompt_lens: torch.Tensor | None = None,
    ) -> Rows:
        """The model's inputs for a right-padded batch [B, T] with its mask, or for a row the caller packed itself
        (`position_ids` restarting per sequence, no mask: SFT's packed batches). With `share_prompts` and the rows'
        `prompt_lens` [B], consecutive rows with the same prompt share it. Also announces a packed row to the varlen
        attention, which splits it by sequence."""
        if self.share_prompts and prompt_lens is not None and attention_mask is not None and position_ids is None:
            shared = SharedPrompts.pack(input_ids, attention_mask, prompt_lens)
            rows = Rows(shared.input_ids, None, shared.position_ids, shared.input_ids, shared=shared)
            device = rows.input_ids.device
            set_shared_rows(shared.prompts, shared.responses, rows.input_ids.size(1), device, shared.host_position_ids)
            return rows
        device = input_ids.device
        if position_ids is not None or attention_mask is None:
            assert position_ids is not None and attention_mask is None, "a packed row takes position_ids, no mask"
            rows = Rows(input_ids, None, position_ids, input_ids.roll(-1, dims=1))
            set_packed_rows(position_ids)
        elif self.packed:
            p = pack_rows(input_ids, attention_mask)
            rows = Rows(p.input_ids, None, p.position_ids, p.input_ids.roll(-1, dims=1), p.token_mask, p.token_index)
            set_packed_rows(p.mask_position_ids, device)  # the sequences' bounds, read from the mask's device
        else:
            mask, positions = upload(attention_mask, device), upload(position_ids_from_mask(attention_mask), device)
            rows = Rows(input_ids, mask, positions, input_ids.roll(-1, dims=1))
            # whether the rows have padding, when the host's mask tells without waiting on the GPU
            set_padded_rows(not bool(attention_mask.all()) if attention_mask.device.type == "cpu" else None)
        if self.ring is not None and rows.token_mask is not None:
            rows.num_tokens = rows.input_ids.size(1)
            rows.input_ids, rows.position_ids, rows.labels = self.ring.shard(rows.input_ids, rows.position_ids)
            rows.ring = self.ring
        return rows


def ring_layout(hf_model: torch.nn.Module, ring_size: int, head_stride: int) -> RowLayout:
    """Split the ranks of the default group into consecutive ring groups of `ring_size` and return the packed layout
    sharded over this rank's ring. Every rank must call it: creating groups is collective."""
    world, rank = dist.get_world_size(), dist.get_rank()
    assert world % ring_size == 0, f"{world} ranks do not split into rings of {ring_size}"
    mine = None
    for start in range(0, world, ring_size):
        group = dist.new_group(list(range(start, start + ring_size)))
        if start <= rank < start + ring_size:
            mine = group
    enable_ring_attention(hf_model)
    return RowLayout(packed=True, ring=Ring(mine, ring_size, rank % ring_size, head_stride))

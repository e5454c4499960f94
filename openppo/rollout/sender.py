"""Trainer side of the weight sync: full HF-named weights out of the training model, bucketed to the engines.

One sync, as every trainer rank runs it (`sync_weights`):

    for each layer:   gather its parameters (ZeRO-3: a collective every rank enters)
                      rank 0: merge LoRA adapters, yield (hf_name, full tensor)
    rank 0:           pack the stream into buckets of <= bucket_bytes; per bucket, ask every engine to receive
                      it (Ray call, returns at once) and broadcast it over the sync group; finally wait for all.

Departures from OpenRLHF's `broadcast_to_vllm` (one gather + one RPC + one broadcast per parameter): parameters are
gathered a layer at a time and sent a bucket at a time (a few hundred MiB per message instead of thousands of
small ones), LoRA adapters are merged into the base weights on the fly (the engine never sees adapters), and the
tensors may be cast to the engine's dtype before sending.

Engines are Ray actor handles of `VLLMEngine` with the default `max_concurrency=1`: Ray runs one caller's calls to
such an actor in submission order, which is what keeps `begin` / `receive_bucket`... / `finish` in step with the
broadcasts.
"""

from __future__ import annotations

import contextlib
import logging
import time
from typing import Any, Iterable, Iterator, Sequence

import torch
from torch import nn

from openppo.errors import UserError
from openppo.rollout.buckets import DEFAULT_BUCKET_BYTES, iter_buckets, layer_key
from openppo.rollout.sync_group import SyncGroup, create_sync_group, free_port

logger = logging.getLogger(__name__)

_PEFT_PREFIX = "base_model.model."


# -- full weights out of the training model --------------------------------------------------------------------------


def unwrap_model(model: nn.Module) -> nn.Module:
    """The HF model (or PEFT model) inside DeepSpeed's engine (`.module`) and our `Actor` (`.model`)."""
    from transformers import PreTrainedModel

    while not isinstance(model, PreTrainedModel) and not _is_peft(model):
        inner = getattr(model, "module", None)
        if not isinstance(inner, nn.Module):
            inner = getattr(model, "model", None)
        if not isinstance(inner, nn.Module):
            break
        model = inner
    return model


def _is_peft(model: nn.Module) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "base_model")


def _is_zero3(param: torch.Tensor) -> bool:
    return hasattr(param, "ds_id")


def _is_tensor_parallel(param: torch.Tensor) -> bool:
    """A weight DeepSpeed AutoTP split over the ranks of a tensor-parallel group (--ds_tensor_parallel_size)."""
    return getattr(param, "ds_is_replaced_module", False)


def _gathered(model: nn.Module, group: list[tuple[str, nn.Parameter]]) -> tuple[contextlib.AbstractContextManager,
                                                                                 bool]:
    """A context in which the group's parameters are whole (a collective every rank enters), and whether entering
    it gathers anything (the tensors then live only inside the context)."""
    params = [p for _, p in group]
    if any(_is_zero3(p) for p in params):
        import deepspeed

        return deepspeed.zero.GatheredParameters(params, modifier_rank=None), True
    owners = list(dict.fromkeys(name.rpartition(".")[0] for name, p in group if _is_tensor_parallel(p)))
    if not owners:
        return contextlib.nullcontext(), False
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    stack = contextlib.ExitStack()
    for owner in owners:  # AutoTP gathers one replaced layer at a time, its weight and bias together
        module = model.get_submodule(owner)
        stack.enter_context(GatherReplacedLayerParams(list(module.parameters(recurse=False)), module))
    return stack, True


def _default_rank() -> int:
    import torch.distributed as dist

    return dist.get_rank() if dist.is_available() and dist.is_initialized() else 0


def _layer_groups(model: nn.Module) -> Iterator[list[tuple[str, nn.Parameter]]]:
    """Consecutive parameters of one layer (`...layers.N.`), or of the same non-layer stretch, as lists."""
    group: list[tuple[str, nn.Parameter]] = []
    key = None
    for name, param in model.named_parameters():  # tied parameters once, as in an HF checkpoint
        k = layer_key(name)
        if group and k != key:
            yield group
            group = []
        key = k
        group.append((name, param))
    if group:
        yield group


def _hf_name(name: str, peft: bool) -> str | None:
    """The checkpoint name of a parameter, or None for a LoRA tensor / the frozen copy of a saved module."""
    if not peft:
        return name
    if ".lora_" in name or ".original_module." in name:
        return None
    name = name.removeprefix(_PEFT_PREFIX).replace(".base_layer.", ".")
    if ".modules_to_save." in name:  # "x.modules_to_save.<adapter>.weight" -> "x.weight"
        head, _, tail = name.partition(".modules_to_save.")
        name = head + "." + tail.partition(".")[2]
    return name


def _merged_lora_weight(model: nn.Module, name: str, base: torch.Tensor) -> torch.Tensor:
    """`base` + sum of the active, unmerged adapters' B @ A * scaling for the LoRA layer owning `name`."""
    if not name.endswith(".base_layer.weight"):
        return base
    layer = model.get_submodule(name.removesuffix(".base_layer.weight"))
    if getattr(layer, "disable_adapters", False):
        return base
    merged = None
    for adapter in layer.active_adapters:
        if adapter not in getattr(layer, "scaling", {}) or adapter in layer.merged_adapters:
            continue
        if getattr(layer, "use_dora", {}).get(adapter, False):
            raise UserError("weight sync to vLLM cannot merge DoRA adapters: train with plain LoRA "
                            "(--lora_rank without DoRA) or without adapters")
        delta = layer.get_delta_weight(adapter).to(torch.float32)
        merged = (base.to(torch.float32) if merged is None else merged) + delta
    return base if merged is None else merged.to(base.dtype)


def iter_full_weights(model: nn.Module, *, rank: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every parameter of `model`, layer by layer, on rank 0 only.

    `model` may be an HF model, our `Actor`, a DeepSpeed engine around either, and/or a PEFT model. Under ZeRO-3
    each layer's parameters are gathered with `deepspeed.zero.GatheredParameters`, under AutoTP with
    `GatherReplacedLayerParams` -- collectives, so EVERY trainer rank must iterate this generator to the end (ranks
    other than 0 get nothing). LoRA adapters are
    merged into the yielded weights (W + B @ A * scaling, computed in fp32, cast to W's dtype) and the names are
    the base model's checkpoint names (no `base_model.model.` prefix, no `lora_` tensors). Tied parameters come
    once, as in a checkpoint; buffers are not sent. Yielded tensors are detached and owned by the caller when
    gathered (clones), else views of the live parameters: consume them before the next optimizer step.
    """
    rank = _default_rank() if rank is None else rank
    hf = unwrap_model(model)
    peft = _is_peft(hf)
    for group in _layer_groups(hf):
        gather, gathers = _gathered(hf, group)
        with gather, torch.no_grad():
            if rank != 0:
                continue
            for name, param in group:
                hf_name = _hf_name(name, peft)
                if hf_name is None:
                    continue
                tensor = _merged_lora_weight(hf, name, param.detach()) if peft else param.detach()
                # A gathered parameter is released when the context exits: hand out a copy.
                yield hf_name, (tensor.clone() if gathers and tensor.data_ptr() == param.data_ptr() else tensor)


def tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """float64 sum of all tensors (compare with `VLLMEngine.last_sync_checksum`)."""
    return float(sum(t.detach().to(torch.float64).sum().item() for _, t in named_tensors))


# -- sending ---------------------------------------------------------------------------------------------------------


def connect_engines(engines: Sequence[Any], *, backend: str = "gloo", master_addr: str | None = None,
                    master_port: int | None = None, tensor_parallel_size: int = 1,
                    timeout_s: float = 600.0) -> SyncGroup:
    """Create the sync group between this process (rank 0, the sender) and every worker of `engines`.

    `engines` are Ray actor handles of `VLLMEngine`; engine i's workers take ranks 1 + i*tp ... Call on trainer
    rank 0 only. `master_addr` defaults to this node's IP as Ray sees it, `master_port` to a free port.
    """
    import ray

    if master_addr is None:
        master_addr = ray.util.get_node_ip_address()
    if master_port is None:
        master_port = free_port(master_addr)
    world_size = 1 + len(engines) * tensor_parallel_size
    refs = [engine.init_sync_group.remote(master_addr, master_port, 1 + i * tensor_parallel_size, world_size,
                                          backend, timeout_s)
            for i, engine in enumerate(engines)]
    group = create_sync_group(backend, master_addr, master_port, 0, world_size, timeout_s)
    ray.get(refs, timeout=timeout_s)
    return group


def _raise_failed(refs: list) -> list:
    """Raise now if an engine call already failed (instead of waiting out a broadcast timeout); return the rest."""
    import ray

    ready, unfinished = ray.wait(refs, num_returns=len(refs), timeout=0)
    ray.get(ready)
    return unfinished


LOCAL_BUCKETS_IN_FLIGHT = 2  # buckets handed over on the device at once: bounds the shared memory / GPU copies
_SHARED_SLOTS = None  # this process's reused shared-memory files (transport.SharedSlots), made on first use


def shared_slots():
    """The sender's shared-memory slots, unlinked when the process exits."""
    global _SHARED_SLOTS
    if _SHARED_SLOTS is None:
        import atexit

        from openppo.rollout.transport import SharedSlots

        _SHARED_SLOTS = SharedSlots()
        atexit.register(_SHARED_SLOTS.release)
    return _SHARED_SLOTS


def broadcast_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], group: SyncGroup | None,
                      engines: Sequence[Any], bucket_bytes: int = DEFAULT_BUCKET_BYTES, *,
                      dtype: torch.dtype | None = None, timeout_s: float = 600.0,
                      transports: Sequence[str] | None = None, verify: bool = False) -> dict[str, float]:
    """Send `named_tensors` to every engine as buckets, on trainer rank 0; returns sync statistics.

    `transports[i]` says how engine i gets each bucket (`transport.py`): "broadcast" over `group` (gloo: a CPU
    buffer; nccl: a buffer on this GPU), "shm" (a shared-memory file on this node), "cuda_ipc" (a handle of the
    bucket on this GPU), or "object_store" (Ray's object store, no collective; slower, simplest). Default: all
    "broadcast" with a group, all "object_store" without. All buckets of one call form one engine-side reload,
    applied together. `dtype` casts floating tensors first (pass the engine's dtype). `verify` makes the engines
    sum what they receive (`last_sync_checksum`). Waits at most `timeout_s` for the engines to finish.
    """
    import collections

    import ray

    from openppo.rollout import transport as tr

    transports = list(transports or [tr.BROADCAST if group is not None else tr.OBJECT_STORE] * len(engines))
    assert len(transports) == len(engines), "one transport per engine"
    by = {t: [e for e, kind in zip(engines, transports) if kind == t] for t in set(transports)}
    if by.get(tr.BROADCAST):
        assert group is not None, "broadcast engines need a sync group"
    start = time.perf_counter()
    device = (torch.device("cuda", torch.cuda.current_device()) if by.get(tr.CUDA_IPC)
              else group.device if group is not None and by.get(tr.BROADCAST) else torch.device("cpu"))
    pending = [engine.begin_weight_update.remote(verify) for engine in engines]
    in_flight: collections.deque = collections.deque()  # (refs of a handed-over bucket, its buffer kept alive)
    num_buckets = num_bytes = num_tensors = 0

    failed = True
    try:
        for bucket in iter_buckets(named_tensors, bucket_bytes, dtype=dtype, device=device):
            local = []
            while len(in_flight) >= LOCAL_BUCKETS_IN_FLIGHT:  # its slot is about to be rewritten
                ray.get(in_flight.popleft()[0], timeout=timeout_s)
            if by.get(tr.SHARED_MEMORY):
                path = shared_slots().write(num_buckets % LOCAL_BUCKETS_IN_FLIGHT, bucket.buffer)
                local += [e.load_bucket_from_shared_memory.remote(bucket.meta, path) for e in by[tr.SHARED_MEMORY]]
            if by.get(tr.CUDA_IPC):
                handle = tr.ipc_handle(bucket.buffer)
                local += [e.load_bucket_from_ipc.remote(bucket.meta, handle) for e in by[tr.CUDA_IPC]]
            if local:
                in_flight.append((local, bucket.buffer))  # the buffer stays alive until they copied it
            if by.get(tr.OBJECT_STORE):
                ref = ray.put(bucket.buffer.cpu())
                pending += [e.load_bucket.remote(bucket.meta, ref) for e in by[tr.OBJECT_STORE]]
            if by.get(tr.BROADCAST):
                pending += [e.receive_bucket.remote(bucket.meta) for e in by[tr.BROADCAST]]
                group.broadcast(bucket.buffer.to(group.device), src=0)
            pending = _raise_failed(pending)
            num_buckets += 1
            num_bytes += bucket.meta.nbytes
            num_tensors += len(bucket.meta.tensors)
        while in_flight:
            ray.get(in_flight.popleft()[0], timeout=timeout_s)
        failed = False
    finally:
        if failed and _SHARED_SLOTS is not None:  # a failed sync leaves no shared-memory file behind
            _SHARED_SLOTS.release()
    finish = [engine.finish_weight_update.remote() for engine in engines]
    ray.get(pending + finish, timeout=timeout_s)
    seconds = time.perf_counter() - start
    logger.info("weight sync: %d tensors, %.1f MiB in %d bucket(s) to %d engine(s) in %.2f s", num_tensors,
                num_bytes / 2**20, num_buckets, len(engines), seconds)
    return {"num_buckets": num_buckets, "num_bytes": num_bytes, "num_tensors": num_tensors, "seconds": seconds}


def sync_weights(model: nn.Module, group: SyncGroup | None, engines: Sequence[Any],
                 bucket_bytes: int = DEFAULT_BUCKET_BYTES, *, dtype: torch.dtype | None = None,
                 timeout_s: float = 600.0, rank: int | None = None, transports: Sequence[str] | None = None,
                 verify: bool = False) -> dict[str, float] | None:
    """One full sync; EVERY trainer rank calls this (ZeRO-3 gathers are collectives). Rank 0 returns the stats."""
    rank = _default_rank() if rank is None else rank
    named = iter_full_weights(model, rank=rank)
    if rank == 0:
        return broadcast_weights(named, group, engines, bucket_bytes, dtype=dtype, timeout_s=timeout_s,
                                 transports=transports, verify=verify)
    for _ in named:  # enter every gather the sender enters
        pass
    return None

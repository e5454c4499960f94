"""Trainer side of the weight sync: full HF-named weights out of the training model, bucketed to the engines.

`TrainerTransfer` has the shape of vLLM's `TrainerWeightTransferEngine` (`trainer_init`, then `send_weights` per
sync) and drives openppo's backend of vLLM's weight-transfer interface (`weight_transfer.py`). One sync, as every
trainer rank runs it (`sync_weights`):

    for each layer:   gather its parameters (ZeRO-3: a collective every rank enters)
                      rank 0 and the exporting ranks: merge LoRA adapters, yield (hf_name, full tensor)
    rank 0:           pack the stream into buckets of <= bucket_bytes; per bucket, ask every engine to load it
                      (Ray calls, return at once) and broadcast it over the sync group; finally wait for all.

An engine on an actor rank's own device (the hybrid engine) is not in the broadcast group: the rank on each of its
workers' devices exports its own copy of each bucket (`transport.py`: shared memory on CPU, CUDA IPC on GPU),
rank 0 gathers the handles (`HandleExchange`) and passes them on in its Ray call. Every rank holds the full
weights while they are iterated (gathered under ZeRO-3 and AutoTP, replicated under ZeRO-0/1/2), so in the hybrid
engine every rank feeds its own engine worker, and no collective spans a trainer rank and an engine.

Departures from OpenRLHF's `broadcast_to_vllm` (one gather + one RPC + one broadcast per parameter): parameters are
gathered a layer at a time and sent a bucket at a time (a few hundred MiB per message instead of thousands of
small ones), LoRA adapters are merged into the base weights on the fly (the engine never sees adapters), and the
tensors may be cast to the engine's dtype before sending.

Engines are Ray actor handles of `VLLMEngine` with the default `max_concurrency=1`: Ray runs one caller's calls to
such an actor in submission order, which is what keeps `start_weight_update` / `update_weights`... /
`finish_weight_update` in step with the broadcasts. Rank 0 is that one caller for every engine, also for the buckets
other ranks export.
"""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
from torch import nn

from openppo.distributed.rendezvous import serve_store
from openppo.errors import UserError
from openppo.models.hf import FROZEN_PARAMETERS
from openppo.rollout import transport as tr
from openppo.rollout.buckets import DEFAULT_BUCKET_BYTES, iter_buckets, layer_key
from openppo.rollout.delta import DeltaEncoder
from openppo.rollout.sync_group import SyncGroup, create_sync_group
from openppo.rollout.transport import SyncPlan
from openppo.rollout.weight_transfer import BucketUpdate, GroupInit, plain

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


def _gathered(
    model: nn.Module, group: list[tuple[str, nn.Parameter]]
) -> tuple[contextlib.AbstractContextManager, bool]:
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
            raise UserError(
                "weight sync to vLLM cannot merge DoRA adapters: train with plain LoRA "
                "(--lora_rank without DoRA) or without adapters"
            )
        delta = layer.get_delta_weight(adapter).to(torch.float32)
        merged = (base.to(torch.float32) if merged is None else merged) + delta
    return base if merged is None else merged.to(base.dtype)


def iter_full_weights(
    model: nn.Module, *, rank: int | None = None, emit: bool | None = None, frozen: bool = False
) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (hf_name, full tensor) for every parameter of `model`, layer by layer, where `emit` (default: on rank 0).

    `model` may be an HF model, our `Actor`, a DeepSpeed engine around either, and/or a PEFT model. Under ZeRO-3
    each layer's parameters are gathered with `deepspeed.zero.GatheredParameters`, under AutoTP with
    `GatherReplacedLayerParams` -- collectives, so EVERY trainer rank must iterate this generator to the end (ranks
    that do not emit get nothing). LoRA adapters are
    merged into the yielded weights (W + B @ A * scaling, computed in fp32, cast to W's dtype) and the names are
    the base model's checkpoint names (no `base_model.model.` prefix, no `lora_` tensors). Tensors that transformers
    holds in another layout than its checkpoints (a mixture of experts' fused `experts.gate_up_proj`, saved one
    `experts.<e>.gate_proj.weight` per expert) come in the checkpoint's layout, by transformers' own
    `revert_weight_conversion`, one layer at a time: vLLM loads checkpoint tensors. Tied parameters come once, as in
    a checkpoint; buffers are not sent, nor (unless `frozen`) is a vision tower frozen by `freeze_visual_encoder` (the
    engines loaded it from the same checkpoint, and nothing changes it). Yielded tensors are detached and owned by
    the caller when gathered (clones), else views of the live parameters: consume them before the next optimizer
    step.
    """
    rank = _default_rank() if rank is None else rank
    emit = rank == 0 if emit is None else emit
    hf = unwrap_model(model)
    peft = _is_peft(hf)
    base = hf.get_base_model() if peft else hf
    converts = _has_weight_conversions(base)
    # a frozen vision tower: the engines hold it already (a check of their weights still compares it)
    left_out = frozenset() if frozen else getattr(base, FROZEN_PARAMETERS, frozenset())
    for group in _layer_groups(hf):
        gather, gathers = _gathered(hf, group)
        with gather, torch.no_grad():
            if not emit:
                continue
            layer = {}
            for name, param in group:
                hf_name = _hf_name(name, peft)
                if hf_name is None or hf_name in left_out:
                    continue
                tensor = _merged_lora_weight(hf, name, param.detach()) if peft else param.detach()
                # A gathered parameter is released when the context exits: hand out a copy.
                layer[hf_name] = tensor.clone() if gathers and tensor.data_ptr() == param.data_ptr() else tensor
            if converts:
                from transformers.core_model_loading import revert_weight_conversion

                layer = revert_weight_conversion(base, layer)
            yield from layer.items()


def _has_weight_conversions(model: nn.Module) -> bool:
    """Whether transformers converted the checkpoint's tensors on load (so a sync must convert them back)."""
    conversions = getattr(model, "_weight_conversions", None)
    if conversions is None:  # not loaded by from_pretrained: transformers' built-in mapping for the architecture
        from transformers.conversion_mapping import get_model_conversion_mapping

        conversions = get_model_conversion_mapping(model, add_legacy=False)
    return any(type(c).__name__ == "WeightConverter" for c in conversions)


def tensors_checksum(named_tensors: Iterable[tuple[str, torch.Tensor]]) -> float:
    """float64 sum of all tensors (compare with `VLLMEngine.last_sync_checksum`)."""
    return float(sum(t.detach().to(torch.float64).sum().item() for _, t in named_tensors))


# -- sending ---------------------------------------------------------------------------------------------------------


def connect_engines(
    engines: Sequence[Any],
    *,
    backend: str = "gloo",
    master_addr: str | None = None,
    master_port: int | None = None,
    tensor_parallel_size: int = 1,
    timeout_s: float = 600.0,
) -> SyncGroup:
    """Create the sync group between this process (rank 0, the sender) and every worker of `engines`, through each
    engine's `init_weight_transfer_engine` (`weight_transfer.GroupInit`).

    `engines` are Ray actor handles of `VLLMEngine`; engine i's workers take ranks 1 + i*tp ... Call on trainer
    rank 0 only. `master_addr` defaults to this node's IP as Ray sees it, `master_port` to one the OS picks.
    """
    import ray

    if master_addr is None:
        master_addr = ray.util.get_node_ip_address()
    world_size = 1 + len(engines) * tensor_parallel_size
    # listening before any engine hears the port, so nothing can take it in between
    store = serve_store(master_addr, master_port or 0, world_size, timeout_s)
    master_port = store.port
    refs = [
        engine.init_weight_transfer_engine.remote(
            plain(GroupInit(master_addr, master_port, 1 + i * tensor_parallel_size, world_size, backend, timeout_s))
        )
        for i, engine in enumerate(engines)
    ]
    group = create_sync_group(backend, master_addr, master_port, 0, world_size, timeout_s, store=store)
    ray.get(refs, timeout=timeout_s)
    return group


def _raise_failed(refs: list) -> list:
    """Raise now if an engine call already failed (instead of waiting out a broadcast timeout); return the rest."""
    import ray

    ready, unfinished = ray.wait(refs, num_returns=len(refs), timeout=0)
    ray.get(ready)
    return unfinished


class HandleExchange:
    """Rank 0 and the other exporting actor ranks meet once per bucket: rank 0 gets each rank's handle of it.

    Rank 0 enters bucket k's meeting only once bucket k - IN_FLIGHT is loaded everywhere, so a rank back from
    meeting k - 1 may overwrite the buffer of bucket k - IN_FLIGHT - 1 (`LocalExporter` keeps IN_FLIGHT + 1). A gloo
    group: the handles are a few hundred bytes of metadata, and gloo works beside a CUDA trainer's NCCL group."""

    def __init__(self, ranks: Sequence[int], timeout_s: float):
        """Every actor rank calls this, members or not (making a process group is a collective)."""
        import torch.distributed as dist

        self.ranks = list(ranks)
        # twice the sync's timeout: rank 0 waits up to timeout_s for the engines before it meets the others, so
        # a slow engine surfaces on rank 0 as the engine's error rather than here as a timeout
        self._group = dist.new_group(self.ranks, backend="gloo", timeout=timedelta(seconds=2 * timeout_s))

    def gather(self, handle: Any) -> dict[int, Any]:
        """{actor rank: its handle} for one bucket (every member calls this, in the same order)."""
        import torch.distributed as dist

        handles: list[Any] = [None] * len(self.ranks)
        dist.all_gather_object(handles, handle, group=self._group)
        return dict(zip(self.ranks, handles))

    def barrier(self) -> None:
        """After the last bucket: rank 0 has seen every engine load everything."""
        import torch.distributed as dist

        dist.barrier(group=self._group)

    def destroy(self) -> None:
        """Leave the group (every actor rank calls this, members or not): connecting anew after an engine was
        replaced makes a new exchange, and each left behind would keep its sockets and threads."""
        import torch.distributed as dist

        group, self._group = self._group, None
        if group is not None and group is not dist.GroupMember.NON_GROUP_MEMBER:
            dist.destroy_process_group(group)


@dataclass
class TrainerInit:
    """`TrainerTransfer.trainer_init`'s info, as vLLM's `TrainerInitInfo`: `rank` is this trainer process's rank,
    given explicitly (rank 0 sends and drives the engines; the others enter the gathers, and export their copy of
    each bucket when `plan` says they hand over to an engine worker on their device)."""

    rank: int
    plan: SyncPlan
    group_backend: str = "gloo"  # the broadcast group's: gloo, or nccl on GPUs
    tensor_parallel_size: int = 1  # workers per engine
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    dtype: torch.dtype | None = None  # cast floating tensors to the engines' dtype before sending
    timeout_s: float = 600.0
    master_address: str | None = None  # the broadcast group's rendezvous (default: this node, a free port)
    master_port: int | None = None
    delta: bool = False  # after the first sync, send only the changed elements (`delta.py`)


class TrainerTransfer:
    """The trainer's half of openppo's weight transfer, in the shape of vLLM's `TrainerWeightTransferEngine`:
    `trainer_init` once on every trainer rank (rank 0 joins the broadcast engines' sync group), then `send_weights`
    for every sync, on every rank (ZeRO-3 and AutoTP gathers are collectives).

    `client` is the run's engines (Ray actor handles of `VLLMEngine`, whose weight-sync methods carry vLLM's names);
    `source` the weights: a model (`iter_full_weights` on each call) or a re-iterable of (name, tensor) pairs, which
    only rank 0 sends. Engine i gets its buckets as `plan.transports[i]` says (`transport.py`)."""

    def __init__(self, init_info: TrainerInit, client: Sequence[Any], source: Any, group, exchange):
        self.init_info, self.engines, self.source = init_info, list(client), source
        self.group: SyncGroup | None = group
        self.exchange: HandleExchange | None = exchange
        # the last sync's weights, on the ranks that pack buckets (rank 0 and the exporting ranks)
        self.encoder = DeltaEncoder(init_info.dtype) if init_info.delta else None
        self._receiving = False

    @classmethod
    def trainer_init(cls, init_info: TrainerInit, *, client: Sequence[Any], source: Any) -> TrainerTransfer:
        i = init_info
        assert len(i.plan.transports) == len(client), "one transport per engine"
        exchange = HandleExchange(i.plan.exchange_ranks, i.timeout_s) if i.plan.exchange_ranks else None
        broadcast = [e for e, t in zip(client, i.plan.transports) if t == tr.BROADCAST]
        group = None
        if i.rank == 0 and broadcast:
            group = connect_engines(
                broadcast,
                backend=i.group_backend,
                master_addr=i.master_address,
                master_port=i.master_port,
                tensor_parallel_size=i.tensor_parallel_size,
                timeout_s=i.timeout_s,
            )
        return cls(init_info, client, source, group, exchange)

    def send_weights(self, *, version: int | None = None, verify: bool = False) -> dict[str, float] | None:
        """One full sync (see `sync_weights`); rank 0 returns its statistics, the other ranks None. `version` tags
        the tokens the engines sample from then on; `verify` makes them sum what they receive
        (`last_sync_checksum`). A sync that fails makes the next one full on this rank (`DeltaEncoder.forget`).

        One that fails in a broadcast also closes the broadcast group (rank 0): the engines waiting in its receive
        (for the bucket the sender never sent them, having failed on a dead member first) then fail at once, where
        they would wait out the group's timeout (--dist_timeout) holding their actors, which the driver next asks
        whether they are alive and then connects anew (`ActorWorker.connect_engines` makes the next group)."""
        self._receiving = False  # engines were told to receive a bucket whose broadcast has not completed
        try:
            return self._send(version, verify)
        except BaseException:
            if self.encoder is not None:
                self.encoder.forget()
            if self._receiving:
                self._leave_group()
            raise

    def _send(self, version: int | None, verify: bool) -> dict[str, float] | None:
        import collections

        import ray

        init = self.init_info
        rank, plan, group, engines, exchange = init.rank, init.plan, self.group, self.engines, self.exchange
        bucket_bytes, dtype, timeout_s, weights = init.bucket_bytes, init.dtype, init.timeout_s, self.source
        exports = rank != 0 and rank in plan.exporters
        named = (
            iter_full_weights(weights, rank=rank, emit=rank == 0 or exports)
            if isinstance(weights, nn.Module)
            else weights
        )
        encoder = self.encoder if rank == 0 or exports else None
        if encoder is not None:
            named = encoder.encode(named)
        if exports:
            assert exchange is not None, (
                "an exporting rank other than 0 hands its handles to rank 0 through an exchange"
            )
            export_weights(named, plan.local_kind, exchange, bucket_bytes, dtype=dtype)
            return None
        if rank != 0:
            for _ in named:  # enter every gather the sender enters
                pass
            return None

        assert len(plan.transports) == len(engines), "one transport per engine"
        assert exchange is not None or not plan.exchange_ranks, "handles of other ranks come through an exchange"
        local = [i for i, t in enumerate(plan.transports) if t in tr.LOCAL]
        broadcast = [e for e, t in zip(engines, plan.transports) if t == tr.BROADCAST]
        stored = [e for e, t in zip(engines, plan.transports) if t == tr.OBJECT_STORE]
        assert group is not None or not broadcast, "broadcast engines need a sync group"
        start = time.perf_counter()
        exporter = tr.LocalExporter(plan.local_kind) if 0 in plan.exporters else None
        device = (
            exporter.device
            if exporter is not None
            else group.device
            if group is not None and broadcast
            else torch.device("cpu")
        )
        delta = encoder is not None
        pending = [engine.start_weight_update.remote() for engine in engines]
        in_flight: collections.deque = collections.deque()  # per handed-over bucket, the engines' load calls
        num_buckets = num_bytes = num_tensors = 0

        failed = True
        buckets = iter_buckets(named, bucket_bytes, dtype=dtype, device=device)
        meets = bool(local and plan.exchange_ranks)  # rank 0 meets the other exporting ranks once per bucket
        owed = False  # a bucket was drawn whose meeting rank 0 has not entered yet
        try:
            for bucket in buckets:
                owed = meets
                meta = bucket.meta.to_plain()
                if local:
                    while len(in_flight) >= tr.IN_FLIGHT:  # bounds the buffers the exporting ranks keep valid
                        ray.get(in_flight.popleft(), timeout=timeout_s)
                    handle = exporter.export(num_buckets, bucket.buffer) if exporter is not None else None
                    handles = exchange.gather(handle) if plan.exchange_ranks else {0: handle}
                    owed = False
                    in_flight.append(
                        [
                            engines[i].update_weights.remote(
                                plain(
                                    BucketUpdate(
                                        "local", meta, [handles[r] for r in plan.sources[i]], verify=verify, delta=delta
                                    )
                                )
                            )
                            for i in local
                        ]
                    )
                if stored:
                    ref = ray.put(bucket.buffer.cpu())
                    update = plain(BucketUpdate("bytes", meta, verify=verify, delta=delta))
                    pending += [e.update_weights.remote(update, ref) for e in stored]
                if broadcast:
                    update = plain(BucketUpdate("broadcast", meta, verify=verify, delta=delta))
                    self._receiving = True
                    pending += [e.update_weights.remote(update) for e in broadcast]
                    group.broadcast(bucket.buffer.to(group.device), src=0)
                    self._receiving = False
                pending = _raise_failed(pending)
                _raise_failed([ref for refs in in_flight for ref in refs])  # a failed hand-over stops us now too
                num_buckets += 1
                num_bytes += bucket.meta.nbytes
                num_tensors += len(bucket.meta.tensors)
            while in_flight:
                ray.get(in_flight.popleft(), timeout=timeout_s)
            failed = False
        except Exception:
            # An engine failed (it died, say): the other actor ranks still gather every layer (ZeRO-3) and meet
            # rank 0 once per bucket; go through the rest with them, sending nothing, so that the failure reaches
            # the driver instead of leaving those ranks in a collective
            if owed:
                exchange.gather(None)
            for _ in buckets:
                if meets:
                    exchange.gather(None)
            if plan.exchange_ranks:
                exchange.barrier()
            raise
        finally:
            if exporter is not None:  # a failed sync leaves no shared memory behind
                exporter.close(failed)
        if plan.exchange_ranks:
            exchange.barrier()  # the other exporting ranks may let their buffers go
        finish = [engine.finish_weight_update.remote(version) for engine in engines]
        ray.get(pending + finish, timeout=timeout_s)
        seconds = time.perf_counter() - start
        stats = {"num_buckets": num_buckets, "num_bytes": num_bytes, "num_tensors": num_tensors, "seconds": seconds}
        note = ""
        if encoder is not None:
            d = encoder.stats
            stats.update(
                num_tensors=len(encoder.last),
                num_elements=d.elements,
                full_bytes=d.full_bytes,
                changed=d.sent / max(d.elements, 1),
            )
            note = f" (delta: {stats['changed']:.2%} of the elements; a full sync is {d.full_bytes / 2**20:.1f} MiB)"
        logger.info(
            "weight sync: %d tensors, %.1f MiB in %d bucket(s) to %d engine(s) in %.2f s%s",
            stats["num_tensors"],
            num_bytes / 2**20,
            num_buckets,
            len(engines),
            seconds,
            note,
        )
        return stats

    def _leave_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.destroy()

    def shutdown(self) -> None:
        """Leave the sync group (rank 0) and the handle exchange (every rank); the engines keep their weights."""
        self._leave_group()
        exchange, self.exchange = self.exchange, None
        if exchange is not None:
            exchange.destroy()


def _as_plan(plan: SyncPlan | Sequence[str] | None, group: SyncGroup | None, num_engines: int) -> SyncPlan:
    """Default: every engine by broadcast with a group, through Ray's object store without."""
    if isinstance(plan, SyncPlan):
        return plan
    return SyncPlan.of(plan or [tr.BROADCAST if group is not None else tr.OBJECT_STORE] * num_engines)


def export_weights(
    named_tensors: Iterable[tuple[str, torch.Tensor]],
    kind: str,
    exchange: HandleExchange,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
) -> None:
    """An exporting rank other than 0: the same buckets as rank 0's, each exported for the engine worker(s) on this
    rank's device and its handle given to rank 0 (`kind`: "shm" or "cuda_ipc")."""
    exporter = tr.LocalExporter(kind)
    failed = True
    try:
        for index, bucket in enumerate(iter_buckets(named_tensors, bucket_bytes, dtype=dtype, device=exporter.device)):
            exchange.gather(exporter.export(index, bucket.buffer))
        exchange.barrier()
        failed = False
    finally:
        exporter.close(failed)


def sync_weights(
    weights: nn.Module | Iterable[tuple[str, torch.Tensor]],
    group: SyncGroup | None,
    engines: Sequence[Any],
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
    *,
    dtype: torch.dtype | None = None,
    timeout_s: float = 600.0,
    rank: int | None = None,
    plan: SyncPlan | Sequence[str] | None = None,
    exchange: HandleExchange | None = None,
    verify: bool = False,
    version: int | None = None,
) -> dict[str, float] | None:
    """One full sync of `weights` to every engine (what `TrainerTransfer.send_weights` runs); rank 0 returns the sync
    statistics, the other ranks None (a `TrainerTransfer` without `trainer_init`: the caller made the group).

    `weights` is a model, whose full weights every trainer rank gathers (`iter_full_weights`: ZeRO-3 and AutoTP
    gathers are collectives, so EVERY rank calls this), or (name, tensor) pairs, which only rank 0 sends (`rank`
    defaults to the process's rank). Rank 0 packs them into buckets and hands each to every engine; the other ranks
    in `plan.exporters` export their copy of each bucket through `exchange` (`export_weights`); the rest only enter
    the gathers.

    `plan` says how engine i gets each bucket (`transport.py`; a list of transports means rank 0 hands over to
    every local engine itself): "broadcast" over `group` (gloo: a CPU buffer; nccl: a buffer on this GPU), "shm" /
    "cuda_ipc" (handed over on the device by the actor ranks in `plan.sources[i]`: rank 0 itself, the others
    through `exchange`), or "object_store" (Ray's object store, no collective; slower, simplest). Default: all
    "broadcast" with a group, all "object_store" without. All buckets of one call form one engine-side reload,
    applied together. `dtype` casts floating tensors first (pass the engine's dtype). `verify` makes the engines
    sum what they receive (`last_sync_checksum`). `version` tags the tokens the engines sample from then on.
    Waits at most `timeout_s` for the engines to finish.

    Each engine gets `start_weight_update`, one `update_weights` per bucket (`weight_transfer.BucketUpdate`) and
    `finish_weight_update`, in that order (one caller of a `max_concurrency=1` actor: Ray keeps the order).
    """
    rank = _default_rank() if rank is None else rank
    init = TrainerInit(
        rank, _as_plan(plan, group, len(engines)), bucket_bytes=bucket_bytes, dtype=dtype, timeout_s=timeout_s
    )
    return TrainerTransfer(init, engines, weights, group, exchange).send_weights(version=version, verify=verify)

"""How a weight bucket gets from the trainer to an engine: by broadcast, or handed over on the device.

The sync group (`sync_group.py`) broadcasts each bucket from actor rank 0 to every engine worker in one collective.
That is wrong for an engine worker on a trainer rank's own device: NCCL refuses two ranks of one GPU in a group,
which is exactly the hybrid engine's placement (--colocate_all_models puts worker w of engine i on the device of
actor rank i*tp + w). Such a worker gets each bucket handed over by the actor rank on its device instead, with the
same bucketing, order and reload window (`sender.py` runs the exchange):

* GPU: a CUDA IPC handle of that rank's bucket tensor (`reduce_tensor`), tagged with the GPU's UUID. The worker
  checks the UUID, opens the handle on its own index of that GPU (Ray gives every process its own
  CUDA_VISIBLE_DEVICES, so one GPU can have different indices in the two processes) and copies the bucket.
* CPU: an anonymous shared-memory file (memfd) of that rank, opened by the worker as /proc/<pid>/fd/<fd>: one copy
  on each side, no collective, no socket, and nothing left in /dev/shm when a process is killed.

The two differ only in how a buffer is exported and opened (`LocalExporter`, `open_local`), so the CPU runs test
the rest of the GPU path: which rank hands over to which worker, the handle exchange, the in-flight bound.

Every handle is plain data (a short list of strings, ints and bytes): it crosses vLLM's msgpack RPC into the engine
core and its workers as it is (`weight_transfer.py` has the messages, `worker_extension.py` the receiving side).

`choose_transports` decides per engine worker from where the processes run; `check_broadcast_group` refuses a
group that would still put two members on one GPU.
"""

from __future__ import annotations

import collections
import os
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from openppo.errors import UserError
from openppo.rollout.buckets import dtype_from_name, dtype_name

BROADCAST, SHARED_MEMORY, CUDA_IPC, OBJECT_STORE = "broadcast", "shm", "cuda_ipc", "object_store"
LOCAL = (SHARED_MEMORY, CUDA_IPC)  # the hand-overs on one device
IN_FLIGHT = 2  # buckets handed over and not yet loaded, at most: bounds the shared memory / GPU copies


@dataclass(frozen=True)
class Where:
    """Where a process runs: its node and the GPUs Ray gave it (none on CPU)."""

    node: str
    gpus: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: dict[str, Any]) -> Where:
        """From an `actor_location()` dict (or an entry of `VLLMEngine.worker_locations`): the node is Ray's node id
        where known (several nodes may share an IP address on one machine), else the IP."""
        return cls(str(info.get("node_id") or info["node_ip"]), tuple(str(g) for g in info.get("gpu_ids") or ()))

    def describe(self) -> str:
        node = f"node {self.node[:8]}"
        return f"GPU {','.join(self.gpus)} of {node}" if self.gpus else node

    def shares_device(self, other: Where, on_gpu: bool) -> bool:
        if self.node != other.node:
            return False
        return bool(set(self.gpus) & set(other.gpus)) if on_gpu else True


@dataclass(frozen=True)
class SyncPlan:
    """How a sync reaches each engine: `transports[i]`, and for an engine that is handed its buckets the actor rank
    that hands them to each of its workers (`sources[i][w]`; () for the other engines)."""

    transports: tuple[str, ...]
    sources: tuple[tuple[int, ...], ...]

    @classmethod
    def of(cls, transports: Sequence[str]) -> SyncPlan:
        """Rank 0 hands the buckets to every worker of a handed-over engine (one trainer process, as in tests)."""
        return cls(tuple(transports), tuple((0,) if t in LOCAL else () for t in transports))

    @property
    def local_kind(self) -> str | None:
        """The hand-over transport of this plan (SHARED_MEMORY or CUDA_IPC), None when every engine is broadcast to."""
        kinds = {t for t in self.transports if t in LOCAL}
        assert len(kinds) <= 1, f"one hand-over transport per sync, got {sorted(kinds)}"
        return next(iter(kinds), None)

    @property
    def exporters(self) -> tuple[int, ...]:
        """The actor ranks that export buckets for the engines, ascending."""
        return tuple(sorted({r for ranks in self.sources for r in ranks}))

    @property
    def exchange_ranks(self) -> tuple[int, ...]:
        """Rank 0 (the only rank that calls the engines) and the other exporters, whose handles it gathers every
        bucket; () when rank 0 exports alone or nothing is handed over."""
        others = [r for r in self.exporters if r != 0]
        return (0, *others) if others else ()


def choose_transports(
    ranks: Sequence[Where],
    engines: Sequence[Sequence[Where]],
    *,
    colocated: bool,
    on_gpu: bool,
    remote: str = BROADCAST,
) -> SyncPlan:
    """The transport of each engine, from where actor rank r (`ranks[r]`) and worker w of engine i (`engines[i][w]`)
    run. Only the hybrid engine (`colocated`) is handed its buckets: each worker by an actor rank on its device (GPU:
    the same GPU; CPU: the same node), the g-th worker over all engines by rank g when it qualifies (the rank whose
    bundle it shares), else by the first rank that does. An engine with a worker that no rank shares a device with
    gets the `remote` transport (BROADCAST, or OBJECT_STORE for --vllm_sync_with_ray), so a placement may mix
    both."""
    local = CUDA_IPC if on_gpu else SHARED_MEMORY
    transports, sources = [], []
    first = 0  # index of the engine's first worker over all engines
    for workers in engines:
        picks = [_source(ranks, where, first + w, on_gpu) for w, where in enumerate(workers)]
        first += len(workers)
        handed = colocated and bool(picks) and all(p is not None for p in picks)
        transports.append(local if handed else remote)
        sources.append(tuple(picks) if handed else ())
    return SyncPlan(tuple(transports), tuple(sources))


def _source(ranks: Sequence[Where], where: Where, preferred: int, on_gpu: bool) -> int | None:
    if preferred < len(ranks) and ranks[preferred].shares_device(where, on_gpu):
        return preferred
    return next((r for r, rank in enumerate(ranks) if rank.shares_device(where, on_gpu)), None)


def describe(plan: SyncPlan | Sequence[str], backend: str) -> str:
    """One log line: which engines get which transport, and from which actor ranks."""
    plan = plan if isinstance(plan, SyncPlan) else SyncPlan.of(plan)
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(plan.transports):
        groups.setdefault(t, []).append(i)
    names = {
        BROADCAST: f"{backend} broadcast",
        SHARED_MEMORY: "shared memory",
        CUDA_IPC: "CUDA IPC",
        OBJECT_STORE: "Ray's object store",
    }
    parts = []
    for t, idx in groups.items():
        part = f"engine(s) {','.join(map(str, idx))} via {names[t]}"
        if t in LOCAL:
            part += " from actor rank(s) " + ",".join(map(str, sorted({r for i in idx for r in plan.sources[i]})))
        parts.append(part)
    return "weight sync: " + "; ".join(parts)


def check_broadcast_group(members: Sequence[tuple[str, Where]], backend: str) -> None:
    """Refuse an NCCL group in which two members sit on one GPU (NCCL fails or hangs on that)."""
    if backend != "nccl":
        return
    seen: dict[tuple[str, str], str] = {}
    for name, where in members:
        for gpu in where.gpus:
            other = seen.setdefault((where.node, gpu), name)
            if other != name:
                raise UserError(
                    f"the nccl weight-sync group would hold {other} and {name} on GPU {gpu} of node "
                    f"{where.node}, which NCCL refuses (--vllm_sync_backend nccl): pass "
                    f"--vllm_sync_backend gloo, or put the engines on GPUs of their own, or on the "
                    f"actor's with --colocate_all_models (those get the weights by CUDA IPC, in no group)"
                )


# -- the exporting rank's side -------------------------------------------------------------------------------------


class LocalExporter:
    """One actor rank's half of the hand-over: bucket k of a sync -> a handle its colocated engine worker opens.

    The buffer behind the handle of bucket k stays valid until bucket k + IN_FLIGHT + 1 is exported: the sender
    (`sender.py`) exports bucket k only once every bucket up to k - IN_FLIGHT - 1 is loaded by the engines."""

    def __init__(self, kind: str):
        assert kind in LOCAL, f"not a hand-over transport: {kind}"
        self.kind = kind
        self.device = torch.device("cuda", torch.cuda.current_device()) if kind == CUDA_IPC else torch.device("cpu")
        self._alive: collections.deque = collections.deque(maxlen=IN_FLIGHT + 1)  # CUDA: the exported buckets

    def export(self, index: int, buffer: torch.Tensor) -> list:
        """A handle of bucket `index` of this sync (a uint8 buffer on `self.device`): a short list of plain data."""
        if self.kind == SHARED_MEMORY:
            return [SHARED_MEMORY, *shared_slots().write(index % (IN_FLIGHT + 1), buffer)]
        self._alive.append(buffer)  # an IPC handle does not keep its tensor alive
        return ipc_handle(buffer)

    def close(self, failed: bool) -> None:
        """After a sync: CUDA frees the exported buckets; shared memory keeps its slots for the next sync unless this
        one failed."""
        self._alive.clear()
        if self.kind == CUDA_IPC:
            torch.cuda.ipc_collect()
        elif failed:
            shared_slots().release()


def open_local(handle: Sequence, nbytes: int) -> torch.Tensor:
    """The engine worker's half: a copy of the first `nbytes` of the bucket behind a `LocalExporter` handle (on this
    worker's GPU for CUDA IPC). A copy, because vLLM's layer-wise reload may keep views of a bucket until its layer
    is complete while the exporter reuses the buffer (measured 0.17 nats off without it)."""
    if handle[0] == SHARED_MEMORY:
        _, path, name = handle
        return read_shared(path, nbytes, name).clone()
    _, gpu, args = handle
    return open_ipc(gpu, args)[:nbytes].clone()


# -- CPU: shared memory --------------------------------------------------------------------------------------------


class SharedSlots:
    """This process's shared-memory buffers, reused bucket after bucket and sync after sync (slot k of each sync).

    A fresh buffer per bucket pays for new zeroed pages on every write (slower than the gloo broadcast, measured in
    docs/benchmarks.md); a reused one is resident, so a bucket costs one copy on each side. The buffers are
    anonymous files (memfd) another process of this node opens as /proc/<pid>/fd/<fd>: the kernel frees one when
    the last process holding it is gone, however it ended (Ray kills its actors without running atexit, which left
    named /dev/shm files behind). A slot too small for a bucket gets a new, larger file; `release` closes them all.
    """

    def __init__(self):
        self._slots: list[tuple[str, int, torch.Tensor]] = []  # (unique name, fd, this process's mapping)

    def write(self, slot: int, buffer: torch.Tensor) -> tuple[str, str]:
        """Copy a CPU uint8 bucket into slot `slot`; returns the path another process opens and the file's name."""
        while len(self._slots) <= slot:
            self._slots.append(("", -1, torch.empty(0, dtype=torch.uint8)))
        name, fd, mapped = self._slots[slot]
        if mapped.numel() < buffer.numel():
            self._close(slot)
            name = f"openppo-sync-{uuid.uuid4().hex}"
            fd = os.memfd_create(name)  # close-on-exec: vLLM's worker processes do not inherit it
            size = max(1, buffer.numel())
            os.ftruncate(fd, size)
            mapped = torch.from_file(_fd_path(os.getpid(), fd), shared=True, size=size, dtype=torch.uint8)
            self._slots[slot] = (name, fd, mapped)
        mapped[: buffer.numel()].copy_(buffer)
        return _fd_path(os.getpid(), fd), name

    def paths(self) -> list[str]:
        return [_fd_path(os.getpid(), fd) for _, fd, _ in self._slots if fd >= 0]

    def _close(self, slot: int) -> None:
        name, fd, _ = self._slots[slot]
        self._slots[slot] = ("", -1, torch.empty(0, dtype=torch.uint8))
        if fd >= 0:
            os.close(fd)

    def release(self) -> None:
        for slot in range(len(self._slots)):
            self._close(slot)
        self._slots = []


def _fd_path(pid: int, fd: int) -> str:
    return f"/proc/{pid}/fd/{fd}"


_SLOTS: SharedSlots | None = None


def shared_slots() -> SharedSlots:
    """This process's slots (one set per process: an exporting rank, or a test acting as one)."""
    global _SLOTS
    if _SLOTS is None:
        _SLOTS = SharedSlots()
    return _SLOTS


_MAPPED: dict[str, tuple[str, torch.Tensor]] = {}  # receiver side: path -> (file name, mapping), the newest few
_MAPPED_MAX = 8


def read_shared(path: str, nbytes: int, name: str) -> torch.Tensor:
    """The first `nbytes` of a slot (no copy). Mappings are cached, since a slot is rewritten in place; `name` tells a
    new file from an old one whose fd number was reused."""
    cached_name, mapped = _MAPPED.pop(path, ("", None))
    if mapped is None or cached_name != name or mapped.numel() < nbytes:
        mapped = torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8)
    _MAPPED[path] = (name, mapped)
    while len(_MAPPED) > _MAPPED_MAX:
        _MAPPED.pop(next(iter(_MAPPED)))
    return mapped[:nbytes]


# -- GPU: CUDA IPC -------------------------------------------------------------------------------------------------


def visible_gpu_id(index: int, visible: str) -> str:
    """The id, in its node's numbering (as Ray hands GPUs out and lists them in CUDA_VISIBLE_DEVICES), of the GPU a
    process uses as its CUDA device `index` when its CUDA_VISIBLE_DEVICES is `visible` ("" when unset: the index is
    the node's)."""
    entries = [v.strip() for v in visible.split(",") if v.strip()]
    return entries[index] if index < len(entries) else str(index)


def gpu_uuid(index: int) -> str:
    """The physical identity of this process's GPU `index` (indices depend on CUDA_VISIBLE_DEVICES; UUIDs do not)."""
    return str(torch.cuda.get_device_properties(index).uuid)


def ipc_handle(buffer: torch.Tensor) -> list:
    """A handle of a CUDA tensor that another process on the same GPU opens with `open_ipc`, as plain data (see
    `plain_ipc_args`). The sender keeps `buffer` alive until every receiver has copied it. No stream sync is needed:
    `reduce_tensor` records an IPC event on the current stream, and the receiver's rebuild waits for it."""
    from torch.multiprocessing.reductions import reduce_tensor

    _, args = reduce_tensor(buffer)
    return [CUDA_IPC, gpu_uuid(buffer.device.index), plain_ipc_args(args)]


def plain_ipc_args(args: tuple) -> dict[str, Any]:
    """`reduce_tensor`'s arguments for a CUDA tensor without its torch objects (the tensor and storage classes, the
    dtype): ints, bools, bytes, strings and lists only, which vLLM's msgpack RPC carries as they are (it refuses
    classes and dtypes unless VLLM_ALLOW_INSECURE_SERIALIZATION=1). `ipc_args` rebuilds them in the receiver."""
    (tensor_cls, size, stride, offset, storage_cls, dtype, device, handle, storage_bytes, storage_offset) = args[:10]
    assert tensor_cls is torch.Tensor and storage_cls is torch.storage.TypedStorage, (tensor_cls, storage_cls)
    requires_grad, counter_handle, counter_offset, event_handle, event_sync = args[10:]
    return {
        "size": [int(d) for d in size],
        "stride": [int(d) for d in stride],
        "offset": int(offset),
        "dtype": dtype_name(dtype),
        "device": int(device),
        "handle": handle,
        "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset),
        "requires_grad": bool(requires_grad),
        "counter_handle": counter_handle,
        "counter_offset": int(counter_offset),
        "event_handle": event_handle,
        "event_sync": bool(event_sync),
    }


def ipc_args(plain: dict[str, Any], device: int) -> tuple:
    """`rebuild_cuda_tensor`'s arguments from `plain_ipc_args`, for this process's index `device` of the GPU."""
    return (
        torch.Tensor,
        torch.Size(plain["size"]),
        tuple(plain["stride"]),
        plain["offset"],
        torch.storage.TypedStorage,
        dtype_from_name(plain["dtype"]),
        device,  # the sender's index of this GPU may differ here (as vLLM's IPC engine does too)
        plain["handle"],
        plain["storage_bytes"],
        plain["storage_offset"],
        plain["requires_grad"],
        plain["counter_handle"],
        plain["counter_offset"],
        plain["event_handle"],
        plain["event_sync"],
    )


def open_ipc(gpu: str, plain: dict[str, Any]) -> torch.Tensor:
    """The tensor behind `ipc_handle`'s (`gpu`, `plain`) on this process's current GPU, which must be that GPU."""
    from torch.multiprocessing.reductions import rebuild_cuda_tensor

    index = torch.cuda.current_device()
    mine = gpu_uuid(index)
    if gpu != mine:
        raise RuntimeError(
            f"a CUDA IPC weight bucket from GPU {gpu} reached an engine worker on GPU {mine}: the "
            f"weight-sync plan assumed the engine's workers on the GPUs of the actor ranks that hand "
            f"them their weights"
        )
    return rebuild_cuda_tensor(*ipc_args(plain, index))

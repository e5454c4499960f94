"""How a weight bucket gets from the sending trainer rank to an engine: by broadcast, or handed over on the device.

The sync group (`sync_group.py`) broadcasts each bucket to every engine worker in one collective. That is wrong for
an engine on the sender's own device: NCCL refuses two ranks of one GPU in a group, which is exactly the hybrid
engine's placement (--colocate_all_models puts engine 0 on actor rank 0's GPU). Such an engine gets the bucket
handed over instead, with the same bucketing, order and reload window:

* GPU: a CUDA IPC handle of the sender's bucket tensor (`torch.multiprocessing.reductions.reduce_tensor`, the
  mechanism vLLM's `IPCWeightTransferEngine` and OpenRLHF's colocated sync use); the worker maps it and copies it.
  vLLM's own IPC engine is not used: it sends one model's named tensors per call in its own packed layout and
  loads them with `load_weights` outside our layerwise reload window, while our buckets carry LoRA-merged
  tensors in checkpoint names and a sync may span several buckets of one window.
* CPU: a file in shared memory (/dev/shm) that the worker maps with `torch.from_file`: one copy on each side,
  no collective, no socket.

`choose_transports` decides per engine from where the processes run; `check_broadcast_group` refuses a group that
would still put two members on one GPU.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

import torch

from openppo.errors import UserError

BROADCAST, SHARED_MEMORY, CUDA_IPC, OBJECT_STORE = "broadcast", "shm", "cuda_ipc", "object_store"
SHM_DIR = "/dev/shm"


@dataclass(frozen=True)
class Where:
    """Where a process runs: its node and the GPUs Ray gave it (none on CPU)."""

    node: str
    gpus: tuple[str, ...] = ()

    @classmethod
    def of(cls, info: dict[str, Any]) -> "Where":
        """From an `actor_location()` dict."""
        return cls(str(info["node_ip"]), tuple(str(g) for g in info.get("gpu_ids") or ()))

    def shares_device(self, other: "Where", on_gpu: bool) -> bool:
        if self.node != other.node:
            return False
        return bool(set(self.gpus) & set(other.gpus)) if on_gpu else True


def choose_transports(sender: Where, engines: Sequence[Where], *, colocated: bool, on_gpu: bool) -> list[str]:
    """The transport of each engine: handed over when it shares the sender's device (on CPU: the hybrid engine's
    engines on the sender's node), else the broadcast group (gloo/nccl)."""
    local = CUDA_IPC if on_gpu else SHARED_MEMORY
    return [local if colocated and sender.shares_device(e, on_gpu) else BROADCAST for e in engines]


def describe(transports: Sequence[str], backend: str) -> str:
    """One log line: which engines get which transport."""
    groups: dict[str, list[int]] = {}
    for i, t in enumerate(transports):
        groups.setdefault(t, []).append(i)
    names = {BROADCAST: f"{backend} broadcast", SHARED_MEMORY: "shared memory", CUDA_IPC: "CUDA IPC",
             OBJECT_STORE: "Ray's object store"}
    return "weight sync: " + "; ".join(f"engine(s) {','.join(map(str, idx))} via {names[t]}"
                                       for t, idx in groups.items())


def check_broadcast_group(members: Sequence[tuple[str, Where]], backend: str) -> None:
    """Refuse an NCCL group in which two members sit on one GPU (NCCL fails or hangs on that)."""
    if backend != "nccl":
        return
    seen: dict[tuple[str, str], str] = {}
    for name, where in members:
        for gpu in where.gpus:
            other = seen.setdefault((where.node, gpu), name)
            if other != name:
                raise UserError(f"the nccl weight-sync group would hold {other} and {name} on GPU {gpu} of node "
                                f"{where.node}, which NCCL refuses: drop --vllm_sync_backend nccl (use gloo) or give "
                                f"the engines their own GPUs (without --colocate_all_models)")


# -- CPU: shared memory --------------------------------------------------------------------------------------------


class SharedSlots:
    """Shared-memory files the sender reuses bucket after bucket and sync after sync (slot k of each sync).

    A new tmpfs file per bucket pays for fresh zeroed pages on every write (measured: SmolLM2 syncs 1.35x slower
    than the gloo broadcast that way); reused files are already resident, so a bucket costs one copy on each side.
    A slot too small for a bucket is replaced by a larger file under a new name (receivers cache mappings by
    name). `release` unlinks them all; the sender calls it when a sync fails and at exit."""

    def __init__(self):
        self._slots: list[tuple[str, torch.Tensor]] = []

    def write(self, slot: int, buffer: torch.Tensor) -> str:
        """Copy a CPU uint8 bucket into slot `slot`; returns the file's path."""
        while len(self._slots) <= slot:
            self._slots.append(("", torch.empty(0, dtype=torch.uint8)))
        path, mapped = self._slots[slot]
        if mapped.numel() < buffer.numel():
            if path:
                unlink_quietly(path)
            base = SHM_DIR if os.path.isdir(SHM_DIR) else "/tmp"
            path = os.path.join(base, f"openppo-sync-{os.getpid()}-{uuid.uuid4().hex}")
            mapped = torch.from_file(path, shared=True, size=max(1, buffer.numel()), dtype=torch.uint8)
            self._slots[slot] = (path, mapped)
        mapped[: buffer.numel()].copy_(buffer)
        return path

    def paths(self) -> list[str]:
        return [path for path, _ in self._slots if path]

    def release(self) -> None:
        for path in self.paths():
            unlink_quietly(path)
        self._slots = []


_MAPPED: dict[str, torch.Tensor] = {}  # receiver side: path -> mapping, the few newest kept
_MAPPED_MAX = 8


def read_shared(path: str, nbytes: int) -> torch.Tensor:
    """The first `nbytes` of a slot file (no copy). Mappings are cached by path: a slot is rewritten in place."""
    mapped = _MAPPED.pop(path, None)
    if mapped is None or mapped.numel() < nbytes:
        mapped = torch.from_file(path, shared=True, size=max(1, nbytes), dtype=torch.uint8)
    _MAPPED[path] = mapped
    while len(_MAPPED) > _MAPPED_MAX:
        _MAPPED.pop(next(iter(_MAPPED)))
    return mapped[:nbytes]


def unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


# -- GPU: CUDA IPC -------------------------------------------------------------------------------------------------


def ipc_handle(buffer: torch.Tensor) -> tuple:
    """A picklable handle of a CUDA tensor another process of this node can open (`open_ipc`). The sender must keep
    `buffer` alive until every receiver has copied it."""
    from torch.multiprocessing.reductions import reduce_tensor

    return reduce_tensor(buffer)


def open_ipc(handle: tuple, device: torch.device) -> torch.Tensor:
    """The tensor behind `ipc_handle`, copied onto `device` (the mapping is released when the view goes)."""
    rebuild, args = handle
    return rebuild(*args).to(device, copy=True)

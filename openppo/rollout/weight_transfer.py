"""openppo's weight-transfer backend for vLLM's `weight_transfer` interface: the messages, as plain data.

vLLM 0.32 moves trainer weights into its workers through one interface (`vllm.distributed.weight_transfer`): a
worker-side `WeightTransferEngine`, chosen by name from `WeightTransferEngineFactory` at start-up
(`LLM(weight_transfer_config={"backend": ...})`), driven by the worker methods `init_weight_transfer_engine`,
`start_weight_update`, `update_weights` (any number of times) and `finish_weight_update`, whose arguments are dicts
that cross vLLM's RPC. openppo registers its backend there under `BACKEND` (`worker_extension.py`, imported in every
vLLM worker), and every engine, on CPU and on GPU, in every placement, runs it:

    init_weight_transfer_engine(GroupInit)      only an engine that receives by broadcast: joins the sync group
    start_weight_update()                       opens vLLM's layer-wise reload
    update_weights(BucketUpdate) per bucket     the bucket arrives by `kind`, is unpacked and loaded
    finish_weight_update()                      closes the reload (and re-packs what vLLM's CPU kernels pre-pack)

A bucket arrives one of three ways (`kind`): "broadcast" (the sync group, gloo on CPU, NCCL on GPU), "local"
(handed over on the device by the actor rank that shares it: shared memory on CPU, CUDA IPC on GPU; see
`transport.py`), or "bytes" (the payload itself, through Ray's object store). Only how a local buffer is exported
and opened differs between CPU and GPU. With --vllm_sync_delta, the buckets after the first sync hold only the
changed elements of each tensor (`delta.py`), which the workers apply to their copy of the last sync before loading.

Why not vLLM's own backends: its `IPCWeightTransferEngine` sends `reduce_tensor`'s arguments (torch classes and
dtypes), which vLLM's msgpack RPC refuses unless `VLLM_ALLOW_INSECURE_SERIALIZATION=1` (`tests/rollout/
test_rpc_payloads.py` shows it with the real encoder); its NCCL backends (dense and sparse) run on PyNccl, which
has no CPU build, so no CPU test could run them; each takes the whole run's engines as one data-parallel
deployment with one rank offset, where openppo mixes hand-over and broadcast engines in one sync. openppo's
payloads are plain data (ints, strings, bytes, lists, dtype names): a CUDA IPC handle is flattened by
`transport.ipc_handle` and rebuilt in the worker by `transport.open_ipc`.

This module is the trainer's half of the vocabulary and imports no vLLM; the trainer side that drives a sync
(`sender.TrainerTransfer`) has the shape of vLLM's `TrainerWeightTransferEngine` (`trainer_init`, `send_weights`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

BACKEND = "openppo"  # the name openppo's worker-side engine is registered under in vLLM's factory
KINDS = ("broadcast", "local", "bytes")


@dataclass
class GroupInit:
    """`init_weight_transfer_engine`'s info: the sync group this engine's workers join, worker w as rank
    `rank_offset + w` of `world_size` (rank 0 is the trainer, which serves the rendezvous)."""

    master_address: str
    master_port: int
    rank_offset: int
    world_size: int
    group_backend: str = "gloo"  # "gloo" or "nccl"
    timeout_s: float = 600.0


@dataclass
class BucketUpdate:
    """`update_weights`'s info: one bucket of a sync. `bucket` is `BucketMeta.to_plain()`; `handles[w]` is worker w's
    hand-over handle ("local"; one handle serves every worker); `payload` the bucket's bytes ("bytes"); `verify`
    makes the workers sum what they load in float64 (`last_sync_checksum`); `delta`: the bucket holds changes
    against the last sync (`delta.py`), which the workers apply to their copy of it and keep."""

    kind: str
    bucket: dict
    handles: list = field(default_factory=list)
    payload: bytes | None = None
    verify: bool = False
    delta: bool = False

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"bucket update kind {self.kind!r}: expected one of {', '.join(KINDS)}")


def plain(info: GroupInit | BucketUpdate) -> dict[str, Any]:
    """The dict that crosses vLLM's RPC (only builtins; `None` fields left out)."""
    return {k: v for k, v in dataclasses.asdict(info).items() if v is not None}

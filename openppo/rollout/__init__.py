"""Rollout engines: vLLM generation and trainer -> engine weight sync.

`VLLMEngine` (engine.py) generates and takes weight updates; `sender.py` is the trainer side (full weights out of a
possibly ZeRO-3 / LoRA model, bucketed to the engines); `transport.py` picks each engine's way (broadcast, or a
hand-over on the device: shared memory / CUDA IPC); `sync_group.py` is the dedicated process group;
`buckets.py` packs tensors into flat byte buckets; `weight_transfer.py` holds the messages of openppo's backend of
vLLM's weight-transfer interface, and `worker_extension.py` its worker side, inside vLLM's workers. vLLM is
imported only when an engine is built.
"""

from openppo.rollout.buckets import (
    DEFAULT_BUCKET_BYTES,
    Bucket,
    BucketMeta,
    TensorMeta,
    iter_buckets,
    pack_buckets,
    plan_buckets,
    unpack_bucket,
)
from openppo.rollout.engine import VLLMEngine
from openppo.rollout.sender import (
    TrainerInit,
    TrainerTransfer,
    connect_engines,
    iter_full_weights,
    sync_weights,
    tensors_checksum,
    unwrap_model,
)
from openppo.rollout.sync_group import SyncGroup, create_sync_group

__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "Bucket",
    "BucketMeta",
    "TensorMeta",
    "iter_buckets",
    "pack_buckets",
    "plan_buckets",
    "unpack_bucket",
    "VLLMEngine",
    "TrainerInit",
    "TrainerTransfer",
    "connect_engines",
    "iter_full_weights",
    "sync_weights",
    "tensors_checksum",
    "unwrap_model",
    "SyncGroup",
    "create_sync_group",
]

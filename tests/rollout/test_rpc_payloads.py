"""Every weight-sync payload crosses vLLM's msgpack RPC as plain data, the CUDA IPC handle included.

The engine core runs in its own process (vLLM's default on a GPU, and openppo's on every device), so the arguments
of a call to the workers go through vLLM's `MsgpackEncoder` (`vllm/v1/serial_utils.py`), which refuses torch
classes and dtypes unless VLLM_ALLOW_INSECURE_SERIALIZATION=1. torch's `reduce_tensor` handle of a CUDA tensor is
made of both, so it is flattened (`transport.plain_ipc_args`) and rebuilt in the worker (`transport.ipc_args`). This
box has no CUDA: the handle's fields are stand-ins of the real types (`tests.engines.cuda_reduce_args`); the real
handle goes through the same encoder into a second process in tests/gpu/test_weight_transport_cuda.py.
"""

from __future__ import annotations

import pytest
import torch

from openppo.rollout import transport
from openppo.rollout.buckets import pack_buckets
from openppo.rollout.weight_transfer import BucketUpdate, GroupInit, plain
from tests.engines import cuda_reduce_args


def _round_trip(obj):
    from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

    return MsgpackDecoder().decode(MsgpackEncoder().encode(obj))


def test_torchs_cuda_handle_is_refused_and_the_plain_one_crosses():
    args = cuda_reduce_args(device=3, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="is not serializable"):
        _round_trip([transport.CUDA_IPC, "GPU-aaaa", args])  # what load_bucket_local sent before
    handle = _round_trip([transport.CUDA_IPC, "GPU-aaaa", transport.plain_ipc_args(args)])
    assert handle[:2] == [transport.CUDA_IPC, "GPU-aaaa"]
    rebuilt = transport.ipc_args(handle[2], device=0)
    assert rebuilt == args[:6] + (0,) + args[7:]  # every field back, on the receiver's own index of the GPU
    assert [type(a) for a in rebuilt] == [type(a) for a in args]


def test_every_update_message_crosses_as_it_was_sent():
    [bucket] = pack_buckets([("model.layers.0.mlp.up_proj.weight", torch.ones(4, 8))], 1 << 20)
    meta = bucket.meta.to_plain()
    cuda_handle = [transport.CUDA_IPC, "GPU-aaaa", transport.plain_ipc_args(cuda_reduce_args())]
    messages = [
        plain(GroupInit("10.0.0.1", 29500, 1, 3, "nccl", 600.0)),
        plain(BucketUpdate("broadcast", meta, verify=True)),
        plain(BucketUpdate("local", meta, [cuda_handle, cuda_handle])),
        plain(BucketUpdate("local", meta, [[transport.SHARED_MEMORY, "/proc/1/fd/9", "openppo-sync-x"]])),
        plain(BucketUpdate("bytes", meta, payload=bucket.buffer.numpy().tobytes())),
    ]
    for message in messages:
        assert _round_trip(message) == message
    assert BucketUpdate(**_round_trip(messages[2])).handles == [cuda_handle, cuda_handle]

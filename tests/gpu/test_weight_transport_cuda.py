"""The hybrid engine's weight hand-over on one GPU: a CUDA IPC handle of the trainer's bucket, sent as vLLM's RPC
sends it (msgpack, no pickle: plain data) to another process on the same GPU, opened there, gives the same bytes and
the same unpacked tensors, and a handle from another GPU is refused; a process's reported GPU id follows its
CUDA_VISIBLE_DEVICES as the weight-sync plan assumes; and two NCCL ranks on one GPU, the placement the hand-over
avoids, are refused by the guard before any group forms."""

from __future__ import annotations

import time
from queue import Empty

import pytest
import torch
import torch.multiprocessing as mp

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _msgpack():
    """(encode, decode) of vLLM's RPC where vLLM is installed, else of msgspec's msgpack, which vLLM's encoder is
    built on: without an encoder hook it refuses any object that is not plain data, as vLLM's does."""
    try:
        from vllm.v1.serial_utils import MsgpackDecoder, MsgpackEncoder

        return lambda obj: b"".join(bytes(b) for b in MsgpackEncoder().encode(obj)), MsgpackDecoder().decode
    except ImportError:
        msgpack = pytest.importorskip("msgspec").msgpack
        return msgpack.encode, msgpack.decode


def _receive(message: bytes, meta_plain, queue) -> None:
    """The engine worker's side: decode the RPC message, open the handle on this process's GPU, unpack, report
    checksums per tensor."""
    from openppo.rollout.buckets import BucketMeta, unpack_bucket
    from openppo.rollout.transport import CUDA_IPC, open_local

    torch.cuda.set_device(0)
    handle = _msgpack()[1](message)
    nbytes = BucketMeta.coerce(meta_plain).nbytes
    try:
        open_local((CUDA_IPC, "GPU-not-this-one", handle[2]), nbytes)
        refused = False
    except RuntimeError:
        refused = True
    buffer = open_local(handle, nbytes)
    queue.put(
        (
            refused,
            {
                name: (t.double().sum().item(), tuple(t.shape), str(t.dtype))
                for name, t in unpack_bucket(meta_plain, buffer)
            },
        )
    )


def test_cuda_ipc_bucket_reaches_another_process_exactly():
    from openppo.rollout.buckets import iter_buckets
    from openppo.rollout.transport import CUDA_IPC, LocalExporter

    g = torch.Generator().manual_seed(0)
    named = [
        ("model.layers.0.self_attn.q_proj.weight", torch.randn(256, 256, generator=g)),
        ("model.layers.0.mlp.up_proj.weight", torch.randn(512, 256, generator=g)),
        ("model.norm.weight", torch.randn(256, generator=g)),
    ]
    exporter = LocalExporter(CUDA_IPC)
    [bucket] = list(iter_buckets(iter(named), 64 << 20, dtype=torch.bfloat16, device=exporter.device))
    encode, _ = _msgpack()
    from torch.multiprocessing.reductions import reduce_tensor

    with pytest.raises(TypeError):  # torch's own handle (classes, a dtype) does not cross vLLM's RPC
        encode([CUDA_IPC, "GPU-x", reduce_tensor(bucket.buffer)[1]])
    message = encode(exporter.export(0, bucket.buffer))  # the plain handle does
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(message, bucket.meta.to_plain(), queue))
    proc.start()
    refused, got = queue.get(timeout=120)  # the exporter keeps the bucket alive until the receiver copied it
    proc.join(timeout=60)
    exporter.close(failed=False)
    assert proc.exitcode == 0 and refused
    for name, tensor in named:
        sent = tensor.to(torch.bfloat16)
        assert got[name] == (sent.double().sum().item(), tuple(sent.shape), str(sent.dtype)), name


def test_guard_refuses_two_nccl_ranks_on_this_gpu():
    from openppo.errors import UserError
    from openppo.rollout.transport import Where, check_broadcast_group

    gpu = str(torch.cuda.current_device())
    with pytest.raises(UserError, match="--vllm_sync_backend nccl"):
        check_broadcast_group(
            [("actor rank 0", Where("local", (gpu,))), ("vLLM engine 0", Where("local", (gpu,)))], "nccl"
        )


def _report_gpu(queue) -> None:
    """A process's view: the GPU id the weight-sync plan reads for its device 0, and that GPU's UUID."""
    import os

    from openppo.rollout.transport import gpu_uuid, visible_gpu_id

    queue.put((visible_gpu_id(0, os.environ.get("CUDA_VISIBLE_DEVICES", "")), gpu_uuid(0)))


@pytest.mark.parametrize("visible", ["index", "uuid"])
def test_a_process_reports_the_gpu_its_cuda_visible_devices_gives_it(visible, monkeypatch):
    """Ray lists a process's GPUs in CUDA_VISIBLE_DEVICES by the node's ids (indices, or UUIDs where the node's own
    CUDA_VISIBLE_DEVICES uses them); the process's device 0 is the first, and `visible_gpu_id` names it as Ray does
    for the actor ranks, so that an engine worker and the rank on the same GPU match."""
    from openppo.rollout.transport import gpu_uuid

    physical = gpu_uuid(0)
    # CUDA (and Ray, and nvidia-smi -L) write a UUID entry as "GPU-<uuid>"; torch's uuid has no prefix, and a bare
    # one in CUDA_VISIBLE_DEVICES hides every GPU
    entry = "0" if visible == "index" else physical if physical.startswith("GPU-") else f"GPU-{physical}"
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", entry)  # the spawned child reads it at start
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_report_gpu, args=(queue,))
    proc.start()
    deadline = time.monotonic() + 120
    while True:  # a child that dies before it reports fails the test at once, not after the whole wait
        try:
            reported, uuid = queue.get(timeout=1)
            break
        except Empty:
            assert proc.is_alive(), f"the child exited with {proc.exitcode} before it reported its GPU"
            assert time.monotonic() < deadline, "the child did not report its GPU within 120 s"
    proc.join(timeout=60)
    assert proc.exitcode == 0 and reported == entry and uuid == physical

"""The hybrid engine's weight hand-over on one GPU: a CUDA IPC handle of the trainer's bucket, opened by another
process on the same GPU, gives the same bytes and the same unpacked tensors, and a handle from another GPU is
refused; and two NCCL ranks on one GPU, the placement the hand-over avoids, are refused by the guard before any
group forms."""

from __future__ import annotations

import pytest
import torch
import torch.multiprocessing as mp

from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def _receive(handle, meta_plain, queue) -> None:
    """The engine worker's side: open the handle on this process's GPU, unpack, report checksums per tensor."""
    from openppo.rollout.buckets import BucketMeta, unpack_bucket
    from openppo.rollout.transport import CUDA_IPC, open_local

    torch.cuda.set_device(0)
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
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    proc = ctx.Process(target=_receive, args=(exporter.export(0, bucket.buffer), bucket.meta.to_plain(), queue))
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

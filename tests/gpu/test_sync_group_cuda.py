"""The NCCL weight-sync group (`openppo.rollout.sync_group`; `--vllm_sync_backend nccl`, the default on GPUs), built
as the trainer builds it: a standalone `ProcessGroupNCCL` on its own TCPStore, connected at once on the current
device, then a broadcast of a bucket-sized buffer, the barrier and the shut-down. Its CUDA calls: the
`ProcessGroupNCCL.Options` fields, `eager_connect_single_device`, the broadcast's `work.wait()` and
`torch.cuda.current_stream().synchronize()`. One rank: NCCL refuses two ranks of one group on one GPU, and the GPU
box has one; the CPU suite runs the same group over gloo with 2-3 ranks (tests/rollout/test_sync_group.py)."""

from __future__ import annotations

import pytest
import torch

from openppo.rollout.sync_group import create_sync_group
from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_a_one_rank_nccl_sync_group_broadcasts_and_shuts_down():
    torch.cuda.set_device(0)
    group = create_sync_group("nccl", "127.0.0.1", 0, 0, 1, timeout_s=60)  # (port 0: one the OS picks)
    try:
        assert group.backend == "nccl" and group.device == torch.device("cuda", 0)
        bucket = torch.randn(64 << 20, device="cuda").to(torch.bfloat16)  # 128 MiB, as a sync's bucket
        sent = bucket.clone()
        assert group.broadcast(bucket, src=0) is bucket and torch.equal(bucket, sent)
        group.barrier()
        with pytest.raises(AssertionError, match="needs cuda tensors"):
            group.broadcast(torch.zeros(2))
    finally:
        group.destroy()
    with pytest.raises(AssertionError, match="destroyed"):
        group.broadcast(sent)

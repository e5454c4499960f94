"""The device probe the launch runs before anything starts (`openppo.ppo.launch.probe_devices` calls these in a
trainer rank's place): on a GPU it names the GPU, says whether it runs bf16, and gives its memory, which sizes the
default token budget (`memory_plan.default_token_budget`). Its CUDA calls: `torch.cuda.get_device_name`,
`torch.cuda.is_bf16_supported`, `torch.cuda.get_device_properties(...).total_memory`."""

from __future__ import annotations

import pytest
import torch

from openppo.utils.hardware import bf16_support, gpu_memory_bytes
from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_the_probe_reads_the_gpu():
    support = bf16_support()
    assert support.on_gpu and support.device == torch.cuda.get_device_name()
    assert support.native == torch.cuda.is_bf16_supported() and support.slowdown is None
    free, total = torch.cuda.mem_get_info()
    assert gpu_memory_bytes() == total >= free > 0

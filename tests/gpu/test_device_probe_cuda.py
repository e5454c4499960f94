"""The device probe the launch runs before anything starts (`openppo.ppo.launch.probe_devices` calls these in a
trainer rank's place): on a GPU it names the GPU, says whether it runs bf16, and gives its memory, which sizes the
default token budget (`memory_plan.default_token_budget`). Its CUDA calls: `torch.cuda.get_device_name`,
`torch.cuda.is_bf16_supported`, `torch.cuda.get_device_properties(...).total_memory`. And the per-step device
metrics every rank logs (`device_stats`: `torch.cuda.max_memory_allocated`, `reset_peak_memory_stats`,
`utilization`)."""

from __future__ import annotations

import pytest
import torch

from openppo.utils.hardware import GIB, bf16_support, device_stats, gpu_memory_bytes
from tests.gpu.conftest import requires_cuda

pytestmark = [pytest.mark.gpu, requires_cuda]


def test_the_probe_reads_the_gpu():
    support = bf16_support()
    assert support.on_gpu and support.device == torch.cuda.get_device_name()
    assert support.native == torch.cuda.is_bf16_supported() and support.slowdown is None
    free, total = torch.cuda.mem_get_info()
    assert gpu_memory_bytes() == total >= free > 0


def test_the_step_metrics_read_the_peak_and_reset_it():
    device_stats()  # (resets the peak)
    before = torch.cuda.memory_allocated()
    block = torch.empty(1 << 30, dtype=torch.uint8, device="cuda")  # 1 GiB
    stats = device_stats()
    assert stats["perf/gpu_peak_gib"] >= (before + (1 << 30)) / GIB
    assert stats["perf/gpu_total_gib"] == gpu_memory_bytes() / GIB
    assert stats["perf/rss_gib"] > 0 and 0 <= stats.get("perf/gpu_util", 0.0) <= 100
    del block
    device_stats()  # resets the peak with the block freed
    assert device_stats()["perf/gpu_peak_gib"] < (before + (1 << 30)) / GIB

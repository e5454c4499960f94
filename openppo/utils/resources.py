"""What a process uses: resident memory on every machine, device memory and utilisation where a GPU is present."""

from __future__ import annotations

import os

import torch

GIB = 2**30


def rss_gib() -> float:
    """This process's resident set size."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / GIB


def trim_host_heap() -> None:
    """Hand the C allocator's free pages back to the OS (glibc's `malloc_trim`); a no-op without glibc.

    PyTorch's CPU tensors come from malloc. After a large block is freed glibc raises its mmap threshold (up to
    32 MiB), so the same-sized tensors made again every step (weight-sync buckets, embedding-sized gradients) then
    come from heaps that keep freed pages, and a rank's RSS moves in steps of one such block with how many happen
    to be kept. The training ranks call this after their update (before logging their RSS) and after the weight
    sync; it takes a few milliseconds."""
    global _malloc_trim
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            _malloc_trim = False
    if _malloc_trim:
        _malloc_trim(0)


_malloc_trim = None


def host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / GIB


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def device_stats(reset_peak: bool = True) -> dict[str, float]:
    """perf/* of this process's device: RSS always; on a GPU also the peak allocated memory since the last call
    (`reset_peak`), the device's total memory and, when NVML is installed (nvidia-ml-py), its utilisation."""
    stats = {"perf/rss_gib": rss_gib()}
    if not torch.cuda.is_available():
        return stats
    stats["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    stats["perf/gpu_total_gib"] = torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory / GIB
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    try:
        stats["perf/gpu_util"] = float(torch.cuda.utilization())  # percent over the last sample period (NVML)
    except Exception:  # NVML missing or not permitted: utilisation is optional
        pass
    return stats

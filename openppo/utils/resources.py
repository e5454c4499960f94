"""What a process uses: resident memory on every machine, device memory and utilisation where a GPU is present."""

from __future__ import annotations

import os
import time

import torch

GIB = 2**30


def rss_gib() -> float:
    """This process's resident set size."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / GIB


# The pages a trim hands back are faulted in again by the next update: on SmolLM2 (bf16, CPU) an update right after a
# trim took 1.3-2.2 s longer than an immediate second one. At most one trim a minute keeps that under ~3 % of the
# time while still bounding what the heap retains.
TRIM_INTERVAL_S = 60.0


def trim_host_heap(min_interval_s: float = TRIM_INTERVAL_S) -> bool:
    """Hand the C allocator's free pages back to the OS (glibc's `malloc_trim`) unless this process did so less than
    `min_interval_s` ago; a no-op without glibc. Returns whether it trimmed.

    PyTorch's CPU tensors come from malloc. After a large block is freed glibc raises its mmap threshold (up to
    32 MiB), so the same-sized tensors made again every step (weight-sync buckets, embedding-sized gradients) then
    come from heaps that keep freed pages, and a rank's RSS drifts in steps of one such block with how many happen
    to be kept. The training ranks call this after their update (before logging their RSS) and after the weight
    sync; a trim takes a few milliseconds, the refaults after it are the cost."""
    global _malloc_trim, _last_trim
    now = time.monotonic()
    if _last_trim is not None and now - _last_trim < min_interval_s:
        return False
    if _malloc_trim is None:
        import ctypes
        import ctypes.util

        try:
            _malloc_trim = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6").malloc_trim
        except (OSError, AttributeError):  # not glibc (musl, macOS)
            _malloc_trim = False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    _last_trim = now
    return True


_malloc_trim = None
_last_trim: float | None = None


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

"""The machine at hand: what it is (for logs and benchmark records), which precision it runs fast, and what a
process uses of it (resident memory everywhere; device memory and utilisation where a GPU is present).

`--param_dtype auto` (the default of every training CLI) becomes bf16 or fp32 here, once per process, from what
the device can do:

* GPU: bf16 where `torch.cuda.is_bf16_supported()` (Ampere and later), else fp32.
* CPU: bf16 only with native bf16 instructions (AVX512_BF16 or AMX) that a short matmul probe confirms; else
  fp32. Without them PyTorch emulates bf16 and is far slower than fp32: on an AMD EPYC Zen 3 (AVX2) a
  1024x1024x1024 bf16 matmul ran 58x slower than fp32 (0.8 against 46 GFLOP/s, one thread), and the CPU demo in
  bf16 did not finish one step in 6 minutes where fp32 took 56 s.

An explicit `--param_dtype bf16` is never rewritten: on a CPU without bf16 instructions it runs, after one
warning that gives the probe's measured slowdown and the fix.
"""

from __future__ import annotations

import functools
import logging
import os
import platform
import time
from dataclasses import dataclass

import torch

logger = logging.getLogger(__name__)

# bf16 is kept on a CPU with bf16 instructions unless the probe finds it this many times slower than fp32 (a broken
# or emulated kernel). The margin is wide on purpose: ranks launched separately (torchrun) each decide for
# themselves and must agree, and a native kernel measures well below 1 (about 0.5 where seen).
NATIVE_BF16_MAX_SLOWDOWN = 2.0
_PROBE_SIZE = 256  # a 256^3 matmul on one thread: ~0.3 ms in fp32, ~10 ms in emulated bf16 (AVX2)
_DTYPES = (torch.float32, torch.bfloat16)


def cpu_model() -> str:
    """The CPU's marketing name ("AMD EPYC 7B13"), from /proc/cpuinfo where there is one."""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown CPU"


# Environment variables that cap the vector instructions PyTorch's, oneDNN's and MKL's kernels use. Set, they make a
# bf16 CPU behave like one without bf16 (`ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2
# MKL_ENABLE_INSTRUCTIONS=AVX2` is how an AVX2-only CPU is checked on a newer one); the probe then measures that.
ISA_CAP_VARIABLES = ("ATEN_CPU_CAPABILITY", "ONEDNN_MAX_CPU_ISA", "MKL_ENABLE_INSTRUCTIONS")


def isa_caps() -> str:
    """The instruction-set caps in force, as "NAME=value ..." ("" when none is set)."""
    return " ".join(f"{name}={os.environ[name]}" for name in ISA_CAP_VARIABLES if os.environ.get(name))


def cpu_bf16_instructions() -> list[str]:
    """The native bf16 instruction sets of this CPU that PyTorch's kernels use (empty without any)."""
    found = []
    for name, probe in (("AVX512_BF16", "_is_avx512_bf16_supported"), ("AMX", "_is_amx_tile_supported")):
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            found.append(name)
    return found


def probe_bf16_slowdown(size: int = _PROBE_SIZE, repeats: int = 5) -> float:
    """bf16 matmul time over fp32 matmul time on this CPU (best of `repeats`, after a warm-up): < 1 is faster.

    The ratio is a property of the kernels, so it is taken on one thread with the two dtypes interleaved. On the
    default threads a busy box broke it: each call's threads wait at a barrier for a sibling the scheduler has parked,
    and a native bf16 kernel measured 14.6x and 64.5x fp32 (AMD EPYC, AVX512, 2 cores, beside a test suite or three
    busy loops) where it measures 0.5x; `auto` would then have picked fp32, and separately launched ranks could have
    disagreed. One thread, interleaved: 0.50-0.52 in the same runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        pairs = {dtype: (torch.randn(size, size).to(dtype), torch.randn(size, size).to(dtype)) for dtype in _DTYPES}
        for a, b in pairs.values():
            torch.mm(a, b)  # warm-up: kernel selection, oneDNN primitive creation
        best = dict.fromkeys(pairs, float("inf"))
        for _ in range(repeats):
            for dtype, (a, b) in pairs.items():  # interleaved: a burst of load hits both dtypes alike
                start = time.perf_counter()
                torch.mm(a, b)
                best[dtype] = min(best[dtype], time.perf_counter() - start)
    finally:
        torch.set_num_threads(threads)
    return best[torch.bfloat16] / max(best[torch.float32], 1e-9)


@dataclass(frozen=True)
class Bf16Support:
    """Whether this device runs bf16 fast, and the facts behind the answer."""

    device: str  # "NVIDIA H100 80GB HBM3", or "AMD EPYC 7B13 (AVX2)"
    on_gpu: bool
    native: bool  # GPU bf16 support, or CPU bf16 instructions
    slowdown: float | None  # CPU only: probe_bf16_slowdown()

    @property
    def fast(self) -> bool:
        if self.on_gpu:
            return self.native
        return self.native and self.slowdown is not None and self.slowdown < NATIVE_BF16_MAX_SLOWDOWN


@functools.lru_cache(maxsize=1)
def bf16_support() -> Bf16Support:
    """This process's device, probed once (the CPU probe costs a few ms, ~0.07 s where bf16 is emulated)."""
    if torch.cuda.is_available():
        return Bf16Support(torch.cuda.get_device_name(), True, torch.cuda.is_bf16_supported(), None)
    instructions = cpu_bf16_instructions()
    capability = torch.backends.cpu.get_cpu_capability()
    caps = isa_caps()
    device = (
        f"{cpu_model()} ({capability}{', ' + '+'.join(instructions) if instructions else ''}"
        f"{'; capped by ' + caps if caps else ''})"
    )
    return Bf16Support(device, False, bool(instructions), probe_bf16_slowdown())


def resolve_param_dtype(requested: str, support: Bf16Support) -> tuple[str, str | None, str | None]:
    """`(dtype, info, warning)` for a `--param_dtype` value on a device: `auto` becomes bf16 or fp32 with an `info`
    line saying why; an explicit value is kept, with a `warning` line when it runs slowly here. Pure."""
    slow = f"a bf16 matmul measured {support.slowdown:.1f}x the fp32 time" if support.slowdown else ""
    if requested == "auto":
        dtype = "bf16" if support.fast else "fp32"
        if support.on_gpu:
            why = "the GPU supports bf16" if support.native else "the GPU has no bf16 (pre-Ampere)"
        elif support.fast:
            why = f"native bf16 instructions, {slow}"
        elif support.native:
            why = f"bf16 instructions present but {slow}"
        else:
            why = f"no bf16 instructions, {slow}" if slow else "no bf16 instructions"
        return dtype, f"--param_dtype auto -> {dtype} on {support.device}: {why}", None
    if requested == "bf16" and not support.on_gpu and not support.fast:
        facts = slow or "no bf16 instructions"
        return (
            requested,
            None,
            (
                f"--param_dtype bf16 on {support.device}: this CPU has no fast bf16 ({facts}); "
                f"training will be slow. Use --param_dtype fp32 (or auto)"
            ),
        )
    if requested == "bf16" and support.on_gpu and not support.native:
        return (
            requested,
            None,
            (f"--param_dtype bf16 on {support.device}: the GPU has no bf16 support; use --param_dtype fp32 (or auto)"),
        )
    return requested, None, None


def resolve_precision(ds_cfg) -> str:
    """Resolve `ds_cfg.param_dtype` in place (`auto` -> bf16/fp32) and log the one line that says why; returns it.

    Called once by each CLI before anything reads the config, so every rank and engine it starts gets the concrete
    dtype and the logged config shows it."""
    dtype, info, warning = resolve_param_dtype(ds_cfg.param_dtype, bf16_support())
    if info:
        logger.info(info)
    if warning:
        logger.warning(warning)
    ds_cfg.param_dtype = dtype
    return dtype


def auto_param_dtype() -> str:
    """What `--param_dtype auto` gives on this machine: "bf16" where bf16 is fast, else "fp32" (benches, tests)."""
    return resolve_param_dtype("auto", bf16_support())[0]


def device_record() -> dict[str, str]:
    """The device a benchmark ran on, for its JSON record: GPU name, or CPU model and PyTorch's CPU capability."""
    if torch.cuda.is_available():
        return {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    instructions = cpu_bf16_instructions()
    record = {
        "device": cpu_model(),
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "cpu_bf16_instructions": "+".join(instructions) or "none",
        "torch": torch.__version__,
    }
    caps = isa_caps()
    if caps:
        record["isa_caps"] = caps
    return record


# -- what a process uses -----------------------------------------------------------------------------------------------

GIB = 2**30


def rss_gib() -> float:
    """This process's resident set size."""
    import psutil

    return psutil.Process(os.getpid()).memory_info().rss / GIB


# The pages a trim hands back are faulted in again by the next update, which then takes seconds longer
# (docs/benchmarks.md, "Measurements behind code defaults"). At most one trim a minute keeps that a few percent of
# the time while still bounding what the heap retains.
TRIM_INTERVAL_S = 60.0


def trim_host_heap(min_interval_s: float = TRIM_INTERVAL_S) -> bool:
    """Hand the C allocator's free pages back to the OS (glibc's `malloc_trim`) unless less than `min_interval_s`
    passed since this process's last trim or its first call; a no-op without glibc. Returns whether it trimmed.

    PyTorch's CPU tensors come from malloc. After a large block is freed glibc raises its mmap threshold (up to
    32 MiB), so the same-sized tensors made again every step (weight-sync buckets, embedding-sized gradients) then
    come from heaps that keep freed pages, and a rank's RSS drifts in steps of one such block with how many happen
    to be kept. The RL training ranks call this after their update (before logging their RSS) and after the weight
    sync, the SFT / RM / DPO loop after each optimizer step; a trim takes a few milliseconds, the refaults after it
    are the cost."""
    global _malloc_trim, _last_trim
    now = time.monotonic()
    if _last_trim is None:  # the first call starts the clock: what the first update freed, the next reuses
        _last_trim = now
        if min_interval_s > 0:
            return False
    elif now - _last_trim < min_interval_s:
        return False
    if _malloc_trim is None:
        _malloc_trim = _glibc_function("malloc_trim") or False
    if not _malloc_trim:
        return False
    _malloc_trim(0)
    _last_trim = now
    return True


_malloc_trim = None
_last_trim: float | None = None

# glibc's mallopt parameters (malloc.h)
_M_TRIM_THRESHOLD, _M_MMAP_MAX = -1, -4


def keep_freed_host_memory() -> bool:
    """Have the C allocator keep freed memory for reuse instead of giving it back at once; a no-op without glibc.
    Returns whether it took effect. Only `trim_host_heap` then hands pages back, at most once a minute.

    glibc serves every block over its mmap threshold (at most 32 MiB) with a fresh mapping and unmaps it on free,
    so a CPU update's logits, their gradients and the embedding-sized weight gradients, allocated again for every
    micro-batch, are faulted in page by page each time: a few GiB a step, about a tenth of the update on a CPU
    trainer (docs/benchmarks.md, "Measurements behind code defaults"). With mmap off and no automatic trim they come
    from the heap, which keeps the pages the previous micro-batch freed. The cost: between two trims the process
    holds what it freed, its working peak plus the heap's fragmentation."""
    import ctypes

    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    return bool(mallopt(_M_MMAP_MAX, 0)) and bool(mallopt(_M_TRIM_THRESHOLD, 2**31 - 1))


def _glibc_function(name: str):
    """A glibc allocator function through ctypes; None without one (musl, macOS)."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None


def host_memory_gib() -> float:
    import psutil

    return psutil.virtual_memory().total / GIB


def device_name() -> str:
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def gpu_memory_bytes() -> int | None:
    """This process's GPU's memory (the memory planner's device size); None without one."""
    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_properties(torch.cuda.current_device()).total_memory


def device_stats(reset_peak: bool = True) -> dict[str, float]:
    """perf/* of this process's device: RSS always; on a GPU also the peak allocated memory since the last call
    (`reset_peak`), the device's total memory and, when NVML is installed (nvidia-ml-py), its utilisation."""
    stats = {"perf/rss_gib": rss_gib()}
    if not torch.cuda.is_available():
        return stats
    stats["perf/gpu_peak_gib"] = torch.cuda.max_memory_allocated() / GIB
    stats["perf/gpu_total_gib"] = gpu_memory_bytes() / GIB
    if reset_peak:
        torch.cuda.reset_peak_memory_stats()
    try:
        stats["perf/gpu_util"] = float(torch.cuda.utilization())  # percent over the last sample period (NVML)
    except Exception:  # NVML missing or not permitted: utilisation is optional
        pass
    return stats

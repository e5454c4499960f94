"""The heap trim runs at most once per interval: the pages it hands back cost the next update their refaults."""

from __future__ import annotations

import ctypes.util

import pytest

from openppo.utils import hardware


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to trim")
def test_trim_is_rate_limited(monkeypatch):
    clock = [1000.0]
    monkeypatch.setattr(hardware.time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(hardware, "_last_trim", None)
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # the first call starts the clock
    clock[0] += 59.0
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # too soon
    clock[0] += 1.0
    assert hardware.trim_host_heap(min_interval_s=60.0)  # a minute after the first call
    clock[0] += 30.0
    assert not hardware.trim_host_heap(min_interval_s=60.0)  # too soon after that trim
    assert hardware.trim_host_heap(min_interval_s=0.0)  # no limit: always
    monkeypatch.setattr(hardware, "_last_trim", None)
    assert hardware.trim_host_heap(min_interval_s=0.0)  # also on the first call


# In a fresh interpreter: malloc, write, free and malloc again a block far over glibc's mmap threshold, and count
# the page faults of writing the second one. Printed: the faults, then whether keep_freed_host_memory took effect.
_REUSE = """
import ctypes, resource, sys
from openppo.utils.hardware import keep_freed_host_memory
kept = keep_freed_host_memory() if sys.argv[1] == "keep" else False
libc = ctypes.CDLL("libc.so.6")
libc.malloc.restype, libc.free.argtypes = ctypes.c_void_p, [ctypes.c_void_p]
libc.memset.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.c_size_t]
size = 64 << 20
block = libc.malloc(size)
libc.memset(block, 1, size)
libc.free(block)
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
block = libc.malloc(size)
libc.memset(block, 1, size)
print(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before, kept)
"""


@pytest.mark.skipif(ctypes.util.find_library("c") is None, reason="no C library to tune")
def test_kept_memory_is_reused_without_page_faults():
    import subprocess
    import sys

    def faults(mode: str) -> tuple[int, bool]:
        out = subprocess.run([sys.executable, "-c", _REUSE, mode], capture_output=True, text=True, check=True)
        count, kept = out.stdout.split()
        return int(count), kept == "True"

    pages = (64 << 20) // 4096
    fresh, _ = faults("default")
    reused, kept = faults("keep")
    if not kept:
        pytest.skip("not glibc: mallopt is not there")
    assert fresh > pages // 2  # glibc maps a new 64 MiB block, and each of its pages faults when first written
    assert reused < pages // 20  # the freed block came back from the heap, its pages still mapped

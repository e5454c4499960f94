"""--param_dtype auto: the decision table on hand-made device facts, and the real probe on this machine."""

from __future__ import annotations

import multiprocessing
import time

import pytest
import torch

from openppo.utils.hardware import (
    ISA_CAP_VARIABLES,
    NATIVE_BF16_MAX_SLOWDOWN,
    Bf16Support,
    bf16_support,
    device_record,
    isa_caps,
    probe_bf16_slowdown,
    resolve_param_dtype,
)

AVX2 = Bf16Support("AMD EPYC 7B13 (AVX2)", on_gpu=False, native=False, slowdown=52.0)
SAPPHIRE = Bf16Support("Intel Xeon (AVX512, AVX512_BF16+AMX)", on_gpu=False, native=True, slowdown=0.4)
BROKEN = Bf16Support("odd CPU (AVX512, AVX512_BF16)", on_gpu=False, native=True, slowdown=9.0)
H100 = Bf16Support("NVIDIA H100 80GB HBM3", on_gpu=True, native=True, slowdown=None)
V100 = Bf16Support("Tesla V100-SXM2-32GB", on_gpu=True, native=False, slowdown=None)


@pytest.mark.parametrize(
    "support,dtype,why",
    [
        (AVX2, "fp32", "no bf16 instructions, a bf16 matmul measured 52.0x the fp32 time"),
        (SAPPHIRE, "bf16", "native bf16 instructions, a bf16 matmul measured 0.4x the fp32 time"),
        (BROKEN, "fp32", "bf16 instructions present but a bf16 matmul measured 9.0x the fp32 time"),
        (H100, "bf16", "the GPU supports bf16"),
        (V100, "fp32", "the GPU has no bf16 (pre-Ampere)"),
    ],
)
def test_auto_picks_bf16_only_where_it_is_fast(support, dtype, why):
    resolved, info, warning = resolve_param_dtype("auto", support)
    assert resolved == dtype and warning is None
    assert info == f"--param_dtype auto -> {dtype} on {support.device}: {why}"


def test_explicit_bf16_without_fast_bf16_runs_with_one_warning():
    dtype, info, warning = resolve_param_dtype("bf16", AVX2)
    assert dtype == "bf16" and info is None  # the user's choice is kept
    assert "\n" not in warning and "52.0x" in warning and "--param_dtype fp32" in warning
    assert resolve_param_dtype("bf16", V100)[2] is not None
    for support in (SAPPHIRE, H100):
        assert resolve_param_dtype("bf16", support) == ("bf16", None, None)
    for explicit in ("fp32", "fp16"):
        assert resolve_param_dtype(explicit, AVX2) == (explicit, None, None)


def test_a_machine_without_a_gpu_has_no_gpu_memory():
    """The launch's probe (`DeviceProbe.memory_bytes`) on CPU: no GPU memory, so no GPU-sized token budget
    (tests/gpu/test_device_probe_cuda.py reads a GPU's)."""
    from openppo.utils.hardware import gpu_memory_bytes

    if __import__("torch").cuda.is_available():
        pytest.skip("a machine without a GPU")
    assert gpu_memory_bytes() is None


def test_this_machine_probe_agrees_with_its_instructions():
    """The real probe: native bf16 must measure inside the margin (else auto would pick fp32 on bf16 hardware).
    Emulated bf16 is not bounded here: how slow it is depends on the vector unit (58x with AVX2)."""
    support = bf16_support()
    if support.on_gpu:
        pytest.skip("CPU probe only")
    slowdown = probe_bf16_slowdown()
    assert slowdown > 0
    if support.native and not isa_caps():  # with the kernels capped (see ISA_CAP_VARIABLES) bf16 may be emulated
        assert slowdown < NATIVE_BF16_MAX_SLOWDOWN, slowdown
    record = device_record()
    assert record["device"] and record["cpu_capability"] == __import__("torch").backends.cpu.get_cpu_capability()
    assert (record["cpu_bf16_instructions"] != "none") == support.native


def test_the_probe_times_one_thread_with_the_dtypes_interleaved(monkeypatch):
    """What keeps the probe true on a busy box: every timed matmul runs on one thread, bf16 and fp32 alternate, and
    the caller's thread count comes back."""
    calls = []
    real_mm = torch.mm

    def mm(a, b):
        calls.append((a.dtype, torch.get_num_threads()))
        return real_mm(a, b)

    monkeypatch.setattr(torch, "mm", mm)
    threads = torch.get_num_threads()
    probe_bf16_slowdown(size=16, repeats=3)
    assert torch.get_num_threads() == threads
    assert {n for _, n in calls} == {1}
    timed = [dtype for dtype, _ in calls[2:]]  # after one warm-up call of each
    assert timed == [torch.float32, torch.bfloat16] * 3


def _spin(seconds: float) -> None:
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        pass


def test_native_bf16_measures_fast_on_a_busy_box():
    """Beside busy processes (as a run beside its vLLM engine, or a test suite, loads the box) the probe still finds
    native bf16 fast. On the default threads it did not: 64.5x once in five probes beside three busy loops."""
    support = bf16_support()
    if support.on_gpu or not support.native or isa_caps():
        pytest.skip("needs a CPU with native bf16 kernels")
    busy = [multiprocessing.get_context("spawn").Process(target=_spin, args=(20.0,)) for _ in range(3)]
    for p in busy:
        p.start()
    try:
        time.sleep(1.0)  # the spawned interpreters are up and spinning
        slowdowns = [probe_bf16_slowdown() for _ in range(10)]
    finally:
        for p in busy:
            p.terminate()
            p.join()
    assert max(slowdowns) < NATIVE_BF16_MAX_SLOWDOWN, slowdowns


def test_isa_caps_reach_the_device_name_and_record(monkeypatch):
    """An AVX2-only CPU is checked on a newer one by capping the kernels' instruction sets: the cap is named."""
    for name in ISA_CAP_VARIABLES:
        monkeypatch.delenv(name, raising=False)
    assert isa_caps() == "" and "isa_caps" not in device_record()
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    monkeypatch.setenv("MKL_ENABLE_INSTRUCTIONS", "AVX2")
    assert isa_caps() == "ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2"
    assert device_record()["isa_caps"] == isa_caps()

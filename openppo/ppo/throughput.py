"""Per-step throughput of an RL step (pure arithmetic on token counts and stage timings).

All rates are over wall time of the stage that did the work: generated tokens over `timing/generate`, trained
tokens over `timing/actor_train`, samples and generated tokens per hour over the whole step (`timing/step`).
`timing/idle` is the part of the step outside every timed stage (collation, metrics, controller work, waits).
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator

# Dense bf16/fp16 tensor-core peak per device, in FLOP/s (vendor data sheets, SXM parts without sparsity).
PEAK_BF16_FLOPS = {
    "H200": 989e12,
    "H100": 989e12,
    "A100": 312e12,
    "L40S": 362e12,
    "A10G": 125e12,
    "L4": 121e12,
}

_STAGE_EXCLUDED = ("timing/step", "timing/idle")


def peak_flops(device_name: str, dtype: str) -> float | None:
    """The device's dense peak for `dtype` ("bf16"/"fp16"), or None when unknown (fp32, CPUs, unlisted parts)."""
    if dtype not in ("bf16", "fp16"):
        return None
    name = device_name.upper()
    for key, value in PEAK_BF16_FLOPS.items():
        if key in name:
            return value
    return None


def train_flops(num_params: int, tokens: int, gradient_checkpointing: bool = False) -> float:
    """FLOPs of forward + backward over `tokens` tokens: 6 N per token (2 forward, 4 backward; Kaplan et al. 2020),
    8 N with activation checkpointing, which repeats the forward."""
    return (8 if gradient_checkpointing else 6) * num_params * tokens


def mfu(flops: float, seconds: float, peak: float | None, devices: int = 1) -> float | None:
    """Model FLOPs utilisation: achieved FLOP/s over `devices` x the peak."""
    if peak is None or seconds <= 0:
        return None
    return flops / (seconds * peak * devices)


def idle_seconds(timing: dict[str, float], step_seconds: float) -> float:
    """The step's wall time outside every stage timed on the step's own thread. With --async_train (the step then
    has `timing/wait_rollout`) generation and scoring ran on the producer thread, beside the step."""
    overlapped = ("timing/generate", "timing/reward") if "timing/wait_rollout" in timing else ()
    staged = sum(v for k, v in timing.items() if k.startswith("timing/") and k not in _STAGE_EXCLUDED + overlapped)
    return max(0.0, step_seconds - staged)


def step_throughput(
    *, generated_tokens: int, trained_tokens: int, samples: int, timing: dict[str, float]
) -> dict[str, float]:
    """perf/* rates of one step from its token counts and `timing/*` seconds (missing stages give no rate)."""
    out: dict[str, float] = {}
    generate, train, step = (timing.get(k, 0.0) for k in ("timing/generate", "timing/actor_train", "timing/step"))
    if generate > 0:
        out["perf/generate_tokens_per_s"] = generated_tokens / generate
    if train > 0:
        out["perf/train_tokens_per_s"] = trained_tokens / train
    if step > 0:
        out["perf/samples_per_s"] = samples / step
        out["perf/generated_tokens_per_hour"] = generated_tokens / step * 3600
    return out


@contextlib.contextmanager
def timed(timing: dict[str, float], stage: str) -> Iterator[None]:
    """Adds the block's wall time to `timing["timing/<stage>"]`."""
    start = time.perf_counter()
    try:
        yield
    finally:
        key = f"timing/{stage}"
        timing[key] = timing.get(key, 0.0) + time.perf_counter() - start

"""Benchmark: device memory held by a trained DeepSpeed engine before/after `offload_states` (--deepspeed_enable_sleep).

    .venv/bin/python bench/state_offload.py --model smollm2 --zero_stage 2
    python bench/state_offload.py --model smollm2 --zero_stage 3      # on a GPU box (ZeRO-3 offload needs FusedAdam)

One rank, the trainer's own strategy (`DeepSpeedStrategy.prepare_train`) and role methods' DeepSpeed calls. One
optimizer step materialises the Adam states, then the states are offloaded and reloaded. On a GPU the numbers are
`torch.cuda.memory_allocated` (what the colocated vLLM engines could use while the trainer sleeps); on CPU, where
the device *is* host memory, they are the process RSS, and offloading can only move bytes within it. The last line
printed is one JSON object, with the device it ran on (CPU model and PyTorch's CPU capability, or the GPU
name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, model_path, resolve_dtype, timing_engine  # noqa: E402

os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="smollm2")
    parser.add_argument("--zero_stage", type=int, choices=(1, 2, 3), default=2)
    add_dtype_option(parser)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # auto -> bf16/fp32 here, named in the record

    import psutil
    import torch

    from openppo.models.actor import Actor
    from openppo.strategy.config import DeepSpeedConfig, state_offload_supported
    from openppo.strategy.deepspeed_strategy import DeepSpeedStrategy

    on_gpu = torch.cuda.is_available()
    if not state_offload_supported(args.zero_stage, on_gpu):
        raise SystemExit(f"--zero_stage {args.zero_stage}: DeepSpeed cannot offload these states on this machine")

    def held_gib() -> float:
        gc.collect()
        if on_gpu:
            torch.cuda.synchronize()
            return torch.cuda.memory_allocated() / 2**30
        return psutil.Process().memory_info().rss / 2**30

    strategy = DeepSpeedStrategy(
        DeepSpeedConfig(zero_stage=args.zero_stage, param_dtype=args.dtype, dist_timeout=600),
        train_batch_size=2,
        micro_batch_size=2,
        max_norm=1.0,
        seed=0,
    )
    strategy.setup_distributed()
    with strategy.zero3_init():
        model = Actor.from_pretrained(model_path(args.model), dtype=strategy.torch_dtype)
    engine = timing_engine(strategy, model, lr=1e-6)
    ids = torch.randint(100, 1000, (2, 64), device=strategy.device)
    out = engine(ids, torch.ones_like(ids))
    engine.backward(out.log_probs.mean())
    engine.step()
    result = {
        "bench": "state_offload",
        "model": args.model,
        "zero_stage": args.zero_stage,
        "dtype": args.dtype,
        "measure": "cuda.memory_allocated" if on_gpu else "process RSS",
    }
    result["trained_gib"] = round(held_gib(), 3)
    t0 = time.perf_counter()
    engine.offload_states(pin_memory=on_gpu)
    result["offload_s"] = round(time.perf_counter() - t0, 3)
    result["offloaded_gib"] = round(held_gib(), 3)
    t0 = time.perf_counter()
    engine.reload_states()
    result["reload_s"] = round(time.perf_counter() - t0, 3)
    result["reloaded_gib"] = round(held_gib(), 3)
    result["freed_gib"] = round(result["trained_gib"] - result["offloaded_gib"], 3)
    if on_gpu:
        result["peak_gib"] = round(torch.cuda.max_memory_allocated() / 2**30, 3)
    emit(result)


if __name__ == "__main__":
    main()

"""Benchmark: how much a driver's RSS grows per Ray actor call, and whether that growth levels off.

    .venv/bin/python bench/ray_call_rss.py                    # 20000 calls with small arguments
    .venv/bin/python bench/ray_call_rss.py --put              # each call gets ray.put of a dict of tensors

The trainer's driver makes about 25 Ray calls per RL step (generation chunks, the sharded train and log-prob
calls, the weight-sync buckets, health probes). This isolates what Ray itself keeps per call: one actor with a
trivial method, called and awaited N times from this process, which samples its own RSS every `--every` calls
after a gc. The growth is reported per window, in bytes per call, so a growth that levels off (allocator pools
and Ray's internal tables reaching their steady size) is told apart from a leak (a constant rate). The last line
printed is one JSON object, with the device it ran on (CPU model and PyTorch's CPU capability, or the GPU
name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit  # noqa: E402 (after the path set-up)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--calls", type=int, default=20000)
    parser.add_argument("--every", type=int, default=2000, help="calls between RSS samples")
    parser.add_argument("--put", action="store_true", help="pass ray.put({sequences, mask}) as the trainer's shards")
    args = parser.parse_args()
    if args.calls < 2 * args.every:
        raise SystemExit("--calls must be at least 2 x --every")
    import psutil
    import ray
    import torch

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)

    @ray.remote(num_cpus=0)
    class Echo:
        def call(self, payload, **kwargs) -> dict[str, float]:
            return {"loss": 1.0, "timing/x": 0.1}

    actor, proc = Echo.remote(), psutil.Process()
    samples = []
    for i in range(args.calls + 1):
        if args.put:
            shard = {"sequences": torch.randint(0, 100, (8, 80)), "mask": torch.ones(8, 79)}
            ray.get(actor.call.remote(ray.put(shard), kl=0.1), timeout=60)
        else:
            ray.get(actor.call.remote(i), timeout=60)
        if i % args.every == 0:
            gc.collect()
            samples.append((i, proc.memory_info().rss))
    ray.shutdown()
    # the first window holds the warm-up (imports, first serialization): rates start at the second
    windows = [
        {"calls": f"{a}-{b}", "bytes_per_call": round((rb - ra) / (b - a), 1)}
        for (a, ra), (b, rb) in zip(samples[1:], samples[2:])
    ]
    first, last = windows[: len(windows) // 2], windows[len(windows) // 2 :]
    emit(
        {
            "bench": "ray_call_rss",
            "put": args.put,
            "calls": args.calls,
            "rss_mib": {i: round(r / 2**20, 2) for i, r in samples},
            "windows": windows,
            "first_half_bytes_per_call": round(sum(w["bytes_per_call"] for w in first) / len(first), 1),
            "second_half_bytes_per_call": round(sum(w["bytes_per_call"] for w in last) / len(last), 1),
        }
    )


if __name__ == "__main__":
    main()

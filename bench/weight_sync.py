"""Benchmark: vLLM engine start-up, generation throughput, and trainer -> engine weight sync on CPU.

    .venv/bin/python bench/weight_sync.py --model tiny        # the tests' tiny Qwen2 (fp32)
    .venv/bin/python bench/weight_sync.py --model smollm2     # SmolLM2-135M-Instruct (bf16)

One engine runs as a Ray actor (1 CPU; vLLM's engine core in a process of its own, as in training: set
VLLM_ENABLE_V1_MULTIPROCESSING=0 to time it in the actor's process); this process is the trainer (plain torch, rank 0
of a gloo sync group). A sync is timed bucketed (`--bucket_mib`, default 256), with one tensor per message (every tensor
its own bucket: one Ray call plus one broadcast per tensor, as a per-parameter sync does), and bucketed through
shared memory (a memfd), the transport of an engine on the trainer's device (--colocate_all_models on CPU), and
bucketed through Ray's object store (--vllm_sync_with_ray), with the ratios of the last two to the gloo broadcast
(`shared_memory_over_gloo_broadcast`, `object_store_over_gloo_broadcast`). Timed syncs run unverified, as
in training; one more sync of each kind is verified (`last_sync_checksum` equals the sender's sum). The last line
printed is one JSON object with the numbers and the device.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import emit  # noqa: E402 (after the path set-up)

os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("HF_HUB_OFFLINE", "1")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--bucket_mib", type=float, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--num_prompts", type=int, default=8)
    parser.add_argument("--n", type=int, default=4)
    parser.add_argument("--max_new_tokens", type=int, default=64)
    args = parser.parse_args()

    import ray
    import torch
    from transformers import AutoModelForCausalLM

    from openppo.rollout import VLLMEngine
    from openppo.rollout.sender import connect_engines, iter_full_weights, sync_weights, tensors_checksum
    from tests.model_cache import smollm2_dir, tiny_model_dir

    torch.set_num_threads(1)  # the engine actor takes the other core
    model_dir = str(tiny_model_dir() if args.model == "tiny" else smollm2_dir())
    dtype = "float32" if args.model == "tiny" else "bfloat16"
    ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="warning")
    result: dict = {"model": args.model, "dtype": dtype}
    try:
        t0 = time.perf_counter()
        engine = ray.remote(num_cpus=1)(VLLMEngine).remote(
            model_dir, dtype=dtype, max_model_len=512, kv_cache_bytes=256 << 20
        )
        ray.get(engine.ready.remote())
        result["actor_ready_s"] = time.perf_counter() - t0
        result["engine_start_s"] = ray.get(engine.__ray_call__.remote(lambda self: self.start_time_s))

        prompts = [[100 + 13 * i + j for j in range(32)] for i in range(args.num_prompts)]
        ray.get(engine.generate.remote(prompts[:1], n=1, max_new_tokens=4, temperature=1.0, top_p=1.0))  # warm-up
        t0 = time.perf_counter()
        out = ray.get(
            engine.generate.remote(prompts, n=args.n, max_new_tokens=args.max_new_tokens, temperature=1.0, top_p=1.0)
        )
        seconds = time.perf_counter() - t0
        tokens = sum(len(s["token_ids"]) for samples in out for s in samples)
        result["generate"] = {
            "sequences": args.num_prompts * args.n,
            "tokens": tokens,
            "seconds": seconds,
            "tokens_per_s": tokens / seconds,
        }

        model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype))
        expected = tensors_checksum(iter_full_weights(model, rank=0))
        result["num_bytes"] = sum(p.numel() * p.element_size() for p in model.parameters())
        group = connect_engines([engine], backend="gloo", master_addr="127.0.0.1", timeout_s=120)
        try:
            bucketed = int(args.bucket_mib * 2**20)
            for label, bucket_bytes, transport in (
                ("bucketed", bucketed, "broadcast"),
                ("per_tensor", 1, "broadcast"),
                ("shared_memory", bucketed, "shm"),
                ("object_store", bucketed, "object_store"),
            ):
                times, stats = [], {}
                for _ in range(args.repeats):  # timed without verification, as a training run syncs
                    stats = sync_weights(
                        model, group, [engine], bucket_bytes=bucket_bytes, timeout_s=600, plan=[transport]
                    )
                    times.append(stats["seconds"])
                sync_weights(
                    model, group, [engine], bucket_bytes=bucket_bytes, timeout_s=600, plan=[transport], verify=True
                )
                got = ray.get(engine.last_sync_checksum.remote())
                assert abs(got - expected) <= 1e-9 * max(1.0, abs(expected)), (got, expected)
                result[f"sync_{label}"] = {
                    "num_buckets": stats["num_buckets"],
                    "seconds_median": statistics.median(times),
                    "seconds_all": times,
                }
            for label in ("shared_memory", "object_store"):
                result[f"{label}_over_gloo_broadcast"] = (
                    result[f"sync_{label}"]["seconds_median"] / result["sync_bucketed"]["seconds_median"]
                )
        finally:
            group.destroy()
    finally:
        ray.shutdown()
    emit(result)


if __name__ == "__main__":
    main()

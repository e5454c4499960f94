"""How many threads each vLLM CPU engine should get when several generate at once (`launch.cpu_threads_per_process`):
two engines generating side by side, each with 1 thread and each with all the box's cores, in one invocation.

Each configuration starts two `VLLMEngine` actors (SmolLM2-135M, fp32) with OMP_NUM_THREADS set as the run sets it,
and times rounds in which both engines generate a batch at once (the prompts dealt over them, as a rollout does);
the record gives generated tokens per second, best of --rounds after a warm-up round, and the ratio of the two.

    .venv/bin/python bench/engine_threads.py [--prompts 32] [--max_tokens 64] [--rounds 3]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import emit, model_path  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=32)
    parser.add_argument("--max_tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args()
    import ray

    from openppo.models.hf import load_tokenizer
    from openppo.rollout import VLLMEngine
    from openppo.tasks.arithmetic import make_rows

    path = model_path("smollm2")
    tok = load_tokenizer(path)
    prompts = [tok.encode(row["input"], add_special_tokens=False) for row in make_rows(args.prompts, seed=0)]
    cores = os.cpu_count() or 1
    ray.init(num_cpus=2 * cores, include_dashboard=False, log_to_driver=False)

    def rate(threads: int) -> float:
        engines = [
            ray.remote(num_cpus=1, runtime_env={"env_vars": {"OMP_NUM_THREADS": str(threads)}})(VLLMEngine).remote(
                path, dtype="float32", seed=i, max_model_len=256, kv_cache_bytes=256 << 20
            )
            for i in range(2)
        ]
        try:
            ray.get([e.ready.remote() for e in engines], timeout=600)
            halves = [prompts[i::2] for i in range(2)]
            rates = []
            for _ in range(args.rounds + 1):  # the first is a warm-up
                start = time.perf_counter()
                outs = ray.get(
                    [
                        e.generate.remote(half, n=1, max_new_tokens=args.max_tokens, temperature=1.0, top_p=1.0)
                        for e, half in zip(engines, halves)
                    ],
                    timeout=600,
                )
                tokens = sum(len(s["token_ids"]) for out in outs for (s,) in out)
                rates.append(tokens / (time.perf_counter() - start))
            print(f"{threads} thread(s) per engine: {[round(r, 1) for r in rates[1:]]} tok/s", flush=True)
            return max(rates[1:])
        finally:
            for e in engines:
                ray.kill(e)

    one = rate(1)
    every = rate(cores)
    emit(
        {
            "bench": "engine_threads",
            "engines": 2,
            "cores": cores,
            "tok_s_1_thread": one,
            f"tok_s_{cores}_threads": every,
            "ratio_1_over_all": one / every,
        }
    )


if __name__ == "__main__":
    main()

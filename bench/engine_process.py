"""The engine core in its own process against in the engine actor's: the CPU demo's step time and the engines'
resident memory, in one invocation.

Runs the demo's GRPO job (the flags of examples/scripts/demo_cpu.sh: SmolLM2-135M, 8 prompts x 8 samples of up to 32
tokens, one actor rank, one engine) for --steps steps once per mode:
- `in-process`: vLLM's engine core in the engine's Ray actor (VLLM_ENABLE_V1_MULTIPROCESSING=0, the CPU default
  before the engine core moved out);
- `own-process`: vLLM's default, openppo's on every device now.
While a run goes, the resident memory of the engine actor and its child processes (the engine core) is sampled twice
a second. Prints, per mode, the mean step time over steps 2.. (step 1 warms caches) and its stages, the engines' peak
RSS, and the ratios own-process / in-process; the last line is the JSON record with the device.

    .venv/bin/python bench/engine_process.py [--steps 6] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.record import (  # noqa: E402
    REPO,
    add_dtype_option,
    demo_flags,
    demo_prompts,
    emit,
    model_path,
    resolve_dtype,
    steady_means,
)

STAGES = ("timing/step", "timing/generate", "timing/weight_sync", "timing/actor_train", "timing/reward")


def _tree_rss(pid: int) -> int:
    import psutil

    try:
        root = psutil.Process(pid)
        return sum(p.memory_info().rss for p in [root, *root.children(recursive=True)])
    except psutil.Error:
        return 0


def run(mode: str, flags: list[str]) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    if mode == "in-process":
        env["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    else:
        env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)
    proc = subprocess.Popen(
        [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        cwd=REPO,
    )
    peak = {"rss": 0, "pid": None}
    done = threading.Event()

    def sample():
        while not done.wait(0.5):
            if peak["pid"] is not None:
                peak["rss"] = max(peak["rss"], _tree_rss(peak["pid"]))

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    tail = []
    for line in proc.stdout:
        tail = (tail + [line])[-40:]
        found = re.search(r"vLLM engine 0: pid (\d+)", line)
        if found:
            peak["pid"] = int(found.group(1))
    proc.wait()
    done.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{mode} run failed:\n{''.join(tail)}")
    _, out = steady_means(Path(flags[flags.index("--save_path") + 1]), STAGES)
    out["engine_peak_rss_gib"] = peak["rss"] / 2**30
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    add_dtype_option(parser)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    model = model_path("smollm2")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = demo_prompts(Path(tmp))
        for mode in ("in-process", "own-process"):
            start = time.perf_counter()
            results[mode] = run(mode, demo_flags(model, prompts, Path(tmp) / mode, args.steps, dtype))
            results[mode]["wall_s"] = time.perf_counter() - start
            print(mode, json.dumps(results[mode]), flush=True)
    before, after = results["in-process"], results["own-process"]
    ratios = {key: after[key] / before[key] for key in STAGES if key in before and key in after and before[key]}
    ratios["engine_peak_rss_gib_extra"] = after["engine_peak_rss_gib"] - before["engine_peak_rss_gib"]
    emit({"bench": "engine_process", "dtype": dtype, "steps": args.steps, "modes": results, "own_over_in": ratios})


if __name__ == "__main__":
    main()

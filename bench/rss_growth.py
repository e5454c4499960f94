"""Benchmark: does a long run leak host memory? RSS of the driver, the actor rank and the vLLM engine over N steps.

    .venv/bin/python bench/rss_growth.py                  # tiny model, 200 steps
    .venv/bin/python bench/rss_growth.py --steps 50       # a quick look

Runs one `train_ppo_ray` GRPO job (tiny model, 1 actor rank, 1 engine, a checkpoint every 50 steps, rotation
keeping 1). The driver and actor RSS come from the run's own `perf/driver_rss_gib` and `perf/actor_rss_gib`; the
engine's is sampled from outside once per second. For each series: the median of an early window (steps 11-30:
after the warm-ups, allocator pools and first checkpoint have settled) against the median of the last 20 steps,
the least-squares slope over steps 11..N and over its second half (a growth that levels off, as allocator pools and
Ray's own tables settle, has a second-half slope near 0), and the early window's spread (max - min) as the noise
level. A series is flat when its growth is within max(2 x spread, 2 % of its level). The last line printed is one
JSON object, with the device it ran on (CPU model and PyTorch's CPU capability, or the GPU name;
`bench/record.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, resolve_dtype  # noqa: E402 (after the path set-up)

MIB = 2**20
WARM = (11, 30)  # steps of the early window (1-based, inclusive)
LAST = 20


def _engine_rss(root) -> int | None:
    import psutil

    for proc in root.children(recursive=True):
        try:
            if "VLLMEngine" in " ".join(proc.cmdline()):
                return proc.memory_info().rss
        except psutil.Error:
            pass
    return None


def _slope(xs: list[float], ys: list[float]) -> float:
    """Least-squares slope of ys over xs."""
    mx, my = statistics.fmean(xs), statistics.fmean(ys)
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / max(sum((x - mx) ** 2 for x in xs), 1e-9)


def series_verdict(points: list[tuple[int, float]]) -> dict:
    """Growth of one RSS series [(step, MiB)] against its own noise."""
    steps, values = [s for s, _ in points], [v for _, v in points]
    warm = [v for s, v in zip(steps, values) if WARM[0] <= s <= WARM[1]]
    last = values[-LAST:]
    tail = [(s, v) for s, v in zip(steps, values) if s >= WARM[0]]
    xs, ys = [s for s, _ in tail], [v for _, v in tail]
    half = len(xs) // 2
    growth = statistics.median(last) - statistics.median(warm)
    noise = max(warm) - min(warm)
    allowed = max(2 * noise, 0.02 * statistics.median(warm))
    every = max(1, len(points) // 8)  # a coarse view of the whole series
    return {
        "series_mib": {s: round(v, 1) for s, v in points[::every]},
        "early_mib": round(statistics.median(warm), 1),
        "last_mib": round(statistics.median(last), 1),
        "growth_mib": round(growth, 1),
        "noise_mib": round(noise, 1),
        "slope_mib_per_100_steps": round(100 * _slope(xs, ys), 2),
        "second_half_slope_mib_per_100_steps": round(100 * _slope(xs[half:], ys[half:]), 2),
        "flat": growth <= allowed,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--keep_metrics", type=Path, default=None, help="copy the run's metrics.jsonl here")
    add_dtype_option(parser)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # auto -> bf16/fp32 here, named in the record
    if args.steps < WARM[1] + LAST:
        raise SystemExit(
            f"--steps must be >= {WARM[1] + LAST} (an early window of steps {WARM[0]}-{WARM[1]} and "
            f"the last {LAST} steps)"
        )
    import psutil

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests.model_cache import tiny_model_dir

    with tempfile.TemporaryDirectory(prefix="openppo-rss-bench-") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(2 * args.steps, seed=0), workdir / "prompts.jsonl")
        save = workdir / "run"
        flags = [
            "--pretrain",
            str(tiny_model_dir()),
            "--prompt_data",
            str(prompts),
            "--input_key",
            "input",
            "--label_key",
            "label",
            "--apply_chat_template",
            "--remote_rm_url",
            str(REPO / "examples/reward_funcs/arithmetic.py"),
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            "4",
            "--rollout_batch_size",
            "2",
            "--train_batch_size",
            "8",
            "--micro_train_batch_size",
            "4",
            "--packing_samples",
            "--vllm_kv_cache_bytes",
            str(128 << 20),
            "--generate_max_len",
            "16",
            "--prompt_max_len",
            "64",
            "--init_kl_coef",
            "0",
            "--zero_stage",
            "2",
            "--param_dtype",
            args.dtype,
            "--max_steps",
            str(args.steps),
            "--actor_learning_rate",
            "1e-6",
            "--seed",
            "0",
            "--save_steps",
            "50",
            "--max_ckpt_num",
            "1",
            "--ckpt_path",
            str(workdir / "ckpt"),
            "--save_path",
            str(save),
        ]
        env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
        start = time.perf_counter()
        proc = subprocess.Popen(
            [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags],
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        root, engine_samples, done = psutil.Process(proc.pid), [], threading.Event()

        def sample():
            metrics = save / "metrics.jsonl"
            while not done.wait(1.0):
                rss = _engine_rss(root)
                if rss is not None and metrics.exists():  # tagged with the steps finished so far
                    engine_samples.append((len(metrics.read_text().splitlines()), rss / MIB))

        thread = threading.Thread(target=sample, daemon=True)
        thread.start()
        output, _ = proc.communicate(timeout=4 * 3600)
        done.set()
        thread.join()
        if proc.returncode != 0:
            sys.stderr.write(output[-4000:])
            raise SystemExit(f"train_ppo_ray exited with {proc.returncode}")
        records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
        if args.keep_metrics:
            args.keep_metrics.write_text((save / "metrics.jsonl").read_text())
    wall = time.perf_counter() - start
    out = {
        "bench": "rss_growth",
        "dtype": args.dtype,
        "steps": len(records),
        "wall_s": round(wall, 1),
        "step_s": round(statistics.fmean(r["timing/step"] for r in records[1:]), 2),
    }
    for name, key in (("driver", "perf/driver_rss_gib"), ("actor", "perf/actor_rss_gib")):
        out[name] = series_verdict([(r["step"], r[key] * 1024) for r in records])
    per_step: dict[int, list[float]] = {}
    for step, mib in engine_samples:  # samples taken while step `step + 1` ran
        per_step.setdefault(step + 1, []).append(mib)
    out["engine"] = (
        series_verdict([(s, statistics.median(v)) for s, v in sorted(per_step.items())]) if per_step else None
    )
    emit(out)


if __name__ == "__main__":
    main()

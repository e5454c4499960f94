"""On-policy distillation at the CPU demo's size, against GRPO on the same prompts, in one invocation.

1. GRPO: the demo's job (examples/scripts/demo_cpu.sh's flags: SmolLM2-135M, 8 prompts x 8 samples of up to 32
   tokens, the arithmetic reward) for --steps steps. Its trained model is the teacher of 2.
2. Distillation: the same flags and prompts, the untrained SmolLM2-135M as the student, 1.'s model as
   --teacher_pretrain, --distill_task_coef 0 (the arithmetic reward is logged, not trained on).
Prints, per run, the mean step time over steps 2.. (step 1 warms caches) and the share of its stages, the teachers'
share of a distillation step (timing/teacher_logprob, and the old-log-prob pass a teacher turns on), the reward first
-> last and the reverse-KL estimate (train/teacher_kl) first -> last; the last line is the JSON record with the
device.

    .venv/bin/python bench/distillation.py [--steps 10] [--dtype auto]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
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

STAGES = ("timing/step", "timing/generate", "timing/old_logprob", "timing/teacher_logprob", "timing/actor_train")


def run(name: str, flags: list[str]) -> dict:
    env = dict(os.environ, RAY_AUTH_MODE="disabled")
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags],
        env=env,
        capture_output=True,
        text=True,
        cwd=REPO,
    )
    if proc.returncode != 0:
        raise RuntimeError(f"{name} run failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}")
    records, out = steady_means(Path(flags[flags.index("--save_path") + 1]), STAGES)
    for key in ("train/reward", "train/teacher_kl"):
        if key in records[0]:
            out[f"{key} first"], out[f"{key} last"] = records[0][key], records[-1][key]
    out["wall_s"] = time.perf_counter() - start
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=10)
    add_dtype_option(parser)
    args = parser.parse_args()
    dtype = resolve_dtype(args.dtype)
    model = model_path("smollm2")
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        prompts = demo_prompts(Path(tmp))
        teacher = Path(tmp) / "grpo"
        results["grpo"] = run("grpo", demo_flags(model, prompts, teacher, args.steps, dtype))
        print("grpo", json.dumps(results["grpo"]), flush=True)
        flags = demo_flags(model, prompts, Path(tmp) / "distill", args.steps, dtype)
        flags += ["--teacher_pretrain", f"grpo={teacher}", "--distill_task_coef", "0"]
        results["distill"] = run("distill", flags)
        print("distill", json.dumps(results["distill"]), flush=True)
    d = results["distill"]
    shares = {key: d[key] / d["timing/step"] for key in STAGES[1:] if key in d}
    emit(
        {
            "bench": "distillation",
            "dtype": dtype,
            "steps": args.steps,
            "runs": results,
            "distill_step_shares": shares,
            "distill_over_grpo_step": d["timing/step"] / results["grpo"]["timing/step"],
        }
    )


if __name__ == "__main__":
    main()

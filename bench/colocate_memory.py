"""Benchmark: peak memory of a colocated run with and without the sleep flags (--colocate_all_models).

    .venv/bin/python bench/colocate_memory.py                 # tiny model, 3 steps per run
    .venv/bin/python bench/colocate_memory.py --model smollm2

Runs `train_ppo_ray` twice with the same GRPO job, every model on the same device(s): once plain, once with
`--vllm_enable_sleep --deepspeed_enable_sleep`. While each runs, the resident memory of the whole process tree
(driver, Ray workers, vLLM engine) is sampled every 0.2 s; on a GPU box the peak of `nvidia-smi`'s used memory is
sampled as well. The last line printed is one JSON object with both peaks, their difference and the device it ran
on (CPU model and PyTorch's CPU capability, or the GPU name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, resolve_dtype  # noqa: E402 (after the path set-up)

GIB = 2**30


def _tree_rss(root) -> int:
    import psutil

    total = 0
    for proc in [root] + root.children(recursive=True):
        try:
            total += proc.memory_info().rss
        except psutil.Error:  # a process ended between listing and reading
            pass
    return total


def _gpu_used() -> int | None:
    if shutil.which("nvidia-smi") is None:
        return None
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"], capture_output=True, text=True
    ).stdout.split()
    return sum(int(v) for v in out) * 2**20 if out else None


def run(name: str, flags: list[str], workdir: Path) -> dict:
    import psutil

    save = workdir / name
    env = {**os.environ, "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags, "--save_path", str(save)],
        cwd=REPO,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    root, peaks, done = psutil.Process(proc.pid), {"rss": 0, "gpu": 0}, threading.Event()

    def sample():
        # Ray's own daemons (raylet, GCS) are children too: the same in both runs
        while not done.is_set():
            peaks["rss"] = max(peaks["rss"], _tree_rss(root))
            gpu = _gpu_used()
            if gpu is not None:
                peaks["gpu"] = max(peaks["gpu"], gpu)
            time.sleep(0.2)

    thread = threading.Thread(target=sample, daemon=True)
    thread.start()
    output, _ = proc.communicate(timeout=3600)
    done.set()
    thread.join()
    if proc.returncode != 0:
        sys.stderr.write(output[-4000:])
        raise SystemExit(f"{name}: train_ppo_ray exited with {proc.returncode}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    out = {
        "peak_rss_gib": round(peaks["rss"] / GIB, 3),
        "steps": len(records),
        "swap_s": round(sum(r.get("timing/swap", 0.0) for r in records) / len(records), 3),
    }
    if peaks["gpu"]:
        out["peak_gpu_used_gib"] = round(peaks["gpu"] / GIB, 3)
    print(f"{name}: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("tiny", "smollm2"), default="tiny")
    parser.add_argument("--steps", type=int, default=3)
    add_dtype_option(parser)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # auto -> bf16/fp32 here, named in the record

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests.model_cache import smollm2_dir, tiny_model_dir

    model = str(smollm2_dir() if args.model == "smollm2" else tiny_model_dir())
    with tempfile.TemporaryDirectory(prefix="openppo-colocate-bench-") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(4 * args.steps, seed=0), workdir / "prompts.jsonl")
        common = [
            "--pretrain",
            model,
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
            "4",
            "--train_batch_size",
            "16",
            "--micro_train_batch_size",
            "4",
            "--micro_rollout_batch_size",
            "8",
            "--actor_num_gpus_per_node",
            "1",
            "--vllm_num_engines",
            "1",
            "--colocate_all_models",
            "--vllm_kv_cache_bytes",
            str(256 << 20),
            "--generate_max_len",
            "32",
            "--prompt_max_len",
            "128",
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
            "--disable_ds_ckpt",
        ]
        results = {
            "plain": run("plain", common, workdir),
            "sleep": run("sleep", common + ["--vllm_enable_sleep", "--deepspeed_enable_sleep"], workdir),
        }
    out = {
        "bench": "colocate_memory",
        "model": args.model,
        "dtype": args.dtype,
        "steps": args.steps,
        **results,
        "peak_rss_saved_gib": round(results["plain"]["peak_rss_gib"] - results["sleep"]["peak_rss_gib"], 3),
    }
    emit(out)


if __name__ == "__main__":
    main()

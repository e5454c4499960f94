"""What every bench shares: its precision option (auto by default, as in training) and the JSON record it prints
last, which names the device (CPU model and PyTorch's CPU capability, or the GPU), so that figures from different
machines are never compared unknowingly."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
# The benches' models: the real SmolLM2-135M, the suite's tiny random model, and random models of a real shape (the
# Qwen3 tokenizer's 151k vocabulary), built once under .cache/bench/models.
# "qwen0.5b-2l" is its first 2 layers: the same embedding and head (what --lm_head_chunk_tokens changes), a twelfth
# of the body's time.
SHAPES = {
    "qwen0.5b": {"num_layers": 24, "hidden_size": 896, "num_heads": 14, "intermediate_size": 4864},
    "qwen0.5b-2l": {"num_layers": 2, "hidden_size": 896, "num_heads": 14, "intermediate_size": 4864},
}
MODELS = ("qwen0.5b", "qwen0.5b-2l", "smollm2", "tiny")


def add_dtype_option(parser: argparse.ArgumentParser, what: str = "training precision") -> None:
    parser.add_argument(
        "--dtype",
        choices=("auto", "bf16", "fp32"),
        default="auto",
        help=f"{what}; auto = bf16 where the device runs it fast, else fp32 (as --param_dtype auto)",
    )


def resolve_dtype(value: str) -> str:
    """bf16 or fp32: `auto` resolved for this machine."""
    from openppo.utils.hardware import auto_param_dtype

    return auto_param_dtype() if value == "auto" else value


def model_path(name: str) -> str:
    """The folder of bench model `name` (one of MODELS), built or converted on first use."""
    from tests.model_cache import smollm2_dir, tiny_model_dir

    if name in SHAPES:
        from openppo.models.zoo import build_tiny_model

        return str(build_tiny_model(REPO / ".cache" / "bench" / "models" / name, dtype="bfloat16", **SHAPES[name]))
    return str(smollm2_dir() if name == "smollm2" else tiny_model_dir())


def demo_flags(model: str, prompts: Path, save: Path, steps: int, dtype: str) -> list[str]:
    """The `train_ppo_ray` flags of examples/scripts/demo_cpu.sh (GRPO, 8 prompts x 8 samples of up to 32 tokens, one
    actor rank, one engine) for `steps` steps."""
    return (
        f"--pretrain {model} --remote_rm_url {REPO / 'examples/reward_funcs/arithmetic.py'} --prompt_data {prompts} "
        "--input_key input --label_key label --apply_chat_template --advantage_estimator group_norm "
        "--n_samples_per_prompt 8 --init_kl_coef 0 --rollout_batch_size 8 --train_batch_size 64 "
        "--micro_train_batch_size 8 --micro_rollout_batch_size 16 --prompt_max_len 128 --generate_max_len 32 "
        "--temperature 1.0 --actor_num_gpus_per_node 1 --vllm_num_engines 1 --vllm_kv_cache_bytes 1073741824 "
        "--zero_stage 2 --actor_learning_rate 2e-5 --lr_warmup_ratio 0 --lr_scheduler constant --packing_samples "
        f"--enable_prefix_caching --param_dtype {dtype} --max_steps {steps} --save_path {save}"
    ).split()


def demo_prompts(folder: Path) -> Path:
    """The demo's prompts (512 arithmetic tasks, seed 0) written by `make_task` into `folder`."""
    prompts = Path(folder) / "arithmetic.jsonl"
    subprocess.run(
        [sys.executable, "-m", "openppo.cli.make_task", "--task", "arithmetic", "--out", str(prompts)]
        + ["--num_samples", "512", "--seed", "0"],
        check=True,
        cwd=REPO,
    )
    return prompts


def steady_means(save: Path, keys: tuple[str, ...]) -> tuple[list[dict], dict[str, float]]:
    """A run's metrics.jsonl rows, and the mean of each of `keys` over its steps 2.. (step 1 warms caches; all steps
    when there is one), with `steps_averaged`."""
    records = [json.loads(line) for line in (Path(save) / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steady = records[1:] or records
    means = {key: sum(r[key] for r in steady) / len(steady) for key in keys if all(key in r for r in steady)}
    return records, {**means, "steps_averaged": len(steady)}


def emit(record: dict, prefix: str = "") -> None:
    """Print the bench's record as one JSON line, with the device it ran on."""
    from openppo.utils.hardware import device_record

    print(prefix + json.dumps({**record, "device": device_record()}))


def timing_engine(strategy, model, lr: float = 1e-7):
    """A training engine for timing updates: AdamW at a small `lr` on a constant schedule (the tests' own,
    `train_engine`), so that the steps a bench times barely move the weights and every variant it compares computes
    with (nearly) the same ones."""
    from tests.ppo.rank_helpers import train_engine

    return train_engine(strategy, model, lr=lr, steps=1000)


def run_train_ppo(name: str, flags: list[str], save: Path, env: dict[str, str]) -> tuple[str, list[dict], float]:
    """`python -m openppo.cli.train_ppo_ray flags --save_path save` in `env`: its stdout, its metrics.jsonl rows and its
    wall seconds. A failed run prints the end of its output and stops the bench, naming run `name`."""
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags, "--save_path", str(save)],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=3600,
    )
    wall = time.perf_counter() - start
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"{name}: train_ppo_ray exited with {proc.returncode}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return proc.stdout, records, wall

"""Benchmark: the same RL steps with and without --async_train (generation overlapping training), on CPU.

    .venv/bin/python bench/async_train.py               # tiny model, 6 steps each
    .venv/bin/python bench/async_train.py --steps 8 --generate_max_len 384

Runs `openppo.cli.train_ppo_ray` up to three times in this invocation on the tests' tiny model (1 actor rank,
1 vLLM engine, GRPO, packed samples), with the same prompts, seed and flags:
- `sync_1t`: synchronous, 1 thread per process: the engine and the trainer each own one core and take turns, as
  engines and trainer on their own GPUs do (the comparison the async target is about);
- `sync_2t`: synchronous, 2 threads per process: each stage may use both cores of this machine;
- `async_1t`: --async_train --async_queue_size 1, 1 thread per process: both cores busy at once.
`--reward_latency_s S` makes every reward call wait S seconds, as a remote verifier, sandbox or judge model does:
then the rollout (generation + reward) dominates the step, which is the case async training is for. The step
time is `timing/step` from metrics.jsonl (generation included; for async the wait for the next batch),
averaged over steps 2..N (step 1 of an async run has nothing to overlap with). The last line printed is one JSON
object with the per-run numbers, the ratios and the device it ran on (CPU model and PyTorch's CPU capability, or
the GPU name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, resolve_dtype, run_train_ppo  # noqa: E402 (after the path set-up)

SLOW_REWARD = """import time

from openppo.tasks.arithmetic import reward


def reward_func(queries, prompts, labels, **kwargs):
    time.sleep({latency})
    rewards = [reward(q[len(p):], label) for q, p, label in zip(queries, prompts, labels)]
    return {{"rewards": rewards, "scores": rewards}}
"""


def run(name: str, flags: list[str], threads: int, workdir: Path) -> dict:
    save = workdir / name
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    _, records, wall = run_train_ppo(name, flags, save, env)
    later = records[1:]

    def mean(key: str) -> float:
        return round(sum(r.get(key, 0.0) for r in later) / len(later), 3)

    out = {
        "step_s": mean("timing/step"),
        "generate_s": mean("timing/generate"),
        "reward_s": mean("timing/reward"),
        "actor_train_s": mean("timing/actor_train"),
        "old_logprob_s": mean("timing/old_logprob"),
        "wait_rollout_s": mean("timing/wait_rollout"),
        "staleness_max": max(r.get("rollout/staleness_max", 0) for r in records),
        "process_wall_s": round(wall, 1),
        "reward_last": records[-1]["train/reward"],
    }
    print(f"{name}: {out}", flush=True)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rollout_batch_size", type=int, default=1)
    parser.add_argument("--n_samples_per_prompt", type=int, default=2)
    parser.add_argument("--generate_max_len", type=int, default=512)
    parser.add_argument("--runs", default="sync_1t,sync_2t,async_1t")
    parser.add_argument(
        "--reward_latency_s",
        type=float,
        default=0.0,
        help="seconds each reward call waits, as a remote verifier or judge would (0 = none)",
    )
    add_dtype_option(parser)
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # auto -> bf16/fp32 here, named in the record

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests.model_cache import tiny_model_dir

    with tempfile.TemporaryDirectory(prefix="openppo-async-bench-") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(args.rollout_batch_size * (args.steps + 1), seed=0), workdir / "p.jsonl")
        samples = args.rollout_batch_size * args.n_samples_per_prompt
        reward_file = REPO / "examples/reward_funcs/arithmetic.py"
        if args.reward_latency_s > 0:
            reward_file = workdir / "slow_reward.py"
            reward_file.write_text(SLOW_REWARD.format(latency=args.reward_latency_s))
        common = [
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
            str(reward_file),
            "--advantage_estimator",
            "group_norm",
            "--n_samples_per_prompt",
            str(args.n_samples_per_prompt),
            "--rollout_batch_size",
            str(args.rollout_batch_size),
            "--train_batch_size",
            str(samples),
            "--micro_train_batch_size",
            "2",
            "--micro_rollout_batch_size",
            "2",
            "--packing_samples",
            "--actor_num_gpus_per_node",
            "1",
            "--vllm_num_engines",
            "1",
            "--vllm_kv_cache_bytes",
            str(512 << 20),
            "--generate_max_len",
            str(args.generate_max_len),
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
            "1e-5",
            "--seed",
            "0",
            "--disable_ds_ckpt",
        ]
        configs = {
            "sync_1t": ([], 1),
            "sync_2t": ([], 2),
            "async_1t": (["--async_train", "--async_queue_size", "1"], 1),
        }
        results = {
            name: run(name, common + configs[name][0], configs[name][1], workdir) for name in args.runs.split(",")
        }
    out = {
        "bench": "async_train",
        "dtype": args.dtype,
        "steps": args.steps,
        "samples_per_step": samples,
        "generate_max_len": args.generate_max_len,
        "reward_latency_s": args.reward_latency_s,
        **results,
    }
    if "async_1t" in results:
        for base in ("sync_1t", "sync_2t"):
            if base in results:
                out[f"speedup_vs_{base}"] = round(results[base]["step_s"] / results["async_1t"]["step_s"], 2)
    emit(out)


if __name__ == "__main__":
    main()

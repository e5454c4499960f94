"""Benchmark: the same GRPO job with openppo and with TRL's GRPOTrainer, on this machine, in one invocation.

    .venv/bin/python bench/vs_trl.py                     # SmolLM2-135M-Instruct, 8 prompts x 8 samples, 32 tokens
    .venv/bin/python bench/vs_trl.py --model tiny        # tiny random model on the Qwen3 tokenizer (151k vocab)
    .venv/bin/python bench/vs_trl.py --steps 8 --only trl
    .venv/bin/python bench/vs_trl.py --only openppo --async_train   # openppo overlapping generation and update

Both runs get the same model, prompts (the built-in arithmetic task, chat template), group size, response
length, learning rate, beta 0 (no reference model), one optimizer step per RL step over the whole batch, one
epoch, seed, precision (--dtype) and threads. openppo runs `train_ppo_ray` (1 actor rank, ZeRO-0, 1 vLLM engine,
packed samples in micro-batches of --micro rows, prefix caching unless --no-prefix_caching); TRL runs
`GRPOTrainer` in one process (generation with transformers' `generate`, as TRL does without vLLM), the whole batch
as one micro-batch, with GRPOConfig's default gradient checkpointing (TRL's faster setting for this job here;
--no-trl_gradient_checkpointing turns it off; openppo runs without). TRL is installed by this script into its own
environment, `.cache/bench/trl-env`: a venv whose only package is TRL (pinned below), layered on this project's
environment for torch and transformers, so the project environment itself is never changed.

Step time = the mean wall time of steps 2..N (step 1 pays the warm-ups): `timing/step` for openppo, the time
between TRL's step-begin and step-end callbacks for TRL. Reward = mean reward of the last 2 steps. The last line
printed is one JSON object with both runs, the ratio openppo / TRL and the device it ran on (CPU model and
PyTorch's CPU capability, or the GPU name; `bench/record.py`).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from bench.record import add_dtype_option, emit, resolve_dtype  # noqa: E402 (after the path set-up)

TRL_PIN = "trl==1.16.0"
TRL_ENV = REPO / ".cache" / "bench" / "trl-env"

TRL_JOB = r"""
import json, sys, time
import torch
from datasets import Dataset
from transformers import TrainerCallback
from trl import GRPOConfig, GRPOTrainer

from openppo.tasks.arithmetic import reward

cfg = json.loads(sys.argv[1])
torch.set_num_threads(cfg["threads"])
rows = [json.loads(line) for line in open(cfg["prompts"])]
data = Dataset.from_list([{"prompt": [{"role": "user", "content": r["input"]}], "label": r["label"]} for r in rows])


def arithmetic_reward(completions, label, **kwargs):
    return [reward(c[0]["content"], l) for c, l in zip(completions, label)]


class StepTimes(TrainerCallback):
    def __init__(self):
        self.times, self.start = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        self.start = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter() - self.start)


samples = cfg["prompts_per_step"] * cfg["group"]
args = GRPOConfig(output_dir=cfg["out"], per_device_train_batch_size=samples, gradient_accumulation_steps=1,
                  num_generations=cfg["group"], max_completion_length=cfg["max_new_tokens"],
                  learning_rate=cfg["lr"], beta=0.0, num_iterations=1,
                  max_steps=cfg["steps"], temperature=1.0, logging_steps=1, report_to="none", save_strategy="no",
                  use_cpu=not torch.cuda.is_available(), bf16=cfg["dtype"] == "bf16", seed=cfg["seed"],
                  gradient_checkpointing=cfg["gradient_checkpointing"],
                  lr_scheduler_type="constant", shuffle_dataset=False)
times = StepTimes()
trainer = GRPOTrainer(model=cfg["model"], reward_funcs=arithmetic_reward, args=args, train_dataset=data,
                      callbacks=[times])
trainer.train()
rewards = [h["reward"] for h in trainer.state.log_history if "reward" in h]
print("RESULT " + json.dumps({"step_times": times.times, "rewards": rewards}))
"""


def ensure_trl_env() -> Path:
    """A venv holding only TRL, seeing this project's site-packages through a .pth file."""
    python = TRL_ENV / "bin" / "python"
    marker = TRL_ENV / f".{TRL_PIN}"
    if marker.exists():
        return python
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(TRL_ENV)], check=True)
    purelib = Path(sysconfig.get_paths(vars={"base": str(TRL_ENV), "platbase": str(TRL_ENV)})["purelib"])
    purelib.mkdir(parents=True, exist_ok=True)
    (purelib / "openppo_env.pth").write_text(sysconfig.get_paths()["purelib"] + "\n" + str(REPO) + "\n")
    # pip from the project env installs into the TRL env; TRL's dependencies are already in the project env.
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target", str(purelib), TRL_PIN], check=True
    )
    marker.touch()
    return python


def run_trl(args, prompts: Path, model: str, workdir: Path) -> dict:
    python = ensure_trl_env()
    cfg = {
        "model": model,
        "prompts": str(prompts),
        "prompts_per_step": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "lr": args.lr,
        "steps": args.steps,
        "seed": 0,
        "dtype": args.dtype,
        "threads": args.threads,
        "out": str(workdir / "trl"),
        "gradient_checkpointing": args.trl_gradient_checkpointing,
    }
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(args.threads)}
    start = time.perf_counter()
    proc = subprocess.run(
        [str(python), "-c", TRL_JOB, json.dumps(cfg)], cwd=REPO, env=env, capture_output=True, text=True, timeout=7200
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"TRL exited with {proc.returncode}")
    result = json.loads(next(line for line in proc.stdout.splitlines() if line.startswith("RESULT "))[7:])
    return _summary(result["step_times"], result["rewards"], time.perf_counter() - start)


def run_openppo(args, prompts: Path, model: str, workdir: Path) -> dict:
    save = workdir / "openppo"
    samples = args.prompts * args.group
    flags = [
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
        str(args.group),
        "--rollout_batch_size",
        str(args.prompts),
        "--train_batch_size",
        str(samples),
        "--micro_train_batch_size",
        str(args.micro),
        "--micro_rollout_batch_size",
        str(samples),
        "--packing_samples",
        "--actor_num_gpus_per_node",
        "1",
        "--vllm_num_engines",
        "1",
        "--vllm_kv_cache_bytes",
        str(1 << 30),
        "--generate_max_len",
        str(args.max_new_tokens),
        "--prompt_max_len",
        "128",
        "--init_kl_coef",
        "0",
        "--zero_stage",
        "0",
        "--param_dtype",
        args.dtype,
        "--max_steps",
        str(args.steps),
        "--actor_learning_rate",
        str(args.lr),
        "--lr_scheduler",
        "constant",
        "--seed",
        "0",
        "--disable_ds_ckpt",
        "--save_path",
        str(save),
    ]
    if args.prefix_caching:  # the 8 samples of a prompt share its KV blocks
        flags.append("--enable_prefix_caching")
    flags += args.openppo_args.split()
    if args.async_train:  # generation of step k+1 overlaps the update of step k (one step off-policy)
        flags.append("--async_train")
    env = {**os.environ, "OMP_NUM_THREADS": str(args.threads), "RAY_AUTH_MODE": "disabled", "HF_HUB_OFFLINE": "1"}
    start = time.perf_counter()
    proc = subprocess.run(
        [sys.executable, "-m", "openppo.cli.train_ppo_ray", *flags],
        cwd=REPO,
        env=env,
        capture_output=True,
        text=True,
        timeout=7200,
    )
    if proc.returncode != 0:
        sys.stderr.write(proc.stdout[-4000:] + proc.stderr[-4000:])
        raise SystemExit(f"openppo exited with {proc.returncode}")
    records = [json.loads(line) for line in (save / "metrics.jsonl").read_text().splitlines() if line.strip()]
    rewards = [r["train/reward"] for r in records]
    out = _summary([r["timing/step"] for r in records], rewards, time.perf_counter() - start)
    later = records[1:] or records
    out["stages_s"] = {
        k.removeprefix("timing/"): round(sum(r.get(k, 0.0) for r in later) / len(later), 2)
        for k in sorted({k for r in later for k in r if k.startswith("timing/")})
    }
    return out


def _summary(step_times: list[float], rewards: list[float], wall: float) -> dict:
    later = step_times[1:] or step_times
    return {
        "steps": len(step_times),
        "step_s": round(sum(later) / len(later), 2),
        "step_times_s": [round(t, 2) for t in step_times],
        "reward_first": round(rewards[0], 3),
        "reward_last2": round(sum(rewards[-2:]) / len(rewards[-2:]), 3),
        "process_wall_s": round(wall, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=("smollm2", "tiny"), default="smollm2")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--prompts", type=int, default=8, help="prompts per step")
    parser.add_argument("--group", type=int, default=8, help="samples per prompt")
    parser.add_argument("--max_new_tokens", type=int, default=32)
    parser.add_argument("--lr", type=float, default=1e-6)
    parser.add_argument(
        "--micro", type=int, default=16, help="openppo's training micro-batch (rows); TRL trains the whole batch as one"
    )
    parser.add_argument(
        "--prefix_caching",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="openppo with --enable_prefix_caching",
    )
    parser.add_argument("--openppo_args", default="", help="more train_ppo_ray flags for openppo (A/B runs)")
    add_dtype_option(parser, "both trainers' precision")
    parser.add_argument(
        "--trl_gradient_checkpointing",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="TRL with gradient checkpointing, GRPOConfig's default and TRL's faster setting on this "
        "CPU job (see docs/benchmarks.md)",
    )
    parser.add_argument("--threads", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--only", choices=("openppo", "trl"), default=None)
    parser.add_argument(
        "--async_train",
        action="store_true",
        help="openppo with --async_train: no longer the same on-policy job (reported as such)",
    )
    args = parser.parse_args()
    args.dtype = resolve_dtype(args.dtype)  # TRL gets the same concrete dtype as openppo

    from openppo.tasks.arithmetic import make_rows, write_jsonl
    from tests.model_cache import smollm2_dir, tiny_model_dir

    model = str(smollm2_dir() if args.model == "smollm2" else tiny_model_dir())
    results = {}
    with tempfile.TemporaryDirectory(prefix="openppo-vs-trl-") as tmp:
        workdir = Path(tmp)
        prompts = write_jsonl(make_rows(args.prompts * args.steps, seed=0), workdir / "prompts.jsonl")
        for name, fn in (("openppo", run_openppo), ("trl", run_trl)):
            if args.only in (None, name):
                results[name] = fn(args, prompts, model, workdir)
                print(f"{name}: {results[name]}", flush=True)
    out = {
        "bench": "vs_trl",
        "model": args.model,
        "async_train": args.async_train,
        "steps": args.steps,
        "prompts": args.prompts,
        "group": args.group,
        "max_new_tokens": args.max_new_tokens,
        "dtype": args.dtype,
        "threads": args.threads,
        "micro": args.micro,
        "trl_gradient_checkpointing": args.trl_gradient_checkpointing,
        "prefix_caching": args.prefix_caching,
        "openppo_args": args.openppo_args,
        "trl": TRL_PIN,
        **results,
    }
    if len(results) == 2:
        out["step_time_ratio_openppo_over_trl"] = round(results["openppo"]["step_s"] / results["trl"]["step_s"], 2)
    emit(out)


if __name__ == "__main__":
    main()

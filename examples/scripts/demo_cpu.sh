#!/usr/bin/env bash
# The embedded default (`make demo`): GRPO on the real SmolLM2-135M-Instruct with the built-in arithmetic task,
# vLLM rollouts, a DeepSpeed actor, on CPU. Each group's prompt is computed once: in the update by packed rows
# (--share_prompt_in_group auto), in generation by the engine's prefix cache. The update runs the step's 64 rows as
# token-filled micro-batches (--use_dynamic_batch: one of about 5k tokens here, where 8-row ones made 8), as the run
# summary advised: 0.80x the update's time with bf16 on an AVX512_BF16 CPU, 0.69x with fp32 under AVX2 kernels, for
# about twice the actor's resident memory (up to 8.6 GiB against 3.8 with fp32; docs/benchmarks.md). Override OUT /
# PY / STEPS from the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
STEPS=${STEPS:-15}
MODEL=${MODEL:-.cache/models/smollm2}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

$PY -m openppo.cli.models smollm2 --out "$MODEL"
$PY -m openppo.cli.make_task --task arithmetic --out "$OUT/arithmetic.jsonl" --num_samples 512 --seed 0

$PY -m openppo.cli.train_ppo_ray \
   --pretrain "$MODEL" \
   --remote_rm_url examples/reward_funcs/arithmetic.py \
   --prompt_data "$OUT/arithmetic.jsonl" --input_key input --label_key label --apply_chat_template \
   --advantage_estimator group_norm --n_samples_per_prompt 8 --init_kl_coef 0 \
   --rollout_batch_size 8 --train_batch_size 64 \
   --prompt_max_len 128 --generate_max_len 32 --temperature 1.0 \
   --actor_num_gpus_per_node 1 --vllm_num_engines 1 --vllm_kv_cache_bytes 1073741824 \
   --zero_stage 2 --actor_learning_rate 2e-5 --lr_warmup_ratio 0 --lr_scheduler constant \
   --packing_samples --use_dynamic_batch --enable_prefix_caching \
   --max_steps "$STEPS" --save_path "$OUT/grpo" --use_tensorboard "$OUT/tensorboard"

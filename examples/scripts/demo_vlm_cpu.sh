#!/usr/bin/env bash
# `make demo-vlm`: vision-language GRPO on CPU, with a reward that rises because the policy learns to look.
# The built-in shapes task (a 56-pixel picture of 1 to 4 shapes, "How many shapes are in the picture?") trains the
# zoo's tiny Idefics3 VLM (SmolVLM's architecture, 0.7 M parameters, random) built with the answers 1..4 favoured:
# the fresh model says one of them, uniformly, so its reward starts at chance (0.25) and can rise only by counting.
# One-token answers (--generate_max_len 1); the vision tower stays frozen (a random tower's features already
# carry the count; training it too learned slower); fp32 whatever the CPU, since the model is tiny.
# Override OUT / PY / STEPS from the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo_vlm}
STEPS=${STEPS:-100}
MODEL=${MODEL:-.cache/models/tiny-vlm-count}
export RAY_AUTH_MODE=${RAY_AUTH_MODE:-disabled}

$PY -m openppo.cli.models tiny-vlm --out "$MODEL" --tokenizer qwen3-8k --answers 1,2,3,4
$PY -m openppo.cli.make_task --task shapes --out "$OUT/shapes.jsonl" --num_samples 4096 --seed 0 --max_shapes 4

$PY -m openppo.cli.train_ppo_ray \
   --pretrain "$MODEL" \
   --remote_rm_url examples/reward_funcs/arithmetic.py \
   --prompt_data "$OUT/shapes.jsonl" --input_key prompt --label_key label --apply_chat_template \
   --image_key images --max_images_per_prompt 1 --freeze_visual_encoder \
   --advantage_estimator group_norm --n_samples_per_prompt 8 --init_kl_coef 0 \
   --rollout_batch_size 32 --train_batch_size 256 --micro_train_batch_size 64 --micro_rollout_batch_size 32 \
   --prompt_max_len 64 --generate_max_len 1 --temperature 1.0 \
   --actor_num_gpus_per_node 1 --vllm_num_engines 1 --vllm_kv_cache_bytes 268435456 \
   --zero_stage 2 --param_dtype fp32 --actor_learning_rate 5e-4 --lr_warmup_ratio 0 --lr_scheduler constant \
   --max_steps "$STEPS" --save_path "$OUT/grpo" --use_tensorboard "$OUT/tensorboard"

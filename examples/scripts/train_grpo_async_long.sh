#!/usr/bin/env bash
# Long-response GRPO with the throughput options: async generation, packed rows, token budgets, ring attention.
#
# Trains: Qwen2.5-7B-Instruct on the built-in arithmetic task with examples/reward_funcs/arithmetic.py (1 when the
# last number of the response is the answer), allowing responses of up to 8192 tokens.
# Layout: 1 node, 8 x 80 GB GPUs, not colocated, so generation and training overlap (--async_train):
#   4 GPUs train the actor (ZeRO-3) with the reference on the same 4 (--colocate_actor_ref);
#   4 GPUs hold 4 vLLM engines (TP 1) that generate batch k+1 while batch k trains. Samples are at most one weight
#   version old (--async_queue_size 1) and importance-weighted (tis).
# Throughput:
#   --packing_samples: no padding is computed;
#   --use_dynamic_batch: micro-batches of up to 16k tokens for training, 32k for the forward-only passes;
#   --ring_attn_size 2: each packed row is split over 2 GPUs, so a 8k-token response needs half the activation
#     memory per GPU (2 ring groups = 2 data-parallel ranks).
# Time per step and memory were not measured (no GPU where this was written); docs/benchmarks.md has the CPU
# measurements of each option.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/arithmetic_train.jsonl}
SAVE=${SAVE:-runs/grpo_async_long}

[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$PROMPTS" \
   --num_samples 20000 --seed 0 --max_operand 999 --ops '+-*'

python -m openppo.cli.train_ppo_ray \
   --pretrain "$MODEL" --remote_rm_url examples/reward_funcs/arithmetic.py \
   --actor_num_nodes 1 --actor_num_gpus_per_node 4 --ref_num_nodes 1 --ref_num_gpus_per_node 4 \
   --colocate_actor_ref --vllm_num_engines 4 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.85 \
   --enable_prefix_caching --async_train --async_queue_size 1 \
   --packing_samples --use_dynamic_batch --train_max_tokens_per_gpu 16384 --rollout_max_tokens_per_gpu 32768 \
   --ring_attn_size 2 --ring_head_stride 1 \
   --prompt_data "$PROMPTS" --input_key input --label_key label --apply_chat_template \
   --prompt_max_len 256 --generate_max_len 8192 \
   --advantage_estimator group_norm --n_samples_per_prompt 8 \
   --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k3 --loss_agg_mode token-mean \
   --rollout_batch_size 32 --micro_rollout_batch_size 8 --temperature 1.0 \
   --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1 \
   --actor_learning_rate 1e-6 --lr_warmup_ratio 0 --lr_scheduler constant \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --save_steps 20 --max_ckpt_num 3 --load_checkpoint \
   --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"

#!/usr/bin/env bash
# On-policy distillation, optionally with a verifiable reward: the student samples, the teacher scores every sampled
# token, and the advantage of each token is log pi_teacher - log pi_student (docs/algorithms.md, "On-policy
# distillation"), plus TASK_COEF x the GRPO advantage of the arithmetic reward.
#
# Trains: Qwen2.5-1.5B-Instruct (student) from Qwen2.5-7B-Instruct (teacher; the same tokenizer, which openppo
# checks before anything starts) on the built-in arithmetic task (operands up to 999, written by make_task on first
# use). TASK_COEF=0 is distillation alone: the reward is still computed and logged (train/reward), not trained on.
# Watch train/teacher_kl fall: the reverse-KL estimate on the student's own samples, in nats per token.
# Hardware: 1 node, 8 x 80 GB GPUs; actor, teacher and 8 vLLM engines (TP 1) share all 8 (--colocate_all_models).
# Memory per GPU, estimated from parameter counts (not measured): the student's 1.5 B parameters at 16 bytes each
# over 8 ZeRO-3 ranks = ~3 GB; the teacher's 7.6 B in bf16 over 8 ZeRO-3 ranks = ~2 GB, its parameters offloaded to
# CPU between forwards (--ref_reward_offload); each engine a full bf16 copy of the student (3 GB) plus KV cache
# within --vllm_gpu_memory_utilization 0.6. Time per step was not measured (no GPU where this was written).
# Several teachers: --teacher_pretrain math=DIR1 code=DIR2 --teacher_key task, with a "task" column in the prompts.
set -euo pipefail
cd "$(dirname "$0")/../.."
STUDENT=${STUDENT:-Qwen/Qwen2.5-1.5B-Instruct}
TEACHER=${TEACHER:-Qwen/Qwen2.5-7B-Instruct}
TASK_COEF=${TASK_COEF:-0.5}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/arithmetic_train.jsonl}
SAVE=${SAVE:-runs/distill_arithmetic}

[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$PROMPTS" \
   --num_samples 20000 --seed 0 --max_operand 999 --ops '+-*'

python -m openppo.cli.train_ppo_ray \
   --pretrain "$STUDENT" --teacher_pretrain "$TEACHER" --distill_task_coef "$TASK_COEF" \
   --remote_rm_url examples/reward_funcs/arithmetic.py \
   --actor_num_nodes 1 --actor_num_gpus_per_node 8 --teacher_num_nodes 1 --teacher_num_gpus_per_node 8 \
   --colocate_all_models --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.6 \
   --vllm_enable_sleep --deepspeed_enable_sleep --enable_prefix_caching --ref_reward_offload \
   --prompt_data "$PROMPTS" --input_key input --label_key label --apply_chat_template \
   --prompt_max_len 256 --generate_max_len 1024 \
   --advantage_estimator group_norm --n_samples_per_prompt 4 --init_kl_coef 0 --loss_agg_mode token-mean \
   --rollout_batch_size 64 --micro_rollout_batch_size 16 --temperature 1.0 \
   --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1 \
   --actor_learning_rate 1e-6 --lr_warmup_ratio 0 --lr_scheduler constant \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"

#!/usr/bin/env bash
# GRPO behind an agent that speaks the OpenAI API: examples/agents/openai_calculator.py gives the policy a calculate
# tool, runs its tool calls and returns the reward. The run serves the vLLM engines to it on 127.0.0.1 (one session,
# and base URL, per episode; docs/agents.md) and trains on exactly the tokens the engines generated: a call whose
# prompt does not extend the episode's tokens so far starts a new row (rollout/agent_sealed), never re-tokenised.
#
# Trains: Qwen2.5-1.5B-Instruct (Hermes tool calls: --agent_tool_parser hermes) on the built-in arithmetic task.
# 64 prompts x 8 episodes = 512 sessions a step, at most 256 at once (--agent_concurrency); an episode that takes
# longer than --agent_timeout is dropped with its group (rollout/agent_dropped) and others are drawn.
# Hardware: 1 node, 8 x 80 GB GPUs; actor and 8 vLLM engines share them (--colocate_all_models). Memory and time per
# step were not measured (no GPU where this was written).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/arithmetic_train.jsonl}
SAVE=${SAVE:-runs/agent_openai_arithmetic}

[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$PROMPTS" \
   --num_samples 20000 --seed 0 --max_operand 999 --ops '+-*'

python -m openppo.cli.train_ppo_ray \
   --pretrain "$MODEL" \
   --agent_program examples/agents/openai_calculator.py --agent_tool_parser hermes \
   --agent_timeout 300 --agent_concurrency 256 \
   --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
   --colocate_all_models --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.6 \
   --vllm_enable_sleep --deepspeed_enable_sleep --enable_prefix_caching \
   --prompt_data "$PROMPTS" --input_key input --label_key label \
   --prompt_max_len 3072 --generate_max_len 512 \
   --advantage_estimator group_norm --n_samples_per_prompt 8 --init_kl_coef 0 --loss_agg_mode token-mean \
   --rollout_batch_size 64 --micro_rollout_batch_size 16 --temperature 1.0 \
   --train_batch_size 512 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1 \
   --actor_learning_rate 1e-6 --lr_warmup_ratio 0 --lr_scheduler constant \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"

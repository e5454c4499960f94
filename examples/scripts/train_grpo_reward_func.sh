#!/usr/bin/env bash
# GRPO with a rule reward (a .py reward_func) and DAPO's tricks, on the hybrid engine of one node.
#
# Trains: Qwen2.5-7B-Instruct on the built-in arithmetic task (a + b, a - b, a * b with operands up to 999, written
# by make_task on first use). examples/reward_funcs/arithmetic.py gives 1 when the last number of the response is
# the answer, else 0.
# Algorithm: group_norm advantages over 8 samples per prompt; KL to the reference as a loss term (k3, as in GRPO);
# from DAPO: clip-higher (--eps_clip_low_high 0.2 0.28), a soft penalty on responses that run into the last 256
# tokens before --generate_max_len, and dynamic sampling (a group whose 8 rewards are all 0 or all 1 has zero
# advantage, so it is dropped and replaced by new prompts), with token-mean loss aggregation.
# Eval: pass@1 and pass@4 on held-out prompts every $EVAL_STEPS steps. Checkpoints every $SAVE_STEPS steps under
# $CKPT; running this script again resumes from the latest one (--load_checkpoint) with the same data order.
# Hardware: 1 node, 8 x 80 GB GPUs; actor, reference and 8 vLLM engines (TP 1) share all 8 (--colocate_all_models).
# Memory per GPU, estimated from parameter counts (not measured): the actor's 7.6 B parameters at 16 bytes each
# (bf16 weights and gradients, fp32 master weights and Adam moments) over 8 ZeRO-3 ranks = ~15 GB, ~13 GB of it on
# CPU while vLLM generates (--deepspeed_enable_sleep; ~110 GB of host RAM for the node); reference ~2 GB; each
# engine a full bf16 copy (15 GB) plus KV cache within --vllm_gpu_memory_utilization 0.6 (48 GB), released while
# DeepSpeed trains (--vllm_enable_sleep). Time per step was not measured (no GPU where this was written): a step
# generates 64 x 8 = 512 responses of up to 1024 tokens (more when dynamic sampling refills).
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/arithmetic_train.jsonl}
EVAL_PROMPTS=${EVAL_PROMPTS:-$DATA_DIR/arithmetic_eval.jsonl}
SAVE=${SAVE:-runs/grpo_arithmetic}
CKPT=${CKPT:-$SAVE/checkpoints}
EVAL_STEPS=${EVAL_STEPS:-10}
SAVE_STEPS=${SAVE_STEPS:-20}

# Seeded, so a resumed run sees the same prompts; the eval set uses another seed.
[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$PROMPTS" \
   --num_samples 20000 --seed 0 --max_operand 999 --ops '+-*'
[[ -f "$EVAL_PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$EVAL_PROMPTS" \
   --num_samples 500 --seed 1 --max_operand 999 --ops '+-*'

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config. Flags that are openppo's own (--prompt_max_len,
# --loss_agg_mode) have one spelling.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --actor.model_name_or_path "$MODEL" --reward.remote_url examples/reward_funcs/arithmetic.py
      --actor.num_nodes 1 --actor.num_gpus_per_node 8 --ref.num_nodes 1 --ref.num_gpus_per_node 8
      --train.colocate_all --vllm.num_engines 8 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6
      --vllm.enable_sleep --ds.enable_sleep --vllm.enable_prefix_caching
      --data.prompt_dataset "$PROMPTS" --data.input_key input --data.label_key label --data.apply_chat_template
      --prompt_max_len 256 --rollout.max_new_tokens 1024
      --eval.dataset "$EVAL_PROMPTS" --eval.steps "$EVAL_STEPS" --eval.n_samples_per_prompt 4 --eval.temperature 0.6
      --algo.advantage.estimator group_norm --rollout.n_samples_per_prompt 8
      --algo.kl.init_coef 1e-3 --algo.kl.use_loss --algo.kl.estimator k3
      --actor.eps_clip_low_high 0.2 0.28 --reward.overlong_buffer_len 256 --reward.overlong_penalty_factor 1.0
      --algo.dynamic_filtering_enable --algo.dynamic_filtering_range 0 1 --loss_agg_mode token-mean
      --rollout.batch_size 64 --rollout.micro_batch_size 16 --rollout.temperature 1.0
      --train.batch_size 256 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1
      --actor.adam.lr 1e-6 --actor.lr_warmup_ratio 0 --actor.lr_scheduler constant
      --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
      --actor.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --ckpt.path "$CKPT" --ckpt.save_steps "$SAVE_STEPS" --ckpt.max_num 3
      --ckpt.load_enable --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE/tensorboard"
   )
else
   ARGS=(
      --pretrain "$MODEL" --remote_rm_url examples/reward_funcs/arithmetic.py
      --actor_num_nodes 1 --actor_num_gpus_per_node 8 --ref_num_nodes 1 --ref_num_gpus_per_node 8
      --colocate_all_models --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.6
      --vllm_enable_sleep --deepspeed_enable_sleep --enable_prefix_caching
      --prompt_data "$PROMPTS" --input_key input --label_key label --apply_chat_template
      --prompt_max_len 256 --generate_max_len 1024
      --eval_dataset "$EVAL_PROMPTS" --eval_steps "$EVAL_STEPS" --eval_n_samples_per_prompt 4 --eval_temperature 0.6
      --advantage_estimator group_norm --n_samples_per_prompt 8
      --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k3
      --eps_clip_low_high 0.2 0.28 --overlong_buffer_len 256 --overlong_penalty_factor 1.0
      --dynamic_filtering --dynamic_filtering_reward_range 0 1 --loss_agg_mode token-mean
      --rollout_batch_size 64 --micro_rollout_batch_size 16 --temperature 1.0
      --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1
      --actor_learning_rate 1e-6 --lr_warmup_ratio 0 --lr_scheduler constant
      --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing
      --save_path "$SAVE" --ckpt_path "$CKPT" --save_steps "$SAVE_STEPS" --max_ckpt_num 3 --load_checkpoint
      --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"
   )
fi
python -m openppo.cli.train_ppo_ray "${ARGS[@]}"

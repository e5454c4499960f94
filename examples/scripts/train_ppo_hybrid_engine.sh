#!/usr/bin/env bash
# PPO with a critic (GAE) and a reward model on the hybrid engine: actor, critic, reference, reward model and
# 4 vLLM engines of tensor-parallel size 2 (seed 004's layout) all share the 8 GPUs of one node
# (--colocate_all_models): worker w of engine i runs on the GPU of actor rank 2i + w. vLLM sleeps (drops its weights
# and KV cache) while DeepSpeed trains; DeepSpeed moves its optimizer and gradient states to CPU while vLLM
# generates (--deepspeed_enable_sleep).
#
# Models: a Llama-3-8B-class SFT model (train_sft.sh) and reward model (train_rm.sh, which stores the score
# mean/std that --normalize_reward uses); the critic starts from the reward model.
# Prompts: a local file or save_to_disk folder whose $INPUT_KEY column holds a string or chat messages.
# Hardware: 1 node, 8 x 80 GB GPUs (A100/H100), about 250 GB of free host RAM for the sleeping optimizer states.
# Memory per GPU, estimated from parameter counts (not measured): ZeRO-3 shards the actor (8.0 B parameters) and
# the critic (7.5 B, no LM head) over 8 ranks at 16 bytes per parameter (bf16 weights and gradients, fp32 master
# weights and Adam moments): ~16 + ~15 GB, of which the optimizer and gradient states (14 of the 16 bytes) sleep
# on CPU during generation. Reference and reward model are bf16 shards of ~2 GB each. Each vLLM worker holds half
# of a bf16 copy (8 GB) and its KV cache within --vllm_gpu_memory_utilization 0.5 (40 GB). So ~35 GB + activations
# while training, ~8 + 40 GB while generating. Time per step was not measured (no GPU where this recipe was
# written): each step generates 128 responses of up to 1024 tokens, then trains actor and critic on them.
set -euo pipefail
cd "$(dirname "$0")/../.."
SFT_MODEL=${SFT_MODEL:-runs/sft}
REWARD_MODEL=${REWARD_MODEL:-runs/rm}
PROMPTS=${PROMPTS:-data/prompts.jsonl}
INPUT_KEY=${INPUT_KEY:-input}
SAVE=${SAVE:-runs/ppo_hybrid}

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --actor.model_name_or_path "$SFT_MODEL" --reward.model_name_or_path "$REWARD_MODEL" --reward.normalize_enable
      --actor.num_nodes 1 --actor.num_gpus_per_node 8 --critic.num_nodes 1 --critic.num_gpus_per_node 8
      --ref.num_nodes 1 --ref.num_gpus_per_node 8 --reward.num_nodes 1 --reward.num_gpus_per_node 8
      --train.colocate_all --vllm.num_engines 4 --vllm.tensor_parallel_size 2 --vllm.gpu_memory_utilization 0.5
      --vllm.enable_sleep --ds.enable_sleep
      --data.prompt_dataset "$PROMPTS" --data.input_key "$INPUT_KEY" --data.apply_chat_template
      --prompt_max_len 1024 --rollout.max_new_tokens 1024
      --algo.advantage.estimator gae --algo.advantage.gamma 1.0 --algo.advantage.lambd 0.95
      --algo.kl.init_coef 0.01 --algo.kl.estimator k1
      --rollout.batch_size 128 --rollout.n_samples_per_prompt 1 --rollout.micro_batch_size 8
      --train.batch_size 64 --train.micro_batch_size 4 --train.max_epochs 1 --train.num_episodes 1
      --actor.adam.lr 5e-7 --critic.adam.lr 9e-6 --actor.lr_warmup_ratio 0.03 --critic.lr_warmup_ratio 0.03
      --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
      --actor.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE/tensorboard"
   )
else
   ARGS=(
      --pretrain "$SFT_MODEL" --reward_pretrain "$REWARD_MODEL" --normalize_reward
      --actor_num_nodes 1 --actor_num_gpus_per_node 8 --critic_num_nodes 1 --critic_num_gpus_per_node 8
      --ref_num_nodes 1 --ref_num_gpus_per_node 8 --reward_num_nodes 1 --reward_num_gpus_per_node 8
      --colocate_all_models --vllm_num_engines 4 --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.5
      --vllm_enable_sleep --deepspeed_enable_sleep
      --prompt_data "$PROMPTS" --input_key "$INPUT_KEY" --apply_chat_template
      --prompt_max_len 1024 --generate_max_len 1024
      --advantage_estimator gae --gamma 1.0 --lambd 0.95 --init_kl_coef 0.01 --kl_estimator k1
      --rollout_batch_size 128 --n_samples_per_prompt 1 --micro_rollout_batch_size 8
      --train_batch_size 64 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1
      --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --lr_warmup_ratio 0.03
      --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing
      --save_path "$SAVE" --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"
   )
fi
python -m openppo.cli.train_ppo_ray "${ARGS[@]}"

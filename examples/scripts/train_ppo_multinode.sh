#!/usr/bin/env bash
# PPO with a critic (GAE) and a reward model on a 2-node Ray cluster (2 x 8 GPUs), submitted with `ray job submit`.
#
# Set up the cluster first (the same Python environment on both nodes):
#   node 1:  ray start --head --port 6379 --dashboard-host 0.0.0.0 --num-gpus 8
#   node 2:  ray start --address <node-1-ip>:6379 --num-gpus 8
#   node 1:  bash examples/scripts/train_ppo_multinode.sh   (ray status should list 16 GPUs)
# The job ships this repository (--working-dir ., files in .gitignore left out) and starts the driver on the head
# node; models, prompts and $SAVE must therefore be absolute paths on storage that both nodes see ($SHARED).
#
# Layout (16 GPUs): actor 1 x 8 with the reference on the same GPUs (--colocate_actor_ref), critic 1 x 4 with the
# reward model on the same GPUs (--colocate_critic_reward), and 2 vLLM engines with tensor parallel size 2 (4 GPUs).
# Keeping each DeepSpeed group inside one node keeps its ZeRO-3 traffic on NVLink; the weight sync to the engines
# crosses nodes over NCCL. On 4 nodes, ACTOR_NODES=2 CRITIC_GPUS=8 VLLM_ENGINES=4 gives actor 2 x 8, critic 1 x 8
# and 4 engines x TP 2 (32 GPUs).
# Models: a Llama-3-8B-class SFT model (train_sft.sh) and reward model (train_rm.sh); the critic starts from the
# reward model. Memory per GPU, estimated from parameter counts (not measured): actor 8.0 B parameters x 16 bytes
# (bf16 weights and gradients, fp32 master weights and Adam moments) / 8 ZeRO-3 ranks = ~16 GB + reference bf16
# shard ~2 GB; critic 7.5 B x 16 / 4 = ~30 GB + reward-model shard ~4 GB; engines 8 GB of weights per GPU (TP 2)
# plus KV cache within --vllm_gpu_memory_utilization 0.9 of an 80 GB GPU. Time per step was not measured.
# Tested: this script has not run on GPUs. Its multi-node path (a job joining a Ray cluster of two nodes, with ranks,
# engines, the ZeRO-3 collectives and the weight sync spanning them, and a checkpoint resumed from shared storage)
# runs in CI on two Ray nodes of one CPU box, each with an IP address of its own (tests/ppo/test_two_nodes.py,
# docs/platform.md "Several nodes"), and so does its fault handling: the same test kills an engine (replaced in the
# run, --max_engine_restarts, default 3) and an actor rank (the job resumes from its last checkpoint by itself,
# --max_rank_restarts 2 here) on the second node (docs/reliability.md). If the nodes' hostnames do not resolve to
# their addresses on the link between them, start each node's Ray with NCCL_SOCKET_IFNAME / GLOO_SOCKET_IFNAME set
# to that link's interface.
set -euo pipefail
cd "$(dirname "$0")/../.."
RAY_DASHBOARD=${RAY_DASHBOARD:-http://127.0.0.1:8265}
SHARED=${SHARED:-/mnt/shared}
SFT_MODEL=${SFT_MODEL:-$SHARED/models/llama3-8b-sft}
REWARD_MODEL=${REWARD_MODEL:-$SHARED/models/llama3-8b-rm}
PROMPTS=${PROMPTS:-$SHARED/data/prompts.jsonl}
INPUT_KEY=${INPUT_KEY:-input}
SAVE=${SAVE:-$SHARED/runs/ppo_multinode}
ACTOR_NODES=${ACTOR_NODES:-1}
ACTOR_GPUS=${ACTOR_GPUS:-8}
CRITIC_GPUS=${CRITIC_GPUS:-4}
VLLM_ENGINES=${VLLM_ENGINES:-2}

# The reference shares the actor's GPUs and the reward model the critic's, so their sizes must match.
ray job submit --address "$RAY_DASHBOARD" --working-dir . -- \
   python -m openppo.cli.train_ppo_ray \
   --pretrain "$SFT_MODEL" --reward_pretrain "$REWARD_MODEL" --normalize_reward \
   --actor_num_nodes "$ACTOR_NODES" --actor_num_gpus_per_node "$ACTOR_GPUS" \
   --ref_num_nodes "$ACTOR_NODES" --ref_num_gpus_per_node "$ACTOR_GPUS" --colocate_actor_ref \
   --critic_num_nodes 1 --critic_num_gpus_per_node "$CRITIC_GPUS" \
   --reward_num_nodes 1 --reward_num_gpus_per_node "$CRITIC_GPUS" --colocate_critic_reward \
   --vllm_num_engines "$VLLM_ENGINES" --vllm_tensor_parallel_size 2 --vllm_gpu_memory_utilization 0.9 \
   --vllm_sync_backend nccl \
   --prompt_data "$PROMPTS" --input_key "$INPUT_KEY" --apply_chat_template \
   --prompt_max_len 1024 --generate_max_len 1024 \
   --advantage_estimator gae --gamma 1.0 --lambd 0.95 --init_kl_coef 0.01 --kl_estimator k1 \
   --rollout_batch_size 256 --n_samples_per_prompt 1 --micro_rollout_batch_size 8 \
   --train_batch_size 128 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1 \
   --actor_learning_rate 5e-7 --critic_learning_rate 9e-6 --lr_warmup_ratio 0.03 \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --save_steps 50 --max_ckpt_num 2 --load_checkpoint --max_rank_restarts 2 \
   --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"

#!/usr/bin/env bash
# REINFORCE++-baseline with rewards over HTTP: the script starts `python -m openppo.cli.serve_rm` in the
# background (serving examples/reward_funcs/arithmetic.py on 127.0.0.1:$RM_PORT), waits for its ready line,
# trains against it, and stops it on exit, whether training succeeded or not.
#
# Trains: Qwen2.5-7B-Instruct on the built-in arithmetic task (written by make_task on first use).
# Algorithm: advantage = reward - mean reward of the prompt's 4 samples, whitened over the batch
# (docs/algorithms.md); KL to the reference as a loss term (k2).
# Hardware: 1 node, 8 x 80 GB GPUs, generation and training on separate GPUs (no sleep, no offload): 4 GPUs hold
# the actor (ZeRO-3, 4 ranks) and the reference (--colocate_actor_ref puts rank i of both on the same GPU), the
# other 4 hold 4 vLLM engines (TP 1). The reward server runs on CPU. serve_rm can serve a reward model instead
# (--reward_pretrain DIR --bf16), which then needs a GPU outside the 8 that Ray uses.
# Memory per GPU, estimated from parameter counts (not measured): actor 7.6 B parameters x 16 bytes (bf16 weights
# and gradients, fp32 master weights and Adam moments) / 4 ranks = ~30 GB, reference bf16 shard ~4 GB, plus
# activations (gradient checkpointing); each engine a full bf16 copy (15 GB) plus KV cache within 0.9 x 80 GB.
# Time per step was not measured (no GPU where this was written): 128 x 4 = 512 responses of up to 1024 tokens.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-Qwen/Qwen2.5-7B-Instruct}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/arithmetic_train.jsonl}
REWARD_FUNC=${REWARD_FUNC:-examples/reward_funcs/arithmetic.py}
RM_PORT=${RM_PORT:-5000}
SAVE=${SAVE:-runs/reinforce_baseline}
RM_LOG=${RM_LOG:-$SAVE/serve_rm.log}

[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task arithmetic --out "$PROMPTS" \
   --num_samples 20000 --seed 0 --max_operand 999 --ops '+-*'

mkdir -p "$(dirname "$RM_LOG")"
python -m openppo.cli.serve_rm --reward_func "$REWARD_FUNC" --host 127.0.0.1 --port "$RM_PORT" > "$RM_LOG" 2>&1 &
RM_PID=$!
# Runs whenever this script exits (success, error, interrupt), so no server is left holding the port.
trap 'kill "$RM_PID" 2>/dev/null || true; wait "$RM_PID" 2>/dev/null || true' EXIT
# serve_rm prints "serving rewards on http://HOST:PORT/get_reward" once it accepts requests.
for _ in $(seq 1 120); do
   grep -q "serving rewards on" "$RM_LOG" && break
   kill -0 "$RM_PID" 2>/dev/null || break  # it exited: reported just below
   sleep 1
done
if ! grep -q "serving rewards on" "$RM_LOG"; then
   echo "error: serve_rm did not become ready; last lines of $RM_LOG:" >&2
   tail -n 20 "$RM_LOG" >&2
   exit 1
fi

python -m openppo.cli.train_ppo_ray \
   --pretrain "$MODEL" --remote_rm_url "http://127.0.0.1:$RM_PORT/get_reward" \
   --actor_num_nodes 1 --actor_num_gpus_per_node 4 --ref_num_nodes 1 --ref_num_gpus_per_node 4 \
   --colocate_actor_ref --vllm_num_engines 4 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.9 \
   --enable_prefix_caching \
   --prompt_data "$PROMPTS" --input_key input --label_key label --apply_chat_template \
   --prompt_max_len 256 --generate_max_len 1024 \
   --advantage_estimator reinforce_baseline --n_samples_per_prompt 4 \
   --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k2 \
   --rollout_batch_size 128 --micro_rollout_batch_size 16 --temperature 1.0 \
   --train_batch_size 128 --micro_train_batch_size 4 --max_epochs 1 --num_episodes 1 \
   --actor_learning_rate 5e-7 --lr_warmup_ratio 0.03 \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --logging_steps 1 --use_tensorboard "$SAVE/tensorboard"

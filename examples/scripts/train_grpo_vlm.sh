#!/usr/bin/env bash
# GRPO on image prompts (vision-language RL), OpenRLHF's VLM recipe in both flag generations (docs/vlm.md).
#
# Trains: SmolVLM-500M-Instruct (Idefics3: the vision-language architecture the CPU tests run, tiny) on the built-in
# shapes task: a picture of 1 to 4 circles, squares and triangles and "How many shapes are in the picture?", written
# by make_task on first use with the pictures inlined in the file. examples/reward_funcs/arithmetic.py gives 1 when
# the last number of the response is the count, else 0. Any model that transformers loads with
# AutoModelForImageTextToText and vLLM serves takes the same path (MODEL=...; a Qwen2-VL-class model places its
# positions itself, untested on a GPU when this was written).
# Algorithm: REINFORCE++-baseline advantages over 8 samples per prompt; KL to the reference as a loss term (k2);
# --freeze_visual_encoder trains the language model only. Image rows are padded (no --packing_samples), and only
# the actor and the reference score them (no critic, no reward model).
# Hardware: 1 node, 4 GPUs shared by the actor (ZeRO-3), the reference and 4 vLLM engines (--colocate_all_models).
# Memory and time per step were not measured (no GPU where this was written); the 0.5 B model is small next to the
# 7B recipes' figures.
set -euo pipefail
cd "$(dirname "$0")/../.."
MODEL=${MODEL:-HuggingFaceTB/SmolVLM-500M-Instruct}
DATA_DIR=${DATA_DIR:-runs/data}
PROMPTS=${PROMPTS:-$DATA_DIR/shapes_train.jsonl}
SAVE=${SAVE:-runs/grpo_vlm}

[[ -f "$PROMPTS" ]] || python -m openppo.cli.make_task --task shapes --out "$PROMPTS" \
   --num_samples 8192 --seed 0 --max_shapes 4 --image_size 224

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --actor.model_name_or_path "$MODEL" --reward.remote_url examples/reward_funcs/arithmetic.py
      --actor.num_nodes 1 --actor.num_gpus_per_node 4 --ref.num_nodes 1 --ref.num_gpus_per_node 4
      --train.colocate_all --vllm.num_engines 4 --vllm.tensor_parallel_size 1 --vllm.gpu_memory_utilization 0.6
      --vllm.enable_sleep --ds.enable_sleep
      --data.prompt_dataset "$PROMPTS" --data.input_key prompt --data.label_key label --data.apply_chat_template
      --data.image_key images --data.max_images_per_prompt 1 --actor.freeze_visual_encoder
      --data.max_len 1024 --rollout.max_new_tokens 256
      --algo.advantage.estimator reinforce_baseline --rollout.n_samples_per_prompt 8
      --algo.kl.init_coef 1e-3 --algo.kl.use_loss --algo.kl.estimator k2
      --rollout.batch_size 64 --rollout.micro_batch_size 8 --train.batch_size 256 --train.micro_batch_size 4
      --actor.adam.lr 1e-6 --ds.zero_stage 3 --ds.param_dtype bf16 --actor.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --ckpt.save_steps 50 --logger.logging_steps 1
   )
else
   ARGS=(
      --pretrain "$MODEL" --remote_rm_url examples/reward_funcs/arithmetic.py
      --actor_num_nodes 1 --actor_num_gpus_per_node 4 --ref_num_nodes 1 --ref_num_gpus_per_node 4
      --colocate_all_models --vllm_num_engines 4 --vllm_tensor_parallel_size 1 --vllm_gpu_memory_utilization 0.6
      --vllm_enable_sleep --deepspeed_enable_sleep
      --prompt_data "$PROMPTS" --input_key prompt --label_key label --apply_chat_template
      --image_key images --max_images_per_prompt 1 --freeze_visual_encoder
      --max_len 1024 --generate_max_len 256
      --advantage_estimator reinforce_baseline --n_samples_per_prompt 8
      --init_kl_coef 1e-3 --use_kl_loss --kl_estimator k2
      --rollout_batch_size 64 --micro_rollout_batch_size 8 --train_batch_size 256 --micro_train_batch_size 4
      --actor_learning_rate 1e-6 --zero_stage 3 --param_dtype bf16 --gradient_checkpointing
      --save_path "$SAVE" --save_steps 50 --logging_steps 1
   )
fi
python -m openppo.cli.train_ppo_ray "${ARGS[@]}"

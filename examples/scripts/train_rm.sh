#!/usr/bin/env bash
# Reward-model recipe (8 GPUs). The saved folder stores the score mean/std that --normalize_reward uses in RL.
set -euo pipefail
MODEL=${MODEL:-runs/sft}
DATA=${DATA:-data/preference.jsonl}
SAVE=${SAVE:-runs/rm}

deepspeed --num_gpus 8 --module openppo.cli.train_rm \
   --pretrain "$MODEL" \
   --dataset "$DATA" --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template \
   --max_len 2048 \
   --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 1 \
   --learning_rate 9e-6 --loss sigmoid \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --save_steps 200 --use_wandb

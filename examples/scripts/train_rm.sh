#!/usr/bin/env bash
# Reward-model recipe (8 GPUs). The saved folder stores the score mean/std that --normalize_reward uses in RL.
set -euo pipefail
MODEL=${MODEL:-runs/sft}
DATA=${DATA:-data/preference.jsonl}
SAVE=${SAVE:-runs/rm}

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --model.model_name_or_path "$MODEL"
      --data.dataset "$DATA" --data.prompt_key prompt --data.chosen_key chosen --data.rejected_key rejected
      --data.apply_chat_template --data.max_len 2048
      --train.batch_size 256 --train.micro_batch_size 4 --train.max_epochs 1
      --adam.lr 9e-6 --model.loss_type sigmoid
      --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
      --model.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --ckpt.save_steps 200 --logger.wandb.key
   )
else
   ARGS=(
      --pretrain "$MODEL"
      --dataset "$DATA" --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template
      --max_len 2048
      --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 1
      --learning_rate 9e-6 --loss sigmoid
      --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing
      --save_path "$SAVE" --save_steps 200 --use_wandb
   )
fi
deepspeed --num_gpus 8 --module openppo.cli.train_rm "${ARGS[@]}"

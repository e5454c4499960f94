#!/usr/bin/env bash
# DPO recipe (8 GPUs); add --ipo for IPO, --label_smoothing 0.1 for cDPO, --nll_loss_coef 0.2 for an NLL term.
set -euo pipefail
MODEL=${MODEL:-runs/sft}
DATA=${DATA:-data/preference.jsonl}
SAVE=${SAVE:-runs/dpo}

deepspeed --num_gpus 8 --module openppo.cli.train_dpo \
   --pretrain "$MODEL" --ref_pretrain "$MODEL" --ref_offload \
   --dataset "$DATA" --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template \
   --max_len 2048 \
   --train_batch_size 128 --micro_train_batch_size 2 --max_epochs 1 \
   --learning_rate 5e-7 --beta 0.1 \
   --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing \
   --save_path "$SAVE" --save_steps 200

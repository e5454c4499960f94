#!/usr/bin/env bash
# DPO recipe (8 GPUs); add --ipo for IPO, --label_smoothing 0.1 for cDPO, --nll_loss_coef 0.2 for an NLL term.
set -euo pipefail
MODEL=${MODEL:-runs/sft}
DATA=${DATA:-data/preference.jsonl}
SAVE=${SAVE:-runs/dpo}

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --model.model_name_or_path "$MODEL" --ref.model_name_or_path "$MODEL" --ref.offload
      --data.dataset "$DATA" --data.prompt_key prompt --data.chosen_key chosen --data.rejected_key rejected
      --data.apply_chat_template --data.max_len 2048
      --train.batch_size 128 --train.micro_batch_size 2 --train.max_epochs 1
      --adam.lr 5e-7 --model.beta 0.1
      --ds.zero_stage 3 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
      --model.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --ckpt.save_steps 200
   )
else
   ARGS=(
      --pretrain "$MODEL" --ref_pretrain "$MODEL" --ref_offload
      --dataset "$DATA" --prompt_key prompt --chosen_key chosen --rejected_key rejected --apply_chat_template
      --max_len 2048
      --train_batch_size 128 --micro_train_batch_size 2 --max_epochs 1
      --learning_rate 5e-7 --beta 0.1
      --zero_stage 3 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing
      --save_path "$SAVE" --save_steps 200
   )
fi
deepspeed --num_gpus 8 --module openppo.cli.train_dpo "${ARGS[@]}"

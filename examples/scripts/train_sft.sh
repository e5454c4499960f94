#!/usr/bin/env bash
# SFT recipe (8 GPUs, one node). On a CPU box use torchrun --nproc_per_node 2, --attn_implementation sdpa
# (flash-attn needs CUDA) and no --param_dtype: the default, auto, picks bf16 on a CPU with bf16 instructions
# (AVX512_BF16 or AMX) and fp32 elsewhere, where PyTorch emulates bf16 (~58x slower per matmul).
set -euo pipefail
MODEL=${MODEL:-Qwen/Qwen2.5-1.5B-Instruct}
DATA=${DATA:-data/sft.jsonl}
SAVE=${SAVE:-runs/sft}

# SPELLING=dotted gives the same run in OpenRLHF >= 0.10's dotted flag names (the default: OpenRLHF <= 0.9's flat
# names); openppo takes either, and both resolve to one config.
if [[ ${SPELLING:-flat} == dotted ]]; then
   ARGS=(
      --model.model_name_or_path "$MODEL"
      --data.dataset "$DATA" --data.input_key input --data.output_key output --data.apply_chat_template
      --data.max_len 4096 --ds.packing_samples
      --train.batch_size 256 --train.micro_batch_size 4 --train.max_epochs 2
      --adam.lr 5e-6 --lr_warmup_ratio 0.03 --lr_scheduler cosine_with_min_lr
      --ds.zero_stage 2 --ds.param_dtype bf16 --ds.attn_implementation flash_attention_2
      --model.gradient_checkpointing_enable
      --ckpt.output_dir "$SAVE" --ckpt.save_steps 200 --ckpt.max_num 3
      --logger.logging_steps 1 --logger.tensorboard_dir "$SAVE/tb"
   )
else
   ARGS=(
      --pretrain "$MODEL"
      --dataset "$DATA" --input_key input --output_key output --apply_chat_template
      --max_len 4096 --packing_samples
      --train_batch_size 256 --micro_train_batch_size 4 --max_epochs 2
      --learning_rate 5e-6 --lr_warmup_ratio 0.03 --lr_scheduler cosine_with_min_lr
      --zero_stage 2 --param_dtype bf16 --attn_implementation flash_attention_2 --gradient_checkpointing
      --save_path "$SAVE" --save_steps 200 --max_ckpt_num 3
      --logging_steps 1 --use_tensorboard "$SAVE/tb"
   )
fi
deepspeed --num_gpus 8 --module openppo.cli.train_sft "${ARGS[@]}"

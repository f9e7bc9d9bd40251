# The two commands of the Quick start: `make demo` and `make test`.
# Both create .venv on first use and install the project into it.  torch is
# installed first (pinned to the CPU build this machine carries) only when the
# venv cannot import any torch, so an existing CUDA build is never replaced.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardkit-installed

.PHONY: demo test install clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e ".[test]"
	@touch $(STAMP)

demo: $(STAMP)
	$(BIN)/python examples/demo.py

test: $(STAMP)
	$(BIN)/python -m pytest

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

# The two commands of the Quick start: `make demo` and `make test`.
# Both create .venv on first use and install the project into it.  torch is
# installed first (pinned to the CPU build this machine carries) only when the
# venv cannot import any torch, so an existing CUDA build is never replaced.
# `make demo` needs shardkit alone; `make test` adds the test extra and, when
# node is there, azurite (the Azure Blob emulator, from npm) under .venv/node,
# where the test fixtures look for it.  Without node the Azure tests skip.

PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.shardkit-installed
TEST_STAMP := $(VENV)/.shardkit-test-installed
AZURITE := $(VENV)/node/node_modules/.bin/azurite-blob

.PHONY: demo test test-deps install azurite bytecode clean

install: $(STAMP)

$(STAMP): pyproject.toml
	@test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	@$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/pip install "torch==2.13.0"
	$(BIN)/pip install -e .
	@touch $(STAMP)

# Bytecode for the working tree, written once here: an editable install compiles nothing, and where
# PYTHONDONTWRITEBYTECODE is set no process writes it either, so every process that imports shardkit
# (each rank, each command, each test's subprocess) compiled its modules again -- about 0.15 s of a
# first load.  Only sources changed since are compiled; a stale .pyc is never used (Python checks the
# source's mtime and size).  Only a speed-up: a file that does not compile is named and skipped (ruff,
# pytest or the demo then report it in their own words).
bytecode: $(STAMP)
	@$(BIN)/python -m compileall -q shardkit cli tests examples benchmarks || echo "bytecode: the files above were not compiled"

$(TEST_STAMP): $(STAMP)
	$(BIN)/pip install -e ".[test]"
	@touch $(TEST_STAMP)

# Only when missing, and only where node and npm exist.
azurite:
	@if test -x $(AZURITE); then :; \
	elif command -v node >/dev/null 2>&1 && command -v npm >/dev/null 2>&1; then \
		npm install --prefix $(VENV)/node --no-audit --no-fund "azurite@^3.37"; \
	else echo "node/npm not found: the Azure Blob tests will be skipped"; fi

demo: $(STAMP) bytecode
	$(BIN)/python examples/demo.py

# ruff: unused names and import order; the suite includes tests/project/test_architecture.py (import layers,
# cycles, private names, module size).  Either failing fails the build.
# The suite runs in two pytest-xdist workers, a test file to a worker (its module fixtures run once): most of
# its time is waiting (process start-up, ranks in collectives, deadlines, servers), so two workers on two
# cores halve it.
test: $(STAMP)
	@$(MAKE) --no-print-directory -j2 test-deps bytecode
	$(BIN)/ruff check .
	$(BIN)/python -m pytest -n 2 --dist loadfile

# the test extra (pip) and azurite (npm) download and unpack at the same time
test-deps: $(TEST_STAMP) azurite

clean:
	rm -rf $(VENV) build *.egg-info .pytest_cache

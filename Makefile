# The two quick-start commands: `make run` (set up + default experiment) and `make test` (set up + test suite).
# `run` installs only the package (CPU JAX, no torch, no libtpu); `test` adds the test extra. Each has its own stamp,
# so `make test` after `make run` still installs the test extra.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test

.PHONY: setup run test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(RUN_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e .
	touch $(RUN_STAMP)

$(TEST_STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[test]'
	touch $(TEST_STAMP)

setup: $(TEST_STAMP)

run: $(RUN_STAMP)
	$(BIN)/python -m experiments.train --config configs/default.py --workdir runs/default

test: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile tests

# The inner loop: every test but the end-to-end ones (the `e2e` marker, pyproject.toml).
test-fast: $(TEST_STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile -m "not e2e" tests

bench: $(TEST_STAMP)
	$(BIN)/python -m experiments.bench --quick --json runs/bench.json

clean:
	rm -rf $(VENV) runs

# The two quick-start commands: `make run` (set up + default experiment) and `make test` (set up + whole test suite).
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: setup run test bench clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[test]'
	touch $(STAMP)

setup: $(STAMP)

run: $(STAMP)
	$(BIN)/python -m experiments.train --config configs/default.py --workdir runs/default

test: $(STAMP)
	$(BIN)/python -m pytest -n 2 --dist loadfile tests

bench: $(STAMP)
	$(BIN)/python -m experiments.bench --quick --json runs/bench.json

clean:
	rm -rf $(VENV) runs

# `make serve` and `make test` each create .venv when missing, install, and run.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: serve test test-fast bench clean

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[dev]'
	touch $(STAMP)

serve: $(STAMP)
	$(BIN)/crossover serve

# The suite waits more than it computes (servers, subprocesses, databases): TEST_WORKERS
# processes share the machine; every real-model test runs in one of them (tests/conftest.py).
TEST_WORKERS ?= 3

test: $(STAMP)
	$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadgroup

test-fast: $(STAMP)
	$(BIN)/python -m pytest -q -m "not slow"

clean:
	rm -rf $(VENV) build *.egg-info

# The two commands of the README. Both create/refresh .venv/ first (fast when it is up to date).
PY := .venv/bin/python
RUN_DIR ?= runs/quickstart
ARGS ?=

.PHONY: install run test test-slow lint bench

install:
	@bash scripts/install.sh

## The main job on CPU with the embedded defaults (shorten with ARGS="trainer.total_steps=3").
run: install
	@bash scripts/quickstart.sh $(RUN_DIR) $(ARGS)

## The test suite (CPU; slow and gpu tests excluded), plus lint.
test: install
	$(PY) -m ruff check megatron_agent tests tools bench
	$(PY) -m pytest -m "not slow and not gpu" -q --durations=25

## What `make test` leaves out: the long runs listed in tests/conftest.py (SLOW) and the README.
test-slow: install
	$(PY) -m pytest -m "slow and not gpu" -q --durations=25

lint: install
	$(PY) -m ruff check megatron_agent tests tools bench
	$(PY) -m ruff format --check megatron_agent tests tools bench

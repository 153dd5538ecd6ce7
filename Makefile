# Two entry points (see README): `make run` and `make test`. Each creates .venv on first use and
# installs only what it needs, at the versions in constraints.txt.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
PIP := $(BIN)/pip install -q -c constraints.txt
RUN_STAMP := $(VENV)/.installed-run
TEST_STAMP := $(VENV)/.installed-test
BENCH_STAMP := $(VENV)/.installed-bench

.PHONY: run test verify bench bench-big bench-cold clean

$(BIN)/python:
	$(PY) -m venv $(VENV)

$(RUN_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim]'
	touch $@

$(TEST_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[sim,dev,model]'
	touch $@

$(BENCH_STAMP): pyproject.toml constraints.txt | $(BIN)/python
	$(PIP) -e '.[bench]'
	touch $@

run: $(RUN_STAMP)
	$(BIN)/python simulate.py $(ARGS)

test: $(TEST_STAMP)
	$(BIN)/python -m pytest

verify: $(TEST_STAMP)
	$(BIN)/python -m spec.verify
	BATCH_STATEFUL_STEPS=1000 BATCH_STATEFUL_EXAMPLES=100 $(BIN)/python -m pytest -q tests/test_stateful.py

bench: $(BENCH_STAMP)
	$(BIN)/python bench.py $(ARGS)

bench-big: $(BENCH_STAMP)
	$(BIN)/python bench.py --big $(ARGS)

# The seed's fairness test cold, a fresh process per measurement (ARGS="--seeds 20 --styles at_once,when_due").
bench-cold: $(RUN_STAMP)
	$(BIN)/python bench/cold_fairness.py $(ARGS)

clean:
	rm -rf $(VENV)

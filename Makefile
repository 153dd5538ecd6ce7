# Two entry points (see README): `make run` and `make test`. Each creates .venv on first use.
PY ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed

.PHONY: run test verify bench bench-big clean

$(STAMP): pyproject.toml
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -e '.[dev,model]'
	touch $(STAMP)

run: $(STAMP)
	$(BIN)/python simulate.py $(ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest

verify: $(STAMP)
	$(BIN)/python -m spec.verify
	BATCH_STATEFUL_STEPS=1000 BATCH_STATEFUL_EXAMPLES=100 $(BIN)/python -m pytest -q tests/test_stateful.py

bench: $(STAMP)
	$(BIN)/python bench.py $(ARGS)

bench-big: $(STAMP)
	$(BIN)/python bench.py --big $(ARGS)

clean:
	rm -rf $(VENV)
